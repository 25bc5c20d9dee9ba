"""mixprec.prepare: a policy resolved on a model and device once, every set-up check in one place, the value
that MixedPrecision, autocast and Region take; and the engine's guards on one list."""

import copy

import pytest
import torch
from torch import nn

import mixprec
import mixprec.policy.parse as parse


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 2))


def _count_parses(monkeypatch) -> list[str]:
    seen: list[str] = []
    real = parse._preset_name

    def counting(text: str) -> str:
        seen.append(text)
        return real(text)

    monkeypatch.setattr(parse, "_preset_name", counting)
    return seen


def test_prepare_resolves_the_policy_once_and_everything_takes_the_value(monkeypatch):
    model = _model()
    parses = _count_parses(monkeypatch)
    prepared = mixprec.prepare(model, "o2_bf16")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    mp = mixprec.MixedPrecision(model, optimizer, prepared)
    assert parses == ["o2_bf16"]  # MixedPrecision and its region used the prepared value
    assert mp.policy is prepared.policy and mp.compute_plan is prepared.plan and mp.device == prepared.device
    assert [name for name, _ in prepared.fp32_modules] == ["1"]  # the LayerNorm, by the preset's norm entry
    assert {id(p) for p in prepared.lowered} == {
        id(model[0].weight),
        id(model[0].bias),
        id(model[2].weight),
        id(model[2].bias),
    }
    with mp.autocast():
        loss = model(torch.randn(4, 8)).float().square().mean()
    mp.backward(loss)
    assert mp.step()
    assert parses == ["o2_bf16"]


def test_autocast_and_region_take_a_prepared_value():
    model = _model()
    prepared = mixprec.prepare(model, "mixed_bf16")
    with mixprec.autocast(prepared) as policy:
        out = model(torch.randn(2, 8))
    assert policy is prepared.policy and out.dtype == torch.float32  # outputs cast to the policy's FP32
    with mixprec.regions.Region(prepared).enter():
        assert model[0](torch.randn(2, 8)).dtype == torch.bfloat16


def test_a_value_prepared_for_another_model_is_refused():
    prepared = mixprec.prepare(_model(), "mixed_bf16")
    other = _model()
    with pytest.raises(ValueError, match=r"prepared for another model .*mixprec.prepare\(model, policy\)"):
        mixprec.MixedPrecision(other, torch.optim.SGD(other.parameters(), lr=0.1), prepared)
    with pytest.raises(ValueError, match="prepared for another model"), mixprec.autocast(prepared, other):
        pass


def test_prepare_runs_every_check_before_anything_is_cast():
    model = _model()
    with pytest.raises(ValueError, match=r"fp32_names entry 'encoder\.\*' matches no module"):
        mixprec.prepare(model, "base=o2_bf16,names=encoder.*")
    with pytest.raises(ValueError, match=r"device='gpu0' .* is not a device"):
        mixprec.prepare(model, "mixed_bf16", device="gpu0")
    with pytest.raises(TypeError, match=r"prepare\(model=...\) needs an nn.Module"):
        mixprec.prepare("model", "mixed_bf16")
    model.forward, model._original_forward = model.forward, model.forward  # what Accelerate's autocast leaves
    with pytest.raises(ValueError, match="another framework's autocast"):
        mixprec.prepare(model, "mixed_bf16")
    assert all(p.dtype == torch.float32 for p in model.parameters())  # refused before anything was cast
    with pytest.raises(ValueError, match="another framework's autocast"):  # compiled after Accelerate's prepare
        mixprec.prepare(torch.compile(model), "mixed_bf16")


def test_prepare_without_a_model_is_a_region_for_code():
    prepared = mixprec.prepare(None, "mixed_bf16", device="cpu")
    assert prepared.model is None and prepared.lowered == () and prepared.plan.dtype == torch.bfloat16
    with mixprec.autocast(prepared):
        assert (torch.randn(2, 3) @ torch.randn(3, 2)).dtype == torch.bfloat16


def test_a_registered_guard_is_called_at_its_points_and_can_refuse_before_anything_changes():
    from mixprec.engine.guards import _FACTORIES, register_guard

    calls: list[str] = []

    class Refuses:
        def before_forward(self, mp):
            calls.append("before_forward")

        def after_backward(self, mp):
            calls.append("after_backward")

        def before_update(self, mp):
            calls.append("before_update")
            raise RuntimeError("refused by the test's guard")

    register_guard(Refuses)
    try:
        model = _model()
        mp = mixprec.MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), "mixed_bf16")
    finally:
        _FACTORIES.remove(Refuses)
    before = [p.detach().clone() for p in model.parameters()]
    with mp.autocast():
        loss = model(torch.randn(4, 8)).float().square().mean()
    mp.backward(loss)
    with pytest.raises(RuntimeError, match="refused by the test's guard"):
        mp.step()
    assert calls == ["before_forward", "after_backward", "before_update"]
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_a_value_prepared_before_the_model_changed_is_refused():
    model = _model()
    prepared = mixprec.prepare(model, "o2_bf16")
    model[2] = nn.Linear(8, 2)  # its parameters would train in bf16 with no FP32 master, silently
    with pytest.raises(ValueError, match=r"parameters changed after mixprec.prepare .*prepare it again"):
        mixprec.MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), prepared)
    unbound = mixprec.prepare(None, "mixed_bf16", device="cpu")
    with pytest.raises(ValueError, match="prepared without a model, not for this Sequential"):
        mixprec.MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), unbound)


def test_a_step_refused_for_its_order_leaves_the_guards_as_they_were():
    # the call order is checked before the guards run: a refused step() must not use up the one-time check that
    # o2's weights still hold their masters' rounding
    model = _model()
    mp = mixprec.MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), "o2_bf16")
    with pytest.raises(RuntimeError, match=r"step\(\) without backward\(\)"):
        mp.step()
    with torch.no_grad():
        model[0].weight.add_(1.0)  # e.g. a load_state_dict after MixedPrecision was built
    with mp.autocast():
        loss = model(torch.randn(4, 8)).float().square().mean()
    mp.backward(loss)
    with pytest.raises(RuntimeError, match="no longer hold their FP32 masters' rounding"):
        mp.step()


def test_an_unscale_refused_for_its_order_still_watches_the_scaled_gradients():
    model = _model()
    mp = mixprec.MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), "mixed_fp16", accumulation_steps=2)
    with mp.autocast():
        loss = model(torch.randn(4, 8)).float().square().mean()
    mp.backward(loss)
    with pytest.raises(RuntimeError, match="in the middle of an accumulation window"):
        mp.unscale_()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # clips gradients still multiplied by 2^16
    with pytest.raises(RuntimeError, match=r"was changed after mp\.backward"):
        mp.step()


@pytest.mark.parametrize("policy", ["mixed_fp16", "mixed_bf16", "pure_bf16"])
def test_an_optimizer_stepped_directly_after_backward_is_refused_before_it_applies_anything(policy):
    model = _model()
    optimizer = mixprec.AdamW(model.parameters()) if policy == "pure_bf16" else torch.optim.SGD(model.parameters())
    mp = mixprec.MixedPrecision(model, optimizer, policy)
    with mp.autocast():
        loss = model(torch.randn(4, 8)).float().square().mean()
    mp.backward(loss)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match=r"optimizer\.step\(\) called directly after mp\.backward\(\)"):
        optimizer.step()  # the user's: would apply the loss-scaled gradients (x 2^16 under fp16) as they are
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))  # nothing applied
    assert mp.step()  # the step itself goes on as usual


def test_an_optimizer_without_parameters_is_refused():
    model = _model()
    with pytest.raises(ValueError, match=r"the SGD holds no parameters .*model\.parameters\(\)"):
        mixprec.MixedPrecision(model, torch.optim.SGD([{"params": []}], lr=0.1), "mixed_bf16")


def _train(mp, model, updates):
    for _ in range(updates):
        with mp.autocast():
            loss = model(torch.randn(4, 8)).float().square().mean()
        mp.backward(loss)
        mp.step()


@pytest.mark.parametrize("policy", ["o2_bf16", "o2_fp16"])
def test_weights_restored_into_the_model_mid_training_are_refused_at_the_next_update(policy):
    # docs/training-step.md promises it; it held at the first update only: a "best checkpoint" restored after
    # 23 updates was silently overwritten by the masters at the next one
    model = _model()
    mp = mixprec.MixedPrecision(model, torch.optim.AdamW(model.parameters(), lr=1e-2), policy)
    _train(mp, model, 3)
    best, best_engine = copy.deepcopy(model.state_dict()), mp.state_dict()
    _train(mp, model, 20)
    model.load_state_dict(best)
    with mp.autocast():
        loss = model(torch.randn(4, 8)).float().square().mean()
    mp.backward(loss)
    with pytest.raises(RuntimeError, match=r"written in place since the last update .*mp\.load_state_dict"):
        mp.step()
    assert all(torch.equal(model.state_dict()[k], v) for k, v in best.items())  # the restore is not undone
    mp.load_state_dict(best_engine)  # the way to restore: the masters with the weights
    _train(mp, model, 1)
    model.load_state_dict(copy.deepcopy(model.state_dict()))  # written in place with the same values: fine
    _train(mp, model, 1)


def test_a_second_mixed_precision_on_a_model_the_first_cast_is_refused_by_name():
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters())
    mixprec.MixedPrecision(model, optimizer, "o2_bf16")
    for again in (optimizer, torch.optim.AdamW(model.parameters())):  # before: "needs FP32 parameters", "holds none"
        with pytest.raises(ValueError, match=r"already trained by a MixedPrecision under .*one MixedPrecision per"):
            mixprec.MixedPrecision(model, again, "o2_bf16")


def test_weights_replaced_through_data_mid_training_are_refused_and_a_dropped_window_applies_nothing():
    model = _model()
    mp = mixprec.MixedPrecision(model, torch.optim.AdamW(model.parameters(), lr=1e-2), "o2_bf16")
    _train(mp, model, 2)
    weight = next(model.parameters())
    weight.data = torch.full_like(weight, 0.25)  # new memory: no version counter moves
    with mp.autocast():
        loss = model(torch.randn(4, 8)).float().square().mean()
    mp.backward(loss)
    with pytest.raises(RuntimeError, match="no longer hold their FP32 masters' rounding"):
        mp.step()
    # optimizer.zero_grad() between backward and step dropped every gradient: it raised an IndexError
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    mp = mixprec.MixedPrecision(model, optimizer, "mixed_fp16")
    before = [p.detach().clone() for p in model.parameters()]
    with mp.autocast():
        loss = model(torch.randn(4, 8)).float().square().mean()
    mp.backward(loss)
    optimizer.zero_grad()
    mp.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
