"""A one-off region written per batch (``with mixprec.autocast(policy, model):`` in a loop, as the integrations'
evaluation regions are) is prepared once and enters the same routed forwards each time: a compiled model is not
recompiled at every batch, and the model is left as it was after each."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from region_models import alone as _alone
from region_models import mlp as _mlp
from torch import nn

import mixprec


def _untouched(model: nn.Module) -> bool:
    """No routed forward and no hook left on any module."""
    return all("forward" not in vars(m) and not m._forward_hooks for m in model.modules())


@pytest.mark.parametrize("policy", ["fp8", "base=mixed_bf16,names=2", "base=mixed_fp16,kernels=native,bf16_names=2"])
def test_a_compiled_model_in_a_one_off_region_per_batch_compiles_once(policy):
    torch._dynamo.reset()
    model, compiles = _mlp(), []

    def counting(graph, example_inputs):
        compiles.append(graph)
        return graph.forward

    compiled = torch.compile(model, backend=counting)
    after_warm_up = None
    for batch in range(6):
        x = torch.randn(8, 16)
        expected = _alone(policy, model, x)
        with torch.no_grad(), mixprec.autocast(policy, compiled):
            assert torch.equal(compiled(x), expected), batch
        assert _untouched(model)
        if batch == 1:  # the first region watches for attention, the next ones know there is none
            after_warm_up = len(compiles)
    assert len(compiles) == after_warm_up  # a new region each batch recompiled: 6 graphs in 6 batches


def test_a_module_replaced_between_regions_computes_in_the_policys_format():
    model, x = _mlp(), torch.randn(8, 16)
    with torch.no_grad(), mixprec.autocast("base=mixed_bf16,names=2", model):
        model(x)
    model[2] = nn.Linear(32, 32)  # the kept region routed the old one
    with torch.no_grad(), mixprec.autocast("base=mixed_bf16,names=2", model):
        out = model(x)
    assert torch.equal(out, _alone("base=mixed_bf16,names=2", model, x))
    assert not torch.equal(out, _alone("mixed_bf16", model, x))  # the new layer in FP32, not bf16


def test_a_region_nested_in_its_own_policy_keeps_computing_after_the_inner_one():
    model, x = _mlp(), torch.randn(8, 16)
    expected = _alone("fp8", model, x)
    with torch.no_grad(), mixprec.autocast("fp8", model):
        with mixprec.autocast("fp8", model):
            assert torch.equal(model(x), expected)
        assert torch.equal(model(x), expected)  # the inner one's exit left the outer one's FP8 layers routed
    assert _untouched(model)


def test_policies_alternated_on_one_model_each_compute_their_own():
    model, x = _mlp(), torch.randn(8, 16)
    policies = ["fp8", "base=mixed_bf16,names=0+4", "mixed_bf16", "base=mixed_fp16,kernels=emulated", "fp32"]
    expected = {policy: _alone(policy, model, x) for policy in policies}
    with torch.no_grad():
        for _ in range(3):  # more policies than the model keeps regions for
            for policy in policies:
                with mixprec.autocast(policy, model):
                    assert torch.equal(model(x), expected[policy]), policy
    assert _untouched(model)


def test_a_model_copied_or_saved_after_one_off_regions_carries_none_of_them():
    model, x = _mlp(), torch.randn(8, 16)
    for policy in ("fp8", "base=mixed_bf16,names=2"):
        with torch.no_grad(), mixprec.autocast(policy, model):
            model(x)
    saved = io.BytesIO()
    torch.save(model, saved)
    assert saved.tell() < 20_000  # the weights (3.6 kB) and the modules: no region, plan or FP8 selection
    saved.seek(0)
    for twin in (copy.deepcopy(model), torch.load(saved, weights_only=False)):
        with torch.no_grad(), mixprec.autocast("base=mixed_bf16,names=2", twin):
            assert torch.equal(twin(x), _alone("base=mixed_bf16,names=2", model, x))
        assert torch.equal(twin(x), model(x))  # outside: FP32, as the original


@pytest.mark.parametrize("policy", ["mixed_fp16", "base=mixed_fp16,kernels=emulated,names=2", "mixed_bf16"])
@pytest.mark.parametrize("where", ["inside its own region", "inside the next region"])
def test_a_checkpoints_backward_inside_a_region_of_its_policy_recomputes_as_the_forward_ran(policy, where):
    # The recompute took a region entered again (the next batch's, kept) for the entry that ran the forward, and
    # inside an emulated region's own entry recomputed there: CheckpointError (the saved tensors differed)
    x, grads = torch.randn(8, 16), []
    for checkpointed in (False, True):
        model = _mlp()
        with mixprec.autocast(policy, model):
            hidden = mixprec.checkpoint(model[:2], x) if checkpointed else model[:2](x)
            loss = model[2:](hidden).float().square().sum()
            if where == "inside its own region":
                loss.backward()
        if where == "inside the next region":
            with mixprec.autocast(policy, model):
                model(x)  # the next batch
                loss.backward()
        grads.append([p.grad for p in model.parameters()])
    assert all(map(torch.equal, *grads))


def test_a_prepared_policy_is_refused_for_a_model_changed_since_also_by_a_kept_region():
    model, x = _mlp(), torch.randn(8, 16)
    prepared = mixprec.prepare(model, "base=mixed_bf16,names=2")
    with torch.no_grad(), mixprec.autocast(prepared, model):
        model(x)
    model.load_state_dict(copy.deepcopy(model.state_dict()), assign=True)  # new parameters, the same modules
    changed = r"parameters changed after mixprec\.prepare"
    with pytest.raises(ValueError, match=changed), mixprec.autocast(prepared, model):
        pass


def test_a_kept_region_watches_for_attention_again_at_each_entry(kernel_cache):
    import torch.nn.functional as F

    kernel_cache(torch.bfloat16, attention="gemm")  # as where the probe measured bf16 GEMM attention faster

    class Attending(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv, self.out = nn.Linear(32, 96), nn.Linear(32, 32)

        def forward(self, x: torch.Tensor, attend: bool = True) -> torch.Tensor:
            q, k, v = self.qkv(x).chunk(3, -1)
            return self.out(F.scaled_dot_product_attention(q, k, v) if attend else v)

    torch.manual_seed(0)
    model, x = Attending(), torch.randn(2, 16, 32)
    expected = copy.deepcopy(model)
    with mixprec.autocast("mixed_bf16", expected):
        expected = expected(x)
    with mixprec.autocast("mixed_bf16", model):
        model(x, attend=False)  # a first forward that calls no attention (a warm-up, another path)
    with mixprec.autocast("mixed_bf16", model):
        assert torch.equal(model(x), expected)  # GEMM attention, as a new region computes it


def test_an_fp8_state_first_made_in_inference_mode_trains_after():
    # Lightning's predict or validate before fit: the scale histories were inference tensors, and training's in-place
    # record raised "Inplace update to inference tensor outside InferenceMode"
    model, x = _mlp(), torch.randn(8, 16)
    policy = "base=fp8,fp8=(scaling=delayed)"
    with torch.inference_mode(), mixprec.autocast(policy, model):
        model(x)
    mp = mixprec.MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), policy)
    for _ in range(2):
        with mp.autocast():
            loss = model(x).float().square().mean()
        mp.backward(loss)
        assert mp.step()
    # the two training forwards; the one in inference mode records nothing (it would change training's scales)
    assert all(layer["input"]["recorded"] == 2 for layer in mp.state_dict()["fp8"].values())
