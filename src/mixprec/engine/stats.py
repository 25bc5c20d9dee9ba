"""What ``MixedPrecision.stats()`` returns: typed data, for the caller to log or print."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["StateBytes", "Stats", "model_state_bytes"]


@dataclass(frozen=True)
class StateBytes:
    """Bytes of persistent model state per model parameter, by kind."""

    params: float
    grads: float
    masters: float
    optimizer: float

    @property
    def total(self) -> float:
        return self.params + self.grads + self.masters + self.optimizer

    def __str__(self) -> str:
        """The total and its parts, e.g. ``18 bytes/param: 2 weights + 4 gradients + 4 masters + 8 optimizer``: two
        runs of one policy differ where one keeps FP32 gradient sums (o2 with gradient accumulation)."""
        parts = (("weights", self.params), ("gradients", self.grads), ("masters", self.masters))
        shown = " + ".join(f"{value:.2g} {name}" for name, value in parts if value)
        return f"{self.total:.3g} bytes/param: {shown} + {self.optimizer:.2g} optimizer"


@dataclass(frozen=True)
class Stats:
    """The state of mixed-precision training after the steps so far.

    ``scale`` is loss scaler 0's (``scales`` lists every loss's); ``steps`` counts updates attempted,
    ``skipped_steps`` those whose gradients were not finite; ``inf_steps``/``nan_steps`` classify them
    (a step can count as both); ``underflow_steps`` counts applied steps whose gradients were all zero
    at a collapsed scale (below 1) though the loss was not; ``diagnosis`` is set once gradients
    overflow at the lowest scale.
    """

    policy: str
    scale: float
    scales: tuple[float, ...]
    steps: int
    applied_steps: int
    skipped_steps: int
    inf_steps: int
    nan_steps: int
    underflow_steps: int
    recent_overflow_steps: tuple[int, ...]
    diagnosis: str | None
    bytes_per_param: StateBytes


def _nbytes(tensors: Iterable[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def model_state_bytes(
    model: nn.Module,
    masters: list[torch.Tensor],
    optimizer: torch.optim.Optimizer,
    fp32_grad_buffers: bool,
) -> StateBytes:
    """Persistent bytes per parameter: params, their gradients (in the params' dtype, or FP32 when
    gradients accumulate in FP32 buffers), FP32 masters, and every tensor in the optimizer's state.

    Transient buffers that live only inside ``step()`` (the FP32 gradients of the masters) are not counted.
    """
    params = [p for p in model.parameters()]
    count = sum(p.numel() for p in params) or 1
    trainable = [p for p in params if p.requires_grad]
    grad_bytes = sum(p.numel() * (4 if fp32_grad_buffers else p.element_size()) for p in trainable)
    state_tensors = [v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v)]
    return StateBytes(
        params=_nbytes(params) / count,
        grads=grad_bytes / count,
        masters=_nbytes(masters) / count,
        optimizer=_nbytes(state_tensors) / count,
    )
