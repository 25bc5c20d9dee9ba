"""Training steps to measure: mixprec's ``MixedPrecision`` step and the hand-written torch loops it is
held to (``torch.autocast``, with ``torch.amp.GradScaler`` for fp16), on any device, eager or compiled.

Every step is forward, backward, AdamW, zero grads, on one fixed batch, from the same seeded weights.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

import mixprec

__all__ = ["OPTIMIZERS", "Mode", "Workload", "make_optimizer", "mixprec_step", "torch_step"]

# fused: torch.optim.AdamW(fused=True), which takes the scaler's found_inf itself (no host read);
# default: torch.optim.AdamW() as most code builds it (foreach on CUDA); mixprec: the compensated AdamW
# pure_bf16 needs
OPTIMIZERS = ("fused", "default", "mixprec")


@dataclass(frozen=True)
class Workload:
    """A model (built in FP32 on the CPU), one batch on a device, and the loss of an output."""

    build: Callable[[], nn.Module]
    batch: Callable[[torch.device], tuple[object, torch.Tensor]]
    loss: Callable[[object, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Mode:
    """One thing to time: ``make()`` returns its step and the MixedPrecision behind it (None for torch loops)."""

    name: str
    make: Callable[[], tuple[Callable[[], None], object]]
    compiled: bool = False
    twin: str | None = None  # the hand-written loop this mode is compared with


def make_optimizer(kind: str, model: nn.Module) -> torch.optim.Optimizer:
    if kind == "fused":
        return torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    if kind == "default":
        return torch.optim.AdamW(model.parameters(), lr=1e-4)
    if kind == "mixprec":
        # on CPUs the single-pass kernel compiles at first use (10-30 s on a cold cache): not what the
        # dry run checks. On CUDA the option does not apply.
        cpu = next(model.parameters()).device.type == "cpu"
        return mixprec.AdamW(model.parameters(), lr=1e-4, **({"single_pass": False} if cpu else {}))
    raise ValueError(f"optimizer: received {kind!r}; use one of {', '.join(OPTIMIZERS)}.")


def _fresh(work: Workload, device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    return work.build().to(device)


def _compile(model: nn.Module, backend: str | None) -> Callable:
    return torch.compile(model, backend=backend) if backend else model


def mixprec_step(
    work: Workload, device: torch.device, policy: str, optimizer: str = "fused", compile_backend: str | None = None
) -> tuple[Callable[[], None], mixprec.MixedPrecision]:
    """MixedPrecision's step under ``policy``; ``compile_backend``: the model through torch.compile, inside
    mixprec's region."""
    model = _fresh(work, device)
    inputs, targets = work.batch(device)
    mp = mixprec.MixedPrecision(model, make_optimizer(optimizer, model), policy)
    forward = _compile(model, compile_backend)

    def step() -> None:
        with mp.autocast():
            loss = work.loss(forward(inputs), targets)
        mp.backward(loss)
        mp.step()

    return step, mp


def torch_step(
    work: Workload,
    device: torch.device,
    dtype: torch.dtype | None,
    compile_backend: str | None = None,
    weights: torch.dtype = torch.float32,
) -> tuple[Callable[[], None], None]:
    """The hand-written loop: ``torch.autocast(dtype)`` (None: FP32), a GradScaler for fp16, fused AdamW;
    ``weights=torch.bfloat16``: the model cast to bf16 and trained as it is (no autocast, no FP32 copy), the
    loop pure_bf16 is held to."""
    model = _fresh(work, device).to(weights)
    inputs, targets = work.batch(device)
    optimizer = make_optimizer("fused", model)
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16)
    forward = _compile(model, compile_backend)

    def step() -> None:
        with torch.autocast(device.type, dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            loss = work.loss(forward(inputs), targets)
        scaler.scale(loss).backward()
        scaler.step(optimizer)  # fused: the found_inf flag goes to the kernel, no host read
        scaler.update()
        optimizer.zero_grad(set_to_none=True)

    return step, None
