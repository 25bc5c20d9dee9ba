"""AdamW for low-precision parameters without an FP32 master copy: compensated updates.

A bf16 weight near 1.0 moves in steps of 2**-8; an update of 1e-4 is rounded away entirely. Storing an
FP32 master copy fixes that at 4 extra bytes per parameter. This optimizer keeps parameters and both
moments in the parameters' dtype and computes each step in FP32, then writes the new weight back with:

    kahan       (default) a bf16 compensation buffer carries what rounding lost into the next step:
                    y = update + c;  p' = round(p + y);  c = y - (p' - p)
                2 extra bytes per parameter; tiny updates accumulate until they move the weight.
    stochastic  p' = stochastic_round(p + update): unbiased on average, no extra memory.
    nearest     plain rounding (what a bf16 torch optimizer does); for comparison.

Model state with bf16 parameters: 2 (param) + 2 (grad) + 4 (moments) + 2 (kahan) = 10 bytes/param,
against 16 for FP32 AdamW. For FP32 parameters every mode is plain AdamW and follows
``torch.optim.AdamW``'s arithmetic op for op.

Example:
    >>> import torch
    >>> p = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    >>> opt = AdamW([p], lr=1e-4)
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from mixprec.numerics.quantize import quantize

__all__ = ["UPDATE_MODES", "AdamW"]

UPDATE_MODES = ("kahan", "stochastic", "nearest")


class AdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay) with compensated updates for bf16/fp16 parameters.

    Args:
        params: parameters or param groups, as for any ``torch.optim`` optimizer.
        lr, betas, eps, weight_decay: as ``torch.optim.AdamW`` (same defaults).
        update: ``"kahan"``, ``"stochastic"`` or ``"nearest"``; see the module docstring.
        generator: random source for stochastic updates.
    """

    def __init__(
        self,
        params: Iterable[Any],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        update: str = "kahan",
        generator: torch.Generator | None = None,
    ) -> None:
        if not lr >= 0.0:
            raise ValueError(f"AdamW(lr=...) must be >= 0; received {lr!r}.")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"AdamW(betas=...) must lie in [0, 1); received {betas!r}.")
        if not eps >= 0.0 or not weight_decay >= 0.0:
            raise ValueError(f"AdamW(eps=..., weight_decay=...) must be >= 0; received {eps!r}, {weight_decay!r}.")
        if update not in UPDATE_MODES:
            raise ValueError(
                f"AdamW(update=...): received {update!r}; use one of {', '.join(map(repr, UPDATE_MODES))}."
            )
        super().__init__(params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay, "update": update})
        self._generator = generator

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[override]
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if any(p.grad.is_sparse for p in params):
                raise RuntimeError("mixprec.AdamW does not support sparse gradients.")
            by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
            for param in params:
                by_dtype.setdefault(param.dtype, []).append(param)
            for same_dtype in by_dtype.values():
                self._update(same_dtype, group)
        return loss

    def _update(self, params: list[torch.Tensor], group: dict[str, Any]) -> None:
        """One AdamW step for parameters of one dtype, with fused multi-tensor (foreach) kernels."""
        lowp = params[0].dtype != torch.float32
        kahan = lowp and group["update"] == "kahan"
        for param in params:
            state = self.state[param]
            if not state:
                state["step"] = torch.zeros((), dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                if kahan:
                    state["kahan_comp"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            state["step"] += 1
        states = [self.state[p] for p in params]
        beta1, beta2 = group["betas"]
        lr, eps, weight_decay = group["lr"], group["eps"], group["weight_decay"]
        # Parameters added together share a step count; a group's steps can differ only if some
        # parameters had no gradient at some step, so compute the bias corrections per step value.
        steps = [s["step"].item() for s in states]  # host values, as torch.optim.AdamW (CPU tensors)

        # Everything below runs in FP32, whatever the storage dtype (for FP32 tensors, in place).
        grads = [p.grad.float() for p in params]
        exp_avgs = [s["exp_avg"].float() for s in states]
        exp_avg_sqs = [s["exp_avg_sq"].float() for s in states]
        weights = [p.float() for p in params] if lowp else params
        old = [w.clone() for w in weights] if lowp else None

        torch._foreach_mul_(weights, 1 - lr * weight_decay)
        torch._foreach_lerp_(exp_avgs, grads, 1 - beta1)
        torch._foreach_mul_(exp_avg_sqs, beta2)
        torch._foreach_addcmul_(exp_avg_sqs, grads, grads, value=1 - beta2)
        bias_correction2_sqrt = [(1 - beta2**step) ** 0.5 for step in steps]
        denoms = torch._foreach_sqrt(exp_avg_sqs)
        torch._foreach_div_(denoms, bias_correction2_sqrt)
        torch._foreach_add_(denoms, eps)
        step_sizes = [-lr / (1 - beta1**step) for step in steps]
        torch._foreach_addcdiv_(weights, exp_avgs, denoms, step_sizes)

        if lowp:
            torch._foreach_copy_([s["exp_avg"] for s in states], exp_avgs)
            torch._foreach_copy_([s["exp_avg_sq"] for s in states], exp_avg_sqs)
            self._write_back(params, weights, old, states, group["update"])

    def _write_back(
        self,
        params: list[torch.Tensor],
        targets: list[torch.Tensor],
        old: list[torch.Tensor],
        states: list[dict[str, Any]],
        update: str,
    ) -> None:
        """Store the FP32 ``targets`` into the low-precision ``params``."""
        if update == "kahan":
            compensations = [s["kahan_comp"] for s in states]
            # wanted = this step's update plus what earlier steps lost
            wanted = torch._foreach_sub(targets, old)
            torch._foreach_add_(wanted, [c.float() for c in compensations])
            torch._foreach_copy_(params, torch._foreach_add(old, wanted))  # rounded to the parameters' dtype
            # what this rounding lost: wanted - (new - old)
            torch._foreach_sub_(wanted, torch._foreach_sub([p.float() for p in params], old))
            torch._foreach_copy_(compensations, wanted)
        elif update == "stochastic":
            for param, target in zip(params, targets, strict=True):
                param.copy_(quantize(target, param.dtype, rounding="stochastic", generator=self._generator))
        else:
            torch._foreach_copy_(params, targets)
