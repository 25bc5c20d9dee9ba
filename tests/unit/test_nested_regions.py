"""A region entered inside another on the same model: the inner one's policy decides, as the innermost
``torch.autocast`` does; the outer one's routed modules (FP32, bf16, FP8 layers) compute in it again on exit."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from region_models import alone as _alone
from region_models import mlp as _mlp
from torch import nn

import mixprec


@pytest.mark.parametrize(
    ("outer", "inner"),
    [
        ("base=mixed_bf16,names=2", "mixed_bf16"),  # an FP32 module outside, bf16 inside
        ("mixed_bf16", "base=mixed_bf16,names=2"),  # and the other way round
        ("fp8", "mixed_bf16"),  # FP8 layers outside, none inside
        ("fp8", "base=fp8,fp8=(keep=first)"),  # another recipe inside
        ("base=mixed_fp16,bf16_names=2", "mixed_fp16"),  # a bf16 module of an fp16 policy outside
        ("base=mixed_fp16,names=2", "base=mixed_fp16,bf16_names=2"),  # FP32 outside, bf16 inside
        ("base=mixed_fp16,kernels=emulated", "mixed_bf16"),  # the outer emulation does not reach inside
        ("base=mixed_fp16,kernels=emulated", "fp32"),
    ],
)
def test_the_innermost_region_decides_and_the_outer_one_again_after_it(outer, inner):
    model, x = _mlp(), torch.randn(8, 16)
    expected_outer, expected_inner = _alone(outer, model, x), _alone(inner, model, x)
    assert not torch.equal(expected_outer, expected_inner)  # the two policies compute differently
    mp = mixprec.MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), outer)
    with torch.no_grad(), mp.autocast():
        assert torch.equal(model(x), expected_outer)
        with mixprec.autocast(inner, model):
            assert torch.equal(model(x), expected_inner)
        assert torch.equal(model(x), expected_outer)
    with torch.no_grad(), mixprec.autocast(inner, model), mp.autocast():  # the engine's region innermost
        assert torch.equal(model(x), expected_outer)


def test_two_engines_on_one_model_each_computes_its_own_policy_in_its_region():
    model, x = _mlp(), torch.randn(8, 16)
    expected = {policy: _alone(policy, model, x) for policy in ("fp8", "base=mixed_bf16,names=0+4")}
    first = mixprec.MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), "fp8")
    second = mixprec.MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), "base=mixed_bf16,names=0+4")
    with torch.no_grad():
        for engine, policy in ((first, "fp8"), (second, "base=mixed_bf16,names=0+4"), (first, "fp8")):
            with engine.autocast():
                assert torch.equal(model(x), expected[policy]), policy
        with first.autocast(), second.autocast():
            assert torch.equal(model(x), expected["base=mixed_bf16,names=0+4"])
        assert torch.equal(model(x), _alone("fp32", model, x))  # no region: FP32 throughout


@pytest.mark.parametrize("outer", ["fp8", "base=mixed_bf16,names=2"])
def test_a_region_on_a_wrapper_or_a_submodule_decides_inside_the_engines(outer):
    model, x = _mlp(), torch.randn(8, 16)
    expected = _alone("mixed_bf16", model, x)
    with torch.no_grad():
        hidden = model[1](model[0](x))
    mp = mixprec.MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), outer)
    compiled = torch.compile(model, backend="eager")  # a wrapper, as DDP's: the region sees the model inside it
    with torch.no_grad(), mp.autocast():
        engines = model[2](hidden)
        with mixprec.autocast("mixed_bf16", compiled):
            assert torch.equal(compiled(x), expected)
        with mixprec.autocast("mixed_bf16", model[2]):  # on a submodule: that one's policy there
            assert torch.equal(model[2](hidden), _alone_layer(model[2], hidden))
        assert torch.equal(model[2](hidden), engines) and not torch.equal(engines, _alone_layer(model[2], hidden))


def _alone_layer(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return _alone("mixed_bf16", layer, x)


def test_a_copied_routed_submodule_leaves_the_model_behind():
    import io

    model = nn.Sequential(nn.Embedding(20000, 64), nn.Linear(64, 64), nn.Linear(64, 8))  # the embedding: 5 MB
    mixprec.MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), "base=mixed_bf16,names=2")
    saved = io.BytesIO()
    torch.save(model[2], saved)
    assert saved.tell() < 100_000  # the layer's 2 kB of weights and its routing, not the model around it
    twin = copy.deepcopy(model[2])
    x = torch.randn(3, 64)
    assert torch.equal(twin(x), nn.functional.linear(x, model[2].weight, model[2].bias))  # its own forward


@pytest.mark.parametrize("engine", [None, "mixed_bf16"])
def test_a_checkpoint_in_a_one_off_region_recomputes_there_after_the_region_closed(engine):
    def gradients(checkpointed: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        block = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
        model = nn.Sequential(block, nn.Linear(16, 4))
        x = torch.randn(4, 16)
        mp = mixprec.MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), engine) if engine else None
        with mp.autocast() if mp else contextlib.nullcontext():
            with mixprec.autocast("base=mixed_bf16,names=0.2", model):  # an FP32 layer inside the checkpoint
                out = model[1](mixprec.checkpoint(block, x) if checkpointed else block(x))
            loss = out.float().pow(2).sum()
        loss.backward()  # after the one-off region closed: its FP32 layer recomputes in FP32
        return [p.grad for p in model.parameters()]

    assert all(torch.equal(a, b) for a, b in zip(gradients(True), gradients(False), strict=True))


@pytest.mark.parametrize("policy", ["fp8", "base=mixed_bf16,names=2"])
def test_an_engine_on_a_compiled_model_computes_its_policy_and_a_copy_leaves_its_output_cast(policy):
    model, x = _mlp(), torch.randn(8, 16)
    expected = _alone(policy, model, x)
    compiled = torch.compile(model, backend="eager")
    mp = mixprec.MixedPrecision(compiled, torch.optim.SGD(model.parameters(), lr=0.1), policy)
    with torch.no_grad(), mp.autocast():
        assert torch.equal(compiled(x), expected)
    with torch.no_grad(), mixprec.autocast("base=mixed_bf16,output=bf16", model):
        twin = copy.deepcopy(model)
    assert twin(x).dtype == torch.float32  # a copy made inside a region is outside it


def test_the_output_cast_outlives_a_released_engine_and_an_fp8_region_inside():
    from mixprec.policy import Fp8Recipe
    from mixprec.regions.fp8 import fp8_region

    model, x = _mlp(), torch.randn(8, 16)
    first = mixprec.MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), "mixed_bf16")
    second = mixprec.MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), "base=mixed_bf16,output=fp16")
    fp8 = fp8_region(model, Fp8Recipe(keep=("first", "last")), torch.bfloat16)  # FP8 layers, no output cast
    with torch.no_grad(), second.autocast(), fp8:
        assert model(x).dtype == torch.float16
    first.release()
    with torch.no_grad(), second.autocast():
        assert model(x).dtype == torch.float16  # the first engine's release left the second's output cast
    second.release()
    assert model(x).dtype == torch.float32 and not model._forward_hooks  # the last one took it out


def test_a_checkpoint_in_a_model_called_inside_another_models_region_recomputes_in_both():
    # distillation: the student, under its engine (an FP32 layer inside its checkpoints), called inside the
    # teacher's one-off region; the recompute enters both regions again, as the forward ran
    def gradients(checkpointed: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        block = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
        student, teacher = nn.Sequential(block, nn.Linear(16, 4)), nn.Linear(16, 4)
        mp = mixprec.MixedPrecision(student, torch.optim.SGD(student.parameters(), lr=0.1), "base=mixed_bf16,names=0.2")
        x = torch.randn(4, 16)
        with mp.autocast():
            with mixprec.autocast("mixed_bf16", teacher):
                target = teacher(x)
                out = student[1](mixprec.checkpoint(block, x) if checkpointed else block(x))
            loss = (out.float() - target.float()).pow(2).sum()
        mp.backward(loss)
        return [p.grad for p in student.parameters()]

    assert all(torch.equal(a, b) for a, b in zip(gradients(True), gradients(False), strict=True))


def test_a_whole_model_pickled_with_the_earlier_output_cast_hook_still_loads(tmp_path):
    import importlib

    regions_autocast = importlib.import_module(
        "mixprec.regions.autocast"
    )  # the module (the package exports a function)
    model, x = _mlp(), torch.randn(2, 16)
    model.register_forward_hook(regions_autocast._cast_outputs)  # what torch.save(model) stored before
    torch.save(model, tmp_path / "model.pt")
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    assert torch.equal(loaded(x), model(x))
    with torch.no_grad(), mixprec.autocast("base=mixed_bf16,output=bf16", loaded):
        assert loaded(x).dtype == torch.bfloat16  # a region of today casts its outputs
