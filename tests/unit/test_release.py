"""MixedPrecision.release(): the model and optimizer handed back in FP32, and a new MixedPrecision that continues the
run bit for bit from the old one's scalers and counters."""

import copy

import pytest
import torch
from torch import nn

import mixprec


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 2))


def _steps(mp: mixprec.MixedPrecision, model: nn.Module, count: int, start: int = 0) -> None:
    for step in range(start, start + count):
        generator = torch.Generator().manual_seed(step)
        x, y = torch.randn(32, 8, generator=generator), torch.randn(32, 2, generator=generator)
        with mp.autocast():
            loss = nn.functional.mse_loss(model(x), y)
        mp.backward(loss * (float("inf") if step == 2 else 1.0))  # step 2 overflows: skipped, the scale halves
        mp.step()


@pytest.mark.parametrize("policy", ["o2_bf16", "o2_fp16", "mixed_fp16"])
def test_a_new_mixed_precision_after_release_continues_bit_for_bit(policy):
    straight = _model()
    mp = mixprec.MixedPrecision(straight, torch.optim.AdamW(straight.parameters(), lr=1e-2), policy)
    _steps(mp, straight, 6)
    expected = mp.fp32_state_dict()

    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    first = mixprec.MixedPrecision(model, optimizer, policy)
    _steps(first, model, 3)
    exact = first.fp32_state_dict()
    carried = first.release()
    assert "masters" not in carried and carried["scalers"] == first.state_dict()["scalers"]
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert all(torch.equal(exact[name], p) for name, p in model.named_parameters())  # the masters' values
    held = [p for group in optimizer.param_groups for p in group["params"]]
    assert all(a is b for a, b in zip(held, model.parameters(), strict=True))
    assert all(p in optimizer.state for p in model.parameters())  # Adam's moments moved back with them

    second = mixprec.MixedPrecision(model, optimizer, policy)
    second.load_state_dict(carried, masters=False)
    _steps(second, model, 3, start=3)
    assert second.stats().skipped_steps == 1
    assert all(torch.equal(expected[name], value) for name, value in second.fp32_state_dict().items())


def test_release_refuses_an_unfinished_step_and_every_call_after_it():
    model = _model()
    mp = mixprec.MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), "o2_bf16")
    with mp.autocast():
        loss = model(torch.randn(4, 8)).sum()
    mp.backward(loss)
    with pytest.raises(RuntimeError, match="unfinished step"):
        mp.release()
    mp.step()
    mp.release()
    for call in (mp.autocast().__enter__, mp.step, mp.release):
        with pytest.raises(RuntimeError, match="after release"):
            call()
    model(torch.randn(4, 8)).sum().backward()  # a plain FP32 model again, its optimizer usable directly
    before = copy.deepcopy(model.state_dict())
    mp.optimizer.step()
    assert not torch.equal(before["0.weight"], model[0].weight)


def test_pure_bf16_keeps_its_16_bit_weights():
    model = _model()
    mp = mixprec.MixedPrecision(model, mixprec.AdamW(model.parameters(), lr=1e-2), "pure_bf16")
    _steps(mp, model, 1)
    mp.release()
    assert model[0].weight.dtype == torch.bfloat16  # the weights themselves: no FP32 copy to hand back
