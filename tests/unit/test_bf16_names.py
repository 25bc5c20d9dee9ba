"""bf16_names: an fp16 policy computes the named modules in bf16 (bf16's range where fp16's is too small), the
rest in fp16; modules kept in FP32 stay FP32 inside them."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec
from mixprec.policy import export_policy, get_policy

KERNELS = ["native", "emulated"]  # PyTorch's 16-bit kernels, or the exact emulation of both formats


class Net(nn.Module):
    """A layer whose outputs pass fp16's 65504 (``big``), a block around it with an FP32-kept layer inside."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.block = nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 16))
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, 4)
        with torch.no_grad():
            self.block[0].weight.mul_(1e6)  # outputs around 1e6

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.block(F.gelu(self.inp(x)))))


def _outputs(model: nn.Module, policy: str, x: torch.Tensor) -> dict[str, torch.Tensor]:
    seen: dict[str, torch.Tensor] = {}
    hooks = [
        module.register_forward_hook(lambda m, a, out, name=name: seen.__setitem__(name, out))
        for name, module in model.named_modules()
        if name
    ]
    if isinstance(model, Net):
        hooks.append(model.block.register_forward_pre_hook(lambda m, args: seen.__setitem__("block input", args[0])))
    try:
        with mixprec.autocast(policy, model):
            seen["model"] = model(x)
    finally:
        for hook in hooks:
            hook.remove()
    return seen


def test_the_policy_string_reads_back_and_refuses_what_cannot_hold():
    policy = get_policy("base=mixed_fp16,bf16_names=block+*.mlp.2")
    assert policy.bf16_names == ("block", "*.mlp.2") and get_policy(str(policy)) == policy
    assert "bf16_names=block+*.mlp.2" in str(policy)
    for spec, says in [
        ("base=mixed_bf16,bf16_names=block", "received compute=bfloat16"),  # every module is bf16 already
        ("base=o2_fp16,bf16_names=block", "needs FP32 parameters"),
    ]:
        with pytest.raises(ValueError, match=says):
            get_policy(spec)


def test_fp8_layers_beside_bf16_modules_each_compute_in_their_format():
    from mixprec.regions.fp8 import gemm_selection

    torch.manual_seed(0)
    model, x = Net(), torch.randn(4, 8)
    with_fp8 = "base=fp8,compute=fp16,fp8=(keep=first),bf16_names=block"  # inp kept out of FP8 by the recipe
    prepared = mixprec.prepare(model, with_fp8)
    fp32, bf16 = [n for n, _ in prepared.fp32_modules], [n for n, _ in prepared.bf16_modules]
    selection = gemm_selection(model, prepared.policy.fp8, fp32, bf16)
    assert [name for name, _, _ in selection.fp8] == ["head"]
    assert {k.name: k.reason for k in selection.kept} == {
        "inp": "kept by the recipe (first)",
        "block.0": "inside a bf16 module of the policy",
        "block.2": "inside a bf16 module of the policy",
    }
    fp8, plain = _outputs(model, with_fp8, x), _outputs(model, "base=mixed_fp16,bf16_names=block", x)
    assert torch.equal(fp8["block"], plain["block"]) and fp8["block"].dtype == torch.bfloat16  # bf16 in both
    assert torch.isfinite(fp8["model"]).all() and not torch.equal(fp8["model"], plain["model"])  # head in FP8


def test_a_name_that_matches_no_module_is_refused():
    with pytest.raises(ValueError, match=r"bf16_names entry 'blok'.*compute in bf16.*did you mean block"):
        mixprec.prepare(Net(), "base=mixed_fp16,bf16_names=blok")


def test_a_name_whose_modules_are_all_kept_in_fp32_is_refused_and_one_with_a_module_outside_is_taken():
    with pytest.raises(ValueError, match=r"bf16_names entry 'block.2' matches only modules kept in FP32 \(block: "):
        mixprec.prepare(Net(), "base=mixed_fp16,names=block,bf16_names=block.2")
    prepared = mixprec.prepare(Net(), "base=mixed_fp16,names=block.0,bf16_names=block.?")
    assert [name for name, _ in prepared.bf16_modules] == ["block.1", "block.2"]  # FP32 wins for block.0


@pytest.mark.parametrize("kernels", KERNELS)
def test_the_named_module_computes_in_bf16_and_its_overflow_is_gone(kernels):
    torch.manual_seed(0)
    model, x = Net(), torch.randn(32, 8)
    fp16 = _outputs(model, f"base=mixed_fp16,kernels={kernels}", x)
    assert not torch.isfinite(fp16["model"]).all()  # the block's first layer overflows fp16
    mixed = _outputs(model, f"base=mixed_fp16,kernels={kernels},bf16_names=block", x)
    assert torch.isfinite(mixed["model"]).all()
    assert mixed["inp"].dtype == torch.float16 and mixed["head"].dtype == torch.float16  # fp16 around it
    assert mixed["block.0"].dtype == torch.bfloat16 and mixed["block.2"].dtype == torch.bfloat16
    # the layer's product from bf16-rounded inputs and weights, as autocast's bf16 GEMM computes it
    inputs = mixed["block input"]
    assert inputs.dtype == torch.float16
    reference = F.linear(inputs.bfloat16(), model.block[0].weight.bfloat16(), model.block[0].bias.bfloat16())
    if kernels == "emulated":  # FP32 accumulation, one rounding to bf16
        reference = F.linear(
            inputs.bfloat16().float(), model.block[0].weight.bfloat16().float(), model.block[0].bias.bfloat16().float()
        ).bfloat16()
    torch.testing.assert_close(mixed["block.0"], reference, rtol=0, atol=0)


@pytest.mark.parametrize("kernels", KERNELS)
def test_a_module_kept_in_fp32_inside_a_bf16_module_stays_fp32(kernels):
    torch.manual_seed(0)
    model, x = Net(), torch.randn(32, 8)
    seen = _outputs(model, f"base=mixed_fp16,kernels={kernels},bf16_names=block,fp32_names=block.2", x)
    assert seen["block.0"].dtype == torch.bfloat16
    assert seen["block.2"].dtype == torch.float32
    expected = F.linear(F.gelu(seen["block.0"]).float(), model.block[2].weight, model.block[2].bias)
    torch.testing.assert_close(seen["block.2"], expected, rtol=0, atol=0)


@pytest.mark.parametrize("kernels", KERNELS)
def test_an_fp16_layer_right_after_a_bf16_module_takes_its_output_as_autocast_would(kernels):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 16), nn.Linear(16, 4))
    seen = _outputs(model, f"base=mixed_fp16,kernels={kernels},bf16_names=2", torch.randn(32, 8))
    given, out = seen["2"], seen["3"]
    assert given.dtype == torch.bfloat16 and out.dtype == torch.float16
    weight, bias = model[3].weight, model[3].bias
    if kernels == "native":
        expected = F.linear(given.half(), weight.half(), bias.half())
    else:  # the emulation: fp16 roundings of inputs and output, FP32 accumulation
        expected = F.linear(given.half().float(), weight.half().float(), bias.half().float()).half()
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_two_regions_on_one_model_released_out_of_order_leave_the_other_routing_and_then_nothing():
    model = Net()
    first = mixprec.MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), "base=mixed_bf16,names=head")
    second = mixprec.MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), "base=mixed_bf16,names=head")
    first.release()
    with second.autocast():
        assert model(torch.randn(2, 8)).dtype == torch.float32  # the head still computes in FP32
    seen = {}
    model.head.register_forward_hook(lambda m, a, out: seen.__setitem__("head", out))
    with second.autocast():
        model(torch.randn(2, 8))
    assert seen["head"].dtype == torch.float32
    second.release()
    assert "forward" not in vars(model.head)  # every routing taken out


def test_a_copy_made_inside_the_region_computes_outside_it():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 16), nn.Linear(16, 4))
    with mixprec.autocast("base=mixed_fp16,bf16_names=1", model):
        copied = copy.deepcopy(model)
    x = torch.randn(2, 8)
    torch.testing.assert_close(copied(x), model(x), rtol=0, atol=0)  # FP32 throughout, as the original outside
    assert copied(x).dtype == torch.float32


def test_training_applies_the_steps_fp16_alone_skips():
    def applied(policy: str) -> int:
        torch.manual_seed(0)
        model = Net()
        mp = mixprec.MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=1e-3), policy)
        count = 0
        for _ in range(4):
            with mp.autocast():
                loss = model(torch.randn(16, 8)).float().pow(2).mean()
            mp.backward(loss)
            count += bool(mp.step().applied)
        return count

    assert applied("base=mixed_fp16,kernels=emulated") == 0  # every step's loss is inf: skipped
    assert applied("base=mixed_fp16,kernels=emulated,bf16_names=block") == 4
    assert applied("base=fp8,compute=fp16,kernels=emulated,bf16_names=block") == 4  # FP8 layers beside it


def test_the_plan_the_policy_command_and_an_fp16_export_name_the_bf16_modules():
    prepared = mixprec.prepare(Net(), "base=mixed_fp16,bf16_names=block")
    assert [name for name, _ in prepared.bf16_modules] == ["block"]
    assert "the modules of bf16_names (block) in bf16" in prepared.plan.reason
    trained = prepared.policy
    assert export_policy(trained, "fp16").fp32_names == ("block",)  # fp16 weights: the range needs FP32
    assert export_policy(trained, "bf16").fp32_names == ()


def test_a_transformers_gpt2_trains_with_its_mlps_in_bf16_checkpointed_or_not():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=128, n_positions=32)
    model = transformers.GPT2LMHeadModel(config)
    policy = "base=mixed_fp16,kernels=native,bf16_names=transformer.h.?.mlp"  # Conv1D layers, by one glob
    mp = mixprec.MixedPrecision(model, torch.optim.AdamW(model.parameters(), lr=1e-3), policy)
    seen = {}
    model.transformer.h[1].mlp.c_fc.register_forward_hook(lambda m, a, out: seen.__setitem__("c_fc", out.dtype))
    model.transformer.h[1].attn.c_attn.register_forward_hook(lambda m, a, out: seen.__setitem__("c_attn", out.dtype))
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    losses = []
    for checkpointed in (False, False, True, True):
        if checkpointed:
            model.gradient_checkpointing_enable()
        with mp.autocast():
            loss = model(tokens, labels=tokens).loss
        mp.backward(loss)
        assert mp.step().applied
        losses.append(loss.item())
    assert seen == {"c_fc": torch.bfloat16, "c_attn": torch.float16}
    assert losses[-1] < losses[0]
