"""What the region tests share: a small MLP, and a policy's output on a fresh copy of a model (the reference a
region entered in some other way must equal bit for bit)."""

from __future__ import annotations

import copy

import torch
from torch import nn

import mixprec


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))


def alone(policy: str, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``model(x)`` in a one-off region of ``policy`` on a copy of the model, no other region around."""
    twin = copy.deepcopy(model)
    with torch.no_grad(), mixprec.autocast(policy, twin):
        return twin(x)
