"""What MixedPrecision checks and decides before it touches a model, beyond the policy's own checks
(:func:`mixprec.prepare`): its arguments, FP32 weights to start from, an optimizer that can keep the policy's
updates, FSDP2 sharding done whole and for the same policy, the loss scalers, and what casting will lose for
a compensated optimizer. Each refusal names the argument and the fix."""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn

from mixprec.checks import flag, whole_number
from mixprec.distributed.ranks import world
from mixprec.master.compensated import AdamW as CompensatedAdamW
from mixprec.master.compensated import rounding_residual, take_rounding_residuals
from mixprec.numerics.formats import get_format
from mixprec.parallel.fsdp import sharded_with
from mixprec.policy.policy import Policy
from mixprec.scaling.base import LossScaler
from mixprec.scaling.dynamic import DynamicLossScaler
from mixprec.scaling.static import NoOpLossScaler

__all__ = [
    "check_arguments",
    "check_model_and_optimizer",
    "check_sharding",
    "default_scaler",
    "needs_compensated_optimizer",
    "record_cast",
    "rounding_residuals",
    "scalers_for",
]


def check_arguments(
    model: Any, optimizer: Any, accumulation_steps: Any, accumulate_in_fp32: Any, num_losses: Any, history: Any
) -> None:
    """MixedPrecision's arguments of the wrong type or range, refused by name."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"MixedPrecision(model=...) needs an nn.Module; received {type(model).__name__}.")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"MixedPrecision(optimizer=...) needs a torch.optim.Optimizer; received {type(optimizer).__name__}."
        )
    for name, value in (("accumulation_steps", accumulation_steps), ("num_losses", num_losses)):
        whole_number(value, f"MixedPrecision({name}=...)")
    flag(accumulate_in_fp32, "MixedPrecision(accumulate_in_fp32=...)")
    whole_number(history, "MixedPrecision(history=...)", minimum=0)
    if isinstance(optimizer, torch.optim.LBFGS):  # every adapter reaches this one refusal
        raise ValueError(
            "MixedPrecision(optimizer=...): LBFGS re-evaluates the loss inside step(), which loss scaling and "
            "skipped steps cannot follow; use a first-order optimizer."
        )
    _check_not_cast_by_another(model)


# the models a MixedPrecision cast and gave FP32 masters (o2) -> its policy: a second MixedPrecision on one is told
# so, not that the model's weights are not FP32 or that its optimizer holds none of them (the first one's masters).
# pure_bf16 keeps no masters: a model it left in bf16 may be trained again as it is.
_CAST_BY: weakref.WeakKeyDictionary[nn.Module, str] = weakref.WeakKeyDictionary()


def record_cast(model: nn.Module, policy: Policy) -> None:
    """Remember that a MixedPrecision under ``policy`` cast ``model``'s parameters."""
    _CAST_BY[model] = str(policy)


def _check_not_cast_by_another(model: nn.Module) -> None:
    policy = _CAST_BY.get(model)
    if policy is None or all(p.dtype == torch.float32 for p in model.parameters()):  # cast back to FP32: free
        return
    raise ValueError(
        f"MixedPrecision(model=...): this model is already trained by a MixedPrecision under {policy}, which cast "
        "its parameters to 16 bits (and gave its optimizer FP32 masters in their place, where the policy keeps "
        "them): one MixedPrecision per model. Keep using the first one, or build a fresh FP32 model and optimizer "
        "for another MixedPrecision."
    )


def default_scaler(policy: Policy) -> LossScaler:
    """Dynamic scaling where a format too narrow for small gradients is involved (fp16), else none."""
    if any(get_format(dtype).needs_loss_scaling for dtype in (policy.compute_dtype, policy.param_dtype)):
        return DynamicLossScaler()
    return NoOpLossScaler()


def scalers_for(scaler: Any, num_losses: int, policy: Policy) -> list[LossScaler]:
    """One loss scaler per loss: the ones given, or the policy's default."""
    if scaler is None:
        return [default_scaler(policy) for _ in range(num_losses)]
    scalers = [scaler] if isinstance(scaler, LossScaler) else None
    if isinstance(scaler, (list, tuple)):
        scalers = list(scaler)
    if scalers is None or len(scalers) != num_losses or not all(isinstance(s, LossScaler) for s in scalers):
        raise ValueError(
            f"MixedPrecision(scaler=...) needs one LossScaler per loss (num_losses={num_losses}); received "
            f"{scaler!r}. Pass mixprec.DynamicLossScaler(init_scale=...) (a torch.amp.GradScaler or a number "
            f"is not one), a list of {num_losses} separate scalers, or None for the policy's default."
        )
    if len({id(s) for s in scalers}) != len(scalers):
        raise ValueError("MixedPrecision(scaler=...): each loss needs its own scaler object; the list repeats one.")
    return scalers


def rounding_residuals(
    optimizer: torch.optim.Optimizer, model: nn.Module, policy: Policy, lowered: Any, trained: set[int], sharded: bool
) -> dict[nn.Parameter, torch.Tensor]:
    """What casting each trained FP32 parameter will lose, in its 16-bit dtype (2 bytes per parameter), for
    a compensated optimizer; empty for any other (o2's masters keep the exact values themselves). A sharded
    model was cast by mixprec.fully_shard, which kept what its shards lost."""
    if not isinstance(optimizer, CompensatedAdamW):
        return {}
    if sharded:
        return {p: r for p, r in take_rounding_residuals(model).items() if id(p) in trained}
    wanted = [p for p in lowered if p.dtype == torch.float32 and p.requires_grad and id(p) in trained]
    return {p: rounding_residual(p, policy.param_dtype) for p in wanted}


def needs_compensated_optimizer(policy: Policy) -> bool:
    """True when the policy keeps no FP32 copy of low-precision weights (``pure_bf16``): the optimizer
    must then compensate its rounding itself (``mixprec.AdamW``)."""
    return policy.is_pure


def check_sharding(model: nn.Module, policy: Policy) -> None:
    """A sharded model must be sharded whole (on several ranks), and for this policy (by mixprec.fully_shard),
    unless the policy keeps FP32 weights, which plain FSDP2 sharding already holds."""
    loose = [name for name, p in model.named_parameters() if p.requires_grad and type(p).__name__ != "DTensor"]
    if loose and world().distributed:
        raise ValueError(
            f"MixedPrecision(model=...): the model is sharded with FSDP2, but its trainable parameter {loose[0]!r}"
            f"{f' (and {len(loose) - 1} more)' if len(loose) > 1 else ''} is not: nothing would average its "
            "gradient across ranks, so each rank would train its own copy. Shard the whole model: "
            "mixprec.fully_shard on the module that holds every trained parameter (it shards that root too)."
        )
    sharded_for = sharded_with(model)
    if sharded_for is None and (policy.param_dtype != torch.float32 or policy.fp32_modules or policy.fp32_names):
        raise ValueError(
            f"MixedPrecision(model=...): the model was sharded with FSDP2 directly; policy {policy} changes "
            "parameter dtypes, which FSDP2 must carry out. Shard it with mixprec.fully_shard(model, policy)."
        )
    if sharded_for is not None and sharded_for != str(policy):
        raise ValueError(
            f"MixedPrecision(policy=...): the model was sharded by mixprec.fully_shard for {sharded_for!r}, "
            f"but MixedPrecision received {str(policy)!r}; pass the same policy to both."
        )


def check_model_and_optimizer(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    policy: Policy,
    lowered: list[nn.Parameter],
    mastered: list[nn.Parameter],
) -> None:
    """The model holds FP32 weights, and a policy without FP32 masters gets a compensated optimizer.

    FP32 masters and the policy's casts must start from the exact weights: a 16-bit weight would give a
    master rounded from 16 bits, or be silently widened to FP32. Where the policy stores a weight in 16
    bits and makes no FP32 master of it (``pure_bf16``, or a weight the optimizer does not train), a
    weight already in that dtype is accepted: casting it from FP32 would give the same bits. This holds
    for sharded models too, whose shards :func:`mixprec.fully_shard` left in the policy's dtypes.
    """
    held = [p for group in optimizer.param_groups for p in group["params"]]
    if not held:
        raise ValueError(
            f"MixedPrecision(optimizer=...): the {type(optimizer).__name__} holds no parameters (its param groups "
            "are empty), so no step would change the model. Build the optimizer from model.parameters()."
        )
    if not {id(p) for p in held} & {id(p) for p in model.parameters()}:
        raise ValueError(
            f"MixedPrecision(optimizer=...): the {type(optimizer).__name__} holds none of the model's parameters "
            f"({len(held)} tensors of its own), so no step would change the model. Build the optimizer from "
            "model.parameters() of the model you pass."
        )
    as_stored = {id(p) for p in lowered} - {id(p) for p in mastered}
    wrong: dict[torch.dtype, list[str]] = {}
    for name, param in model.named_parameters():
        allowed = (torch.float32, policy.param_dtype if id(param) in as_stored else torch.float32)
        if param.dtype.is_floating_point and param.dtype not in allowed:
            wrong.setdefault(param.dtype, []).append(name)
    if wrong:
        received = "; ".join(
            f"{len(names)} parameter{'s are' if len(names) > 1 else ' is'} {dtype}, e.g. {names[0]!r}"
            for dtype, names in wrong.items()
        )
        raise ValueError(
            f"MixedPrecision(model=...) needs a model with FP32 parameters (policy {policy} casts them itself, "
            f"and FP32 master weights must start from the exact values); received one where {received}. "
            "Build the model in FP32 (model.float(), before any mixprec.fully_shard) and let the policy cast it; for "
            "inference of a 16-bit model, use mixprec.autocast / cast_module instead."
        )
    if needs_compensated_optimizer(policy) and lowered and not isinstance(optimizer, CompensatedAdamW):
        raise ValueError(
            f"policy {policy} keeps no FP32 master weights, so a plain {type(optimizer).__name__} would "
            "round small updates away in low precision. Build the optimizer as "
            "mixprec.AdamW(model.parameters(), ...) (Kahan-compensated updates), or use policy 'o2_bf16' to "
            "keep FP32 masters."
        )
