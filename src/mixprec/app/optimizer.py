"""The AdamW that mixprec's own runs, demo and benchmarks train with, chosen for the policy and the device.

``pure_bf16`` keeps no FP32 masters, so its optimizer must compensate the bf16 rounding itself
(``mixprec.AdamW``). Every other policy gets torch's AdamW, fused where torch has a fused kernel for
the device (CPU and CUDA): one pass over each parameter and its moments instead of about ten, 70 against
10 ms per update for the 22.6M parameters of the minilm task on a 2-core CPU, where a fine-tuning step
at short sequences takes a few hundred milliseconds. The results are torch's fused AdamW's, within
rounding of the per-tensor loop.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from mixprec.engine import needs_compensated_optimizer
from mixprec.master import AdamW as CompensatedAdamW
from mixprec.policy import Policy

__all__ = ["FUSED_ADAMW_DEVICES", "KERNEL_CHOICES", "adamw_for"]

FUSED_ADAMW_DEVICES = ("cpu", "cuda")  # where torch.optim.AdamW(fused=True) has a kernel
# How torch runs an update, not what it computes: not part of a run's identity, and a resumed run keeps its own
KERNEL_CHOICES = frozenset({"foreach", "fused", "capturable", "differentiable"})


def adamw_for(policy: Policy, params: Iterable[Any], device: torch.device | str, **hyper: Any) -> torch.optim.Optimizer:
    """AdamW over ``params`` (tensors or parameter groups) for ``policy`` on ``device``; ``hyper``: lr,
    weight_decay, betas, ..."""
    if needs_compensated_optimizer(policy):
        return CompensatedAdamW(params, **hyper)
    return torch.optim.AdamW(params, fused=torch.device(device).type in FUSED_ADAMW_DEVICES, **hyper)
