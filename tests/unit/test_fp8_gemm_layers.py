"""FP8 on every GEMM layer: nn.Linear, transformers' Conv1D, the mixprec_gemm protocol and registered types;
the layers kept out, each with its reason, in the compute plan."""

from __future__ import annotations

import functools
import logging

import pytest
import torch
from torch import nn

import mixprec
from mixprec.policy.fp8_recipe import Fp8Recipe
from mixprec.regions.fp8 import Fp8LinearState, fp8_linear, register_gemm_layer, select_gemm_layers
from mixprec.regions.fp8.gemm_layers import gemm_operands


def _gpt2(layers: int = 2):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=layers, n_embd=32, n_head=2, vocab_size=64, n_positions=16)
    return transformers.GPT2LMHeadModel(config)


def test_a_transformers_gpt2_computes_every_projection_in_fp8_and_keeps_its_tied_head():
    model = _gpt2()
    mp = mixprec.MixedPrecision(model, torch.optim.AdamW(model.parameters()), "fp8")
    reason = mp.compute_plan.reason
    assert "8 of 9 GEMM layers in FP8" in reason  # 4 Conv1D projections per block, 2 blocks
    assert "kept: lm_head (Linear): kept by the recipe (head: the language-model head)" in reason
    conv1d = [name for name, module in model.named_modules() if type(module).__name__ == "Conv1D"]
    routed = [name for name, module in model.named_modules() if "forward" in vars(module)]
    assert len(conv1d) == 8 and routed == conv1d
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    with mp.autocast():
        loss = model(tokens, labels=tokens).loss
    assert mp.backward(loss) is None and mp.step()
    assert all(torch.isfinite(p).all() for p in model.parameters())


@pytest.fixture
def one_thread():
    """One thread, as the suite runs (tests/conftest.py), also when a test runs alone: with more, the CPU's GEMM
    splits the sums of a transposed weight differently from a contiguous one's, and the two differ in the last bit."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_conv1d_in_fp8_equals_the_linear_with_its_transposed_weight_forward_and_backward(one_thread):
    pytest.importorskip("transformers")
    from transformers.pytorch_utils import Conv1D

    torch.manual_seed(0)
    conv = Conv1D(48, 32)  # nf=48 outputs, nx=32 inputs: weight (32, 48)
    linear = nn.Linear(32, 48)
    with torch.no_grad():
        linear.weight.copy_(conv.weight.t())
        linear.bias.copy_(conv.bias)
    x = torch.randn(5, 32)
    results = []
    for module in (conv, linear):
        inputs = x.clone().requires_grad_()
        weight, bias = gemm_operands(module)(module)
        out = fp8_linear(inputs, weight, bias, Fp8LinearState(Fp8Recipe(scaling="current")), torch.float32)
        out.square().sum().backward()
        grad_weight = module.weight.grad if module is linear else module.weight.grad.t()
        results.append((out, inputs.grad, grad_weight, module.bias.grad))
    for ours, reference in zip(*results, strict=True):
        assert torch.equal(ours, reference)


class _Projection(nn.Module):
    """A GEMM layer of the user's own, storing its weight as (in, out), declared through the protocol."""

    def __init__(self, inputs: int, outputs: int) -> None:
        super().__init__()
        self.kernel = nn.Parameter(torch.randn(inputs, outputs) * 0.1)

    def forward(self, x):
        return x @ self.kernel

    def mixprec_gemm(self):
        return self.kernel.t(), None


class _Registered(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(16, 32) * 0.1)  # (out, in)

    def forward(self, x):
        return x @ self.w.t()


def test_the_protocol_and_registered_types_compute_in_fp8():
    register_gemm_layer(_Registered, lambda module: (module.w, None))
    torch.manual_seed(0)
    model = nn.Sequential(_Projection(16, 32), nn.GELU(), _Registered(), nn.Linear(16, 16))
    x = torch.randn(8, 16) * 3
    with torch.no_grad():
        plain = model(x)
    mp = mixprec.MixedPrecision(model, torch.optim.AdamW(model.parameters()), "base=fp8,fp8=(keep=none)")
    assert "3 of 3 GEMM layers in FP8" in mp.compute_plan.reason
    with torch.no_grad(), mp.autocast():
        quantized = model(x)
    projection, recipe = model[0], mp.policy.fp8
    with torch.no_grad():  # the first layer's output is the FP8 product of its declared operands
        expected = fp8_linear(x, projection.kernel.t(), None, Fp8LinearState(recipe), torch.bfloat16)
    assert not torch.equal(quantized, plain) and (quantized - plain).abs().max() < 0.5
    with torch.no_grad(), mp.autocast():
        assert torch.equal(model[0](x), expected)
    with pytest.raises(TypeError, match=r"register_gemm_layer\(module_type=\.\.\.\) needs an nn.Module subclass"):
        register_gemm_layer(int, lambda m: None)


def test_every_kept_layer_is_reported_with_its_reason():
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(64, 32)
            self.stem = nn.Conv2d(3, 8, 3)
            self.first = nn.Linear(32, 32)
            self.attn = nn.MultiheadAttention(32, 2)
            self.norm_block = nn.Sequential(nn.Linear(32, 32))
            self.mlp_small = nn.Linear(32, 20)
            self.body = nn.Linear(32, 32)
            self.head = nn.Linear(32, 64, bias=False)
            self.head.weight = self.embed.weight  # tied: the language-model head

    model = Net()
    selection = select_gemm_layers(model, ("first", "head", "body"), fp32=("norm_block",), kernel=True)
    kept = {k.name: k.reason for k in selection.kept}
    assert kept["first"] == "kept by the recipe (first)"
    assert kept["head"] == "kept by the recipe (head: the language-model head)"
    assert kept["body"] == "kept by the recipe (matches 'body')"
    assert kept["norm_block.0"] == "inside an FP32 module of the policy"
    assert kept["mlp_small"] == "shape 32 -> 20 not divisible by 16 (the FP8 GEMM kernel's requirement)"
    assert kept["stem"].startswith("not supported: not a GEMM layer")
    assert kept["attn.out_proj"].startswith("not supported: nn.MultiheadAttention reads its weights itself")
    assert [name for name, _, _ in selection.fp8] == []
    emulated = select_gemm_layers(model, (), kernel=False)  # the emulation takes any shape; nothing kept by name
    assert [name for name, _, _ in emulated.fp8] == ["first", "norm_block.0", "mlp_small", "body", "head"]
    assert emulated.describe().startswith("5 of 5 GEMM layers in FP8; not supported: stem (Conv2d): not a GEMM")


def test_keep_none_puts_the_head_in_fp8_and_round_trips():
    policy = mixprec.get_policy("base=fp8,fp8=(keep=none)")
    assert policy.fp8.keep == () and mixprec.get_policy(str(policy)) == policy and "keep=none" in str(policy)
    assert mixprec.get_policy("fp8").fp8.keep == ("head",)


def test_an_fp8_policy_that_reaches_no_layer_says_so(caplog):
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU())
    with caplog.at_level(logging.WARNING, logger="mixprec"):
        mp = mixprec.MixedPrecision(model, torch.optim.AdamW(model.parameters()), "fp8")
    assert "none of this model's layers in FP8: 0 of 0 GEMM layers in FP8; not supported: 0 (Conv2d)" in caplog.text
    assert "0 of 0 GEMM layers in FP8" in mp.compute_plan.reason


def _block() -> nn.Module:
    return nn.ModuleDict({"attn": nn.Linear(16, 16), "mlp": nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 16))})


def _blocks() -> nn.Module:
    torch.manual_seed(0)
    return nn.ModuleDict({"blocks": nn.ModuleList([_block(), _block()]), "lm_head": nn.Linear(16, 8)})


def test_a_per_layer_policy_puts_only_the_matched_layers_in_fp8_the_head_in_fp32_and_round_trips():
    # FP8 for the MLP projections, the compute dtype (bf16) for attention, FP32 for the head
    spec = "base=mixed_bf16,fp8=hybrid(scaling=current,only=*.mlp.*),fp32_names=lm_head"
    policy = mixprec.get_policy(spec)
    assert policy.fp8.only == ("*.mlp.*",) and mixprec.get_policy(str(policy)) == policy
    model = _blocks()
    mp = mixprec.MixedPrecision(model, torch.optim.AdamW(model.parameters()), policy)
    reason = mp.compute_plan.reason
    assert "4 of 7 GEMM layers in FP8" in reason
    assert "blocks.0.attn (Linear): left out by the recipe (only=*.mlp.*)" in reason
    assert "lm_head (Linear): inside an FP32 module of the policy" in reason
    routed = {name: type(vars(module)["forward"]).__name__ for name, module in model.named_modules()
              if "forward" in vars(module)}  # fmt: skip
    assert sorted(name for name, kind in routed.items() if kind == "_Fp8Forward") == [
        f"blocks.{b}.mlp.{i}" for b in (0, 1) for i in (0, 1)
    ]
    assert routed["lm_head"] == "_FormatForward"  # the FP32 module's routing
    seen = {}

    def note(module, inputs, output, name):  # returns None: the output stays
        seen[name] = output.dtype

    for name in ("blocks.0.attn", "blocks.0.mlp.0", "lm_head"):
        model.get_submodule(name).register_forward_hook(functools.partial(note, name=name))
    with mp.autocast():
        x = torch.randn(4, 16)
        for block in model["blocks"]:
            x = block["mlp"](block["attn"](x))
        model["lm_head"](x)
    assert seen == {"blocks.0.attn": torch.bfloat16, "blocks.0.mlp.0": torch.bfloat16, "lm_head": torch.float32}


def test_only_and_keep_together_and_bad_globs_are_refused():
    selection = select_gemm_layers(_blocks(), keep=("blocks.1.*",), only=("*.mlp.*",))
    assert [name for name, _, _ in selection.fp8] == ["blocks.0.mlp.0", "blocks.0.mlp.1"]
    assert str(Fp8Recipe(only=("*.mlp.*", "*.fc"))) == "hybrid(only=*.mlp.*+*.fc)"
    assert mixprec.get_policy("base=fp8,fp8=(only=all)").fp8.only == ()
    with pytest.raises(ValueError, match=r"Fp8Recipe\(only=...\): \['a,b'\] contain separators"):
        Fp8Recipe(only=("a,b",))
    with pytest.raises(TypeError, match=r"Fp8Recipe\(only=...\) takes a tuple of name globs; received '\*.mlp'"):
        Fp8Recipe(only="*.mlp")
