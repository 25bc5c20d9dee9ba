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

__all__ = [
    "BF16_WEIGHTS_LOOP",
    "OPTIMIZERS",
    "TORCH_LOOPS",
    "Mode",
    "Workload",
    "make_optimizer",
    "mixprec_step",
    "torch_step",
    "training_mode",
]

# fused: torch.optim.AdamW(fused=True), which takes the scaler's found_inf itself (no host read);
# default: torch.optim.AdamW() as most code builds it (foreach on CUDA); mixprec: the compensated AdamW
# pure_bf16 needs
OPTIMIZERS = ("fused", "default", "mixprec")
# the hand-written loops, by name: torch.autocast's dtype (None: FP32), a GradScaler for fp16, fused AdamW
TORCH_LOOPS = {"torch fp32": None, "torch autocast bf16": torch.bfloat16, "torch autocast fp16": torch.float16}
BF16_WEIGHTS_LOOP = "torch bf16 weights"  # the model in bf16 with AdamW(fused=True): no FP32 copy, no compensation


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


def training_mode(
    name: str,
    work: Workload,
    device: torch.device,
    backend: str | None = None,
    twins: dict[str, str] | None = None,
    policies: dict[str, str] | None = None,
) -> Mode:
    """A training mode by name: a hand-written loop (:data:`TORCH_LOOPS`, :data:`BF16_WEIGHTS_LOOP`) or mixprec
    under a policy (``policies`` maps a row's name to its policy; other names are policies), compiled with
    ``backend`` when given; ``twins``: the hand-written loop each mixprec row is compared with."""
    label, compiled = (f"{name}, compiled" if backend else name), backend is not None
    if name in TORCH_LOOPS:
        return Mode(label, lambda: torch_step(work, device, TORCH_LOOPS[name], backend), compiled)
    if name == BF16_WEIGHTS_LOOP:
        return Mode(label, lambda: torch_step(work, device, None, backend, torch.bfloat16), compiled)
    twin = (twins or {}).get(name)
    twin = f"{twin}, compiled" if backend and twin else twin
    policy = (policies or {}).get(name, name)
    resolved = mixprec.get_policy(policy)  # 16-bit weights with no FP32 masters (pure_bf16): the compensated AdamW
    optimizer = "mixprec" if resolved.param_dtype != torch.float32 and not resolved.keeps_fp32_masters else "fused"
    return Mode(label, lambda: mixprec_step(work, device, policy, optimizer, backend), compiled, twin)
