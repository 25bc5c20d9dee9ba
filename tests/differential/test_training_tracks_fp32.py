"""Mixed and O2 training of a small model track FP32 training on the same data and seed.

Stated tolerance: the mean loss over the last 25 of 150 steps is within 3% of FP32's, and every
25-step window of the loss curve is within 6%. The first window is bit-close by construction.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec

STEPS, WINDOW = 150, 25


def curve(policy):
    torch.manual_seed(0)
    teacher = torch.randn(24, 6)
    model = nn.Sequential(
        nn.Linear(24, 96), nn.LayerNorm(96), nn.GELU(), nn.Linear(96, 96), nn.GELU(), nn.Linear(96, 6)
    )
    optimizer_class = mixprec.AdamW if policy == "pure_bf16" else torch.optim.AdamW
    mp = mixprec.MixedPrecision(model, optimizer_class(model.parameters(), lr=3e-3), policy)
    generator = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(STEPS):
        x = torch.randn(64, 24, generator=generator)
        y = (x @ teacher).argmax(1)
        with mp.autocast():
            loss = F.cross_entropy(model(x), y)
        mp.backward(loss)
        mp.clip_grad_norm_(1.0)
        assert mp.step()
        losses.append(loss.item())
    return torch.tensor(losses).view(-1, WINDOW).mean(1)


@pytest.fixture(scope="module")
def fp32_curve():
    return curve("fp32")


@pytest.mark.parametrize("policy", ["mixed_bf16", "mixed_fp16", "o2_bf16", "o2_fp16", "pure_bf16"])
def test_loss_curve_tracks_fp32(policy, fp32_curve):
    windows = curve(policy)
    relative = (windows / fp32_curve - 1).abs()
    assert relative[-1] < 0.03, (policy, windows.tolist(), fp32_curve.tolist())
    assert relative.max() < 0.06, (policy, windows.tolist(), fp32_curve.tolist())
    assert windows[-1] < 0.5 * windows[0]  # it did learn
