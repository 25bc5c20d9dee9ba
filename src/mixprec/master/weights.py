"""FP32 master weights for a model whose parameters are stored in fp16 or bf16.

The optimizer updates FP32 masters; the model computes with low-precision copies of them.

    build (before the model is cast):  master = fp32 copy of each parameter the policy will lower;
                                        the optimizer's param groups point at the masters instead
    after backward:                    master.grad = model_param.grad in fp32 (then unscaled), and the
                                        low-precision gradient is released: no FP32 gradient is kept
                                        between steps
    after an applied step:             model_param <- master, rounded to its dtype

Only the optimizer's parameter lists change (same groups, same hyperparameters, same object), so
learning-rate schedulers keep working.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from mixprec.distributed.ranks import local

__all__ = ["MasterWeights", "release_masters"]


class MasterWeights:
    """FP32 masters for the parameters in ``lowered``, wired into ``optimizer``.

    Args:
        optimizer: the user's optimizer, built on the model's parameters.
        lowered: the parameters that are about to be cast to low precision (still FP32 now, so
            the masters start from the exact weights rather than their rounding).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, lowered: Iterable[nn.Parameter]) -> None:
        self.model_params: list[nn.Parameter] = list(lowered)
        self.masters: list[nn.Parameter] = [
            nn.Parameter(p.detach().clone().float(), requires_grad=p.requires_grad) for p in self.model_params
        ]
        by_id = {id(p): m for p, m in zip(self.model_params, self.masters, strict=True)}
        for group in optimizer.param_groups:
            group["params"] = [by_id.get(id(p), p) for p in group["params"]]
        for param in self.model_params:  # state built before mixprec (e.g. a resumed optimizer) follows
            if param in optimizer.state:
                optimizer.state[by_id[id(param)]] = {
                    k: v.float() if torch.is_tensor(v) and v.is_floating_point() and v.dim() > 0 else v
                    for k, v in optimizer.state.pop(param).items()
                }

        self.versions: list[int] | None = None  # the parameters' version counters after the last copy_to_model
        self.pointers: list[int] | None = None  # and where their data lived

    def __len__(self) -> int:
        return len(self.masters)

    def grads_to_masters(self) -> None:
        """Move the model's low-precision gradients into the masters' ``.grad`` as fp32, adding to
        what is there (accumulation), and release the low-precision ones."""
        for param, master in zip(self.model_params, self.masters, strict=True):
            if param.grad is None:
                continue
            if master.grad is None:
                master.grad = param.grad.float()
            else:
                master.grad.add_(param.grad)
            param.grad = None

    def copy_to_model(self) -> None:
        """Round the masters into the model's parameters (one fused copy per dtype), and record the parameters'
        version counters after it: a write since (a ``load_state_dict`` on the model) moves them.

        Into the parameters themselves under no_grad, not through ``.data``: an alias made per parameter per
        update cost as much host time as the copy (two ops a parameter: 320 against 140 us at 200 parameters).
        """
        with torch.no_grad():
            torch._foreach_copy_(self.model_params, self.masters)
        self.versions = [p._version for p in self.model_params]
        self.pointers = list(map(torch.Tensor.data_ptr, self.model_params))  # `p.data = x` moves no counter

    def drifted(self, among: list[int] | None = None) -> list[int]:
        """Indices (into ``among``, default every parameter) of the model's parameters that no longer hold
        their master's rounding: something wrote them since the masters were made or last copied in (DDP's
        broadcast of rank 0's weights, a ``load_state_dict`` on the model), and the next update would write
        the masters back over them. One host sync for all of them."""
        indices = range(len(self.masters)) if among is None else among
        if not indices:
            return []
        with torch.no_grad():
            differs = [_differs(self.model_params[i], self.masters[i].to(self.model_params[i].dtype)) for i in indices]
            return [n for n, flag in enumerate(torch.stack(differs).tolist()) if flag]

    def zero_grad(self) -> None:
        for master in self.masters:
            master.grad = None

    def expose_grads(self) -> list[tuple[int, torch.Tensor, int]]:
        """Put each master's (unscaled, FP32) gradient, rounded to its parameter's dtype, on the model's parameter,
        for user code that reads ``p.grad`` (a grad-norm logger, a clip of its own); returns what
        :meth:`collect_grads` needs to tell which ones that code edited."""
        shown = []
        for index, (param, master) in enumerate(zip(self.model_params, self.masters, strict=True)):
            if master.grad is not None:
                param.grad = master.grad.to(param.dtype)
                shown.append((index, param.grad, param.grad._version))
        return shown

    def collect_grads(
        self, shown: list[tuple[int, torch.Tensor, int]], keep_shown: bool = False
    ) -> tuple[list[tuple[int, torch.Tensor, int]], list[torch.Tensor]]:
        """Undo :meth:`expose_grads`: a gradient the user code edited in place or replaced goes to the master,
        value by value: one the edit left at its shown rounding keeps the master's FP32 value (a clip by a factor
        of 1, a mask of other values: nothing lost), an edited one takes the edit, widened. Every model parameter's
        ``.grad`` is released, or with ``keep_shown`` left shown. Returns what a later collect needs (empty when
        released) and the masters' gradients edits reached (for their finite check)."""
        kept, edited = [], []
        for index, grad, version in shown:
            param, master = self.model_params[index], self.masters[index]
            now = param.grad
            if now is None:  # set to None: no gradient, as torch's optimizers read it
                master.grad = None
            elif now is not grad or now._version != version:
                widened = now.float()
                if master.grad is None:  # the optimizer's gradients were zeroed since: the edit is the gradient
                    master.grad = widened
                else:
                    master.grad.copy_(torch.where(now == master.grad.to(now.dtype), master.grad, widened))
                edited.append(master.grad)
            if keep_shown and now is not None:
                kept.append((index, now, now._version))
            else:
                param.grad = None
        return kept, edited

    def state(self) -> list[torch.Tensor]:
        """The master values (fp32), in parameter order."""
        return [m.detach() for m in self.masters]

    def load_state(self, values: list[torch.Tensor]) -> None:
        """Restore master values and refresh the model's copies from them (refused, nothing changed, as
        :meth:`check_state`)."""
        self.check_state(values)
        with torch.no_grad():
            for master, value in zip(self.masters, values, strict=True):
                master.copy_(value)  # from any device and dtype the checkpoint was read to
        self.copy_to_model()

    def check_state(self, values: list[torch.Tensor]) -> None:
        """Raise ValueError unless ``values`` are master values of this model: their number, shapes and dtype
        (FP32: a 16-bit value lost what a master keeps), with data (not meta) and finite (masters change only
        on updates with finite gradients: NaN there is a corrupt or foreign file). Host syncs: a load."""
        if not isinstance(values, list) or len(values) != len(self.masters):
            count = len(values) if isinstance(values, list) else type(values).__name__
            raise ValueError(
                f"the checkpoint holds {count} master weights, this model has {len(self.masters)}; "
                "load a checkpoint saved from the same model and policy."
            )
        for index, (master, value) in enumerate(zip(self.masters, values, strict=True)):
            if not torch.is_tensor(value) or value.shape != master.shape:
                shape = tuple(value.shape) if torch.is_tensor(value) else type(value).__name__
                raise ValueError(
                    f"master weight {index} has shape {shape} in the checkpoint, {tuple(master.shape)} in this "
                    "model; load a checkpoint saved from the same model and policy."
                )
            if (defect := _defect(value, master.dtype)) is not None:
                raise ValueError(
                    f"master weight {index} in the checkpoint is {defect}; masters are finite {master.dtype} "
                    "values. Load a checkpoint saved by MixedPrecision.state_dict() of this policy."
                )


def _defect(value: torch.Tensor, dtype: torch.dtype) -> str | None:
    """What keeps ``value`` from being a master of ``dtype``, or None (a sharded one: its local shard)."""
    if value.dtype != dtype:
        return str(value.dtype)
    if value.is_meta:
        return "on the meta device"
    return None if bool(torch.isfinite(local(value)).all()) else "not finite"


def release_masters(masters: MasterWeights, optimizer: torch.optim.Optimizer) -> None:
    """Undo :class:`MasterWeights`: each model parameter FP32 again holding its master's exact value (its own
    storage, so the optimizer keeps updating the tensor the model computes with), and the optimizer's groups and
    state back on the model's parameters."""
    by_id = {id(m): p for p, m in zip(masters.model_params, masters.masters, strict=True)}
    for param, master in zip(masters.model_params, masters.masters, strict=True):
        param.data = master.detach().to(param.device)  # where the model is now (a framework may have moved it)
        param.requires_grad_(master.requires_grad)  # set on the masters while they stood in (fastai's freeze)
        param.grad = None
    for group in optimizer.param_groups:
        group["params"] = [by_id.get(id(p), p) for p in group["params"]]
    for master in masters.masters:
        if master in optimizer.state:
            optimizer.state[by_id[id(master)]] = optimizer.state.pop(master)


def _differs(value: torch.Tensor, rounded: torch.Tensor) -> torch.Tensor:
    """Whether any element differs, NaN equal to NaN (a master's NaN rounds to the parameter's NaN)."""
    return ((value != rounded) & ~(value.isnan() & rounded.isnan())).any()
