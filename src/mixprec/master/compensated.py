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
            for param in group["params"]:
                if param.grad is None:
                    continue
                if param.grad.is_sparse:
                    raise RuntimeError("mixprec.AdamW does not support sparse gradients.")
                self._update(param, group)
        return loss

    def _update(self, param: torch.Tensor, group: dict[str, Any]) -> None:
        state = self.state[param]
        lowp = param.dtype != torch.float32
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32)
            state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
            if lowp and group["update"] == "kahan":
                state["kahan_comp"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        beta1, beta2 = group["betas"]
        lr, eps, weight_decay = group["lr"], group["eps"], group["weight_decay"]
        state["step"] += 1
        step = state["step"].item()  # host value for the bias corrections, as torch.optim.AdamW (CPU tensor)

        # Everything below runs in FP32, whatever the storage dtype (for FP32 tensors .float() is a no-op).
        grad = param.grad.float()
        exp_avg = state["exp_avg"].float()
        exp_avg_sq = state["exp_avg_sq"].float()
        weight = param.float().clone() if lowp else param

        weight.mul_(1 - lr * weight_decay)
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        bias_correction1 = 1 - beta1**step
        bias_correction2_sqrt = (1 - beta2**step) ** 0.5
        denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
        weight.addcdiv_(exp_avg, denom, value=-lr / bias_correction1)

        if lowp:
            state["exp_avg"].copy_(exp_avg)
            state["exp_avg_sq"].copy_(exp_avg_sq)
            self._write_back(param, weight, state, group["update"])

    def _write_back(self, param: torch.Tensor, target: torch.Tensor, state: dict[str, Any], update: str) -> None:
        """Store the FP32 ``target`` weight into the low-precision ``param``."""
        if update == "kahan":
            compensation = state["kahan_comp"]
            old = param.float()
            wanted = target - old + compensation.float()  # this step's update plus what earlier steps lost
            param.copy_(old + wanted)  # rounded to the parameter's dtype
            compensation.copy_(wanted - (param.float() - old))  # what this rounding lost
        elif update == "stochastic":
            param.copy_(quantize(target, param.dtype, rounding="stochastic", generator=self._generator))
        else:
            param.copy_(target)
