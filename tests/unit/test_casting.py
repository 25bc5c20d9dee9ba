import re

import pytest
import torch
from torch import nn

import mixprec


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.bn = nn.BatchNorm1d(8)


class LlamaRMSNorm(nn.Module):  # a normalization layer defined outside torch
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(8))


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.block = Block()
        self.rms = LlamaRMSNorm()
        self.lm_head = nn.Linear(8, 10)


def dtypes(model):
    return {name: p.dtype for name, p in model.named_parameters()} | {
        name: b.dtype for name, b in model.named_buffers()
    }


def test_o2_keeps_every_norm_fp32():
    model = mixprec.cast_module(Model(), mixprec.get_policy("o2_bf16"))
    got = dtypes(model)
    fp32 = {k for k, v in got.items() if v == torch.float32}
    assert fp32 == {
        "block.norm.weight",
        "block.norm.bias",
        "block.bn.weight",
        "block.bn.bias",
        "block.bn.running_mean",
        "block.bn.running_var",
        "rms.weight",
    }
    assert got["block.bn.num_batches_tracked"] == torch.int64  # non-floating buffers untouched
    assert got["embed.weight"] == got["lm_head.weight"] == torch.bfloat16


class PreNorm(nn.Module):  # a block named like a norm that holds layers: not a norm, the norm inside it is
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.fn = nn.Linear(8, 8)


class ResNetNoNorm(nn.Module):  # a root model named like a norm
    def __init__(self) -> None:
        super().__init__()
        self.body = PreNorm()
        self.head = nn.Linear(8, 2)


def test_a_model_or_block_named_like_a_norm_is_not_kept_whole():
    model = mixprec.cast_module(ResNetNoNorm(), mixprec.get_policy("o2_bf16"))
    fp32 = {k for k, v in dtypes(model).items() if v == torch.float32}
    assert fp32 == {"body.norm.weight", "body.norm.bias"}
    assert [name for name, _ in mixprec.fp32_modules(model, mixprec.get_policy("o2_bf16"))] == ["body.norm"]


class Attending(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(16, 2, batch_first=True)
        self.fc = nn.Linear(16, 4)

    def forward(self, x):
        return self.fc(self.attn(x, x, x)[0])


@pytest.mark.parametrize("spec", ["base=mixed_bf16,names=attn.out_proj", "base=mixed_bf16,mods=Linear"])
def test_an_fp32_rule_on_a_layer_whose_forward_is_bypassed_is_warned_about(spec):
    # MultiheadAttention reads out_proj.weight itself: the rule kept the weight FP32, the compute stayed bf16
    model = Attending()
    with pytest.warns(UserWarning, match=r"\['attn.out_proj'\].*Keep the attention instead: names=attn"):
        mixprec.MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), spec)


def test_an_fp32_rule_on_the_attention_itself_is_not_warned_about(recwarn):
    model = Attending()
    mixprec.MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), "base=mixed_bf16,names=attn")
    assert not [w for w in recwarn if "MultiheadAttention" in str(w.message)]


def test_name_globs_and_classes():
    policy = mixprec.get_policy("p=f16,c=f16,names=*.lm_head,mods=Embedding")
    got = dtypes(mixprec.cast_module(Model(), policy))
    fp32 = {k for k, v in got.items() if v == torch.float32}
    assert fp32 == {"lm_head.weight", "lm_head.bias", "embed.weight"}
    kept = [name for name, _ in mixprec.fp32_modules(Model(), policy)]
    assert kept == ["embed", "lm_head"]


def test_kept_module_children_are_listed_once():
    policy = mixprec.get_policy("p=bf16,names=block+block.norm")
    assert [name for name, _ in mixprec.fp32_modules(Model(), policy)] == ["block"]


def test_cast_keeps_parameter_identity_for_optimizers():
    model = Model()
    params = list(model.parameters())
    model.lm_head.weight.grad = torch.ones_like(model.lm_head.weight)
    mixprec.cast_module(model, mixprec.get_policy("pure_bf16"))
    assert all(a is b for a, b in zip(params, model.parameters(), strict=True))
    assert model.lm_head.weight.grad.dtype == torch.bfloat16


def test_recasting_restores_fp32():
    model = mixprec.cast_module(Model(), mixprec.get_policy("pure_bf16"))
    mixprec.cast_module(model, mixprec.get_policy("fp32"))
    assert set(dtypes(model).values()) == {torch.float32, torch.int64}


def test_cast_values_match_torch_casts():
    model = Model()
    reference = model.lm_head.weight.detach().to(torch.float16)
    mixprec.cast_module(model, mixprec.get_policy("o2_fp16"))
    assert torch.equal(model.lm_head.weight.detach(), reference)


def test_rejects_non_modules():
    with pytest.raises(TypeError, match=r"needs a torch\.nn\.Module; received an object of type dict"):
        mixprec.cast_module({}, mixprec.get_policy("fp32"))  # type: ignore[arg-type]


def test_an_fp32_entry_matching_no_module_is_refused_with_the_names_there_are():
    model = nn.Sequential()
    model.add_module("fc1", nn.Linear(4, 4))
    model.add_module("fc2", nn.Linear(4, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"fp32_names entry 'fc_2' matches no module .* did you mean fc2"):
        mixprec.MixedPrecision(model, optimizer, "base=mixed_bf16,names=fc_2")
    with pytest.raises(ValueError, match=r"fp32_modules entry 'Linaer' matches no module .* did you mean Linear"):
        mixprec.MixedPrecision(model, optimizer, "base=mixed_bf16,mods=Linaer")
    # the norm alias of the presets, a glob and a class that match: accepted
    with mixprec.autocast("base=o2_bf16,names=*.fc2+fc1,mods=Linear", model):
        pass


def test_a_refused_fp32_entry_leaves_the_model_as_it_was():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    with pytest.raises(ValueError, match=r"fp32_names entry 'head'"):
        mixprec.MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), "base=o2_bf16,names=head")
    assert all(p.dtype == torch.float32 for p in model.parameters())  # refused before the cast


def test_fp32_names_match_a_wrapped_model_with_or_without_the_wrappers_prefix():
    # the doctor names modules of the bare model; Lightning builds MixedPrecision on DDP's wrapper ("module.")
    compiled = torch.compile(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)))  # "_orig_mod." before every name
    for names in ("1", "_orig_mod.1", "*.1"):
        policy = mixprec.get_policy(f"base=o2_bf16,names={names}")
        assert [name for name, _ in mixprec.fp32_modules(compiled, policy)] == ["_orig_mod.1"], names
    with pytest.raises(ValueError, match=r"'module.1' matches no module .* Its module names: _orig_mod, 0, 1"):
        mixprec.autocast("base=o2_bf16,names=module.1", compiled).__enter__()


def test_a_weight_tied_across_an_fp32_module_and_a_lowered_one_is_refused():
    # TinyGPT's embedding is its output head: under o2 the module cast last decided the tensor's dtype, so
    # names=embed (and the docs' mods=norm+Embedding) was dropped silently, and names=lm_head made a master for
    # an FP32 weight, the first step then refused with a misleading message
    from mixprec.app.tasks.tiny_gpt import GPTConfig, TinyGPT

    for spec in ("base=o2_bf16,names=embed", "base=o2_bf16,mods=norm+Embedding", "base=o2_bf16,names=lm_head"):
        model = TinyGPT(GPTConfig(layers=1, width=32, heads=2, context=16))
        with pytest.raises(ValueError, match=r"tied weights.*one tensor has one dtype"):
            mixprec.MixedPrecision(model, torch.optim.AdamW(model.parameters()), spec)
        assert model.embed.weight.dtype == torch.float32  # refused before anything was cast
    for spec in ("base=o2_bf16,names=embed+lm_head", "base=mixed_bf16,names=embed"):  # both kept; nothing lowered
        model = TinyGPT(GPTConfig(layers=1, width=32, heads=2, context=16))
        mixprec.MixedPrecision(model, torch.optim.AdamW(model.parameters()), spec)
        assert model.embed.weight.dtype == torch.float32


def test_a_module_registered_under_two_names_is_kept_by_either():
    # named_modules() lists a shared module once: names=b was refused as matching no module ("Its module names: a, c")
    class Shared(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.c = nn.Linear(8, 8), nn.Linear(8, 8)
            self.b = self.a

        def forward(self, x):
            return self.c(self.b(x))

    model, seen = Shared(), {}
    model.a.register_forward_hook(lambda module, inputs, output: seen.update(dtype=output.dtype))
    with mixprec.autocast("base=mixed_bf16,names=b", model):
        model(torch.randn(2, 8))
    assert seen["dtype"] == torch.float32


@pytest.mark.parametrize(
    ("spec", "said"),
    [("base=mixed_bf16,names=a", "names=a"), ("base=mixed_bf16,mods=norm+Embedding", "mods=Embedding"),
     ("base=mixed_fp16,bf16_names=a", "bf16_names=a")],
)  # fmt: skip
def test_module_rules_without_the_model_are_refused(spec, said):
    # without the model the named modules computed in the region's dtype, silently
    with (
        pytest.raises(ValueError, match=f"keeps modules by {re.escape(said)}, which needs the model"),
        mixprec.autocast(spec),
    ):
        pass
    with mixprec.autocast("mixed_bf16"):  # a preset's norm rule needs no model
        pass


def test_cast_module_refuses_a_tied_weight_split_between_fp32_and_16_bits():
    # as a region's preparation refuses it: the module cast last decided the tensor's dtype, silently
    class LM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb, self.head = nn.Embedding(10, 4), nn.Linear(4, 10, bias=False)
            self.head.weight = self.emb.weight

    with pytest.raises(ValueError, match=r"'emb.weight' is also 'head.weight' \(one tensor: tied weights\)"):
        mixprec.cast_module(LM(), "base=o2_bf16,names=emb")
    assert mixprec.cast_module(LM(), "o2_bf16").emb.weight.dtype == torch.bfloat16
