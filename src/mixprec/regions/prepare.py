"""Prepare once: a policy resolved on a model and a device into one value, every set-up check run once.

    prepared = mixprec.prepare(model, "mixed_bf16")           # resolve and check, before anything is cast
    mp = mixprec.MixedPrecision(model, optimizer, prepared)   # or mixprec.autocast(prepared), Region(prepared)

The checks, in the order that matters (each refuses with the fix, before the model is touched):
    1. no other framework's autocast already runs the model (Accelerate's ``mixed_precision="fp16"``);
    2. the policy parses (a preset, the grammar, a Policy; ``auto`` resolved for the device);
    3. the device can compute in the policy's compute dtype;
    4. the policy's module entries (``fp32_names``, ``bf16_names``, ``fp32_modules``) name modules the model has.
Then what every consumer reads from the value instead of working it out again: the compute plan (native or
emulated, and why; the CPU probe is measured once per machine), the modules the policy keeps in FP32 and the
parameters it stores below FP32 (taken before the cast, while they are still the exact FP32 weights).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from mixprec.compute.device import device_type_of
from mixprec.policy.parse import get_policy
from mixprec.policy.policy import Policy
from mixprec.regions.casting import (
    bf16_modules,
    check_fp32_entries,
    fp32_modules,
    lowered_parameters,
    wrapper_attribute,
)
from mixprec.regions.plan import ComputePlan, bf16_plan, check_device_supports, compute_plan

__all__ = ["Prepared", "prepare", "refuse_foreign_autocast"]


@dataclass(frozen=True, eq=False)
class Prepared:
    """A policy resolved on a model and device, checked: what regions, MixedPrecision and the doctor take.

    ``fp32_modules``: (name, module) of each module the policy keeps in FP32; ``lowered``: the parameters the
    policy stores in ``policy.param_dtype`` (none when that is FP32), each once; ``parameters``: the model's
    parameters when it was prepared (a value handed on is refused for a model changed since); ``bf16_modules``
    and ``bf16_plan``: the modules an fp16 policy computes in bf16 (``bf16_names``) and how bf16 runs here.
    """

    policy: Policy
    device: torch.device
    plan: ComputePlan
    model: nn.Module | None = None
    fp32_modules: tuple[tuple[str, nn.Module], ...] = ()
    lowered: tuple[nn.Parameter, ...] = ()
    parameters: tuple[nn.Parameter, ...] = ()
    bf16_modules: tuple[tuple[str, nn.Module], ...] = ()
    bf16_plan: ComputePlan | None = None


def prepare(
    model: nn.Module | None = None,
    policy: Policy | str | Prepared = "auto",
    device: str | torch.device | None = None,
    *,
    caller: str = "prepare",
) -> Prepared:
    """Resolve ``policy`` on ``model`` and ``device`` and run every set-up check, once (see the module's docs).
    ``caller``: the call its errors name (``MixedPrecision``, ``autocast``: the one the user made).

    Args:
        model: the model the policy will run (None: a region for code without a model).
        policy: a Policy, preset or policy string; a Prepared is returned as it is, when it was prepared for
            this model (and device, if given).
        device: default: the model's, else CUDA if present, else CPU.

    Raises:
        ValueError: another framework's autocast runs the model, an unknown policy, a device that cannot compute
            in the policy's dtype, an FP32 entry that names no module, or a Prepared made for another model.
    """
    if isinstance(policy, Prepared):
        return _same_target(policy, model, device)
    if model is not None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"{caller}(model=...) needs an nn.Module or None; received {type(model).__name__}.")
        refuse_foreign_autocast(model)  # first: before anything else reads or casts the model
    if device is None and model is not None:
        first = next(model.parameters(), None)
        device = first.device if first is not None else None
    device_type = device_type_of(device)  # a bad device is refused by name
    device = torch.device(device) if device is not None else torch.device(device_type)
    resolved = get_policy(policy, device=device, argument=f"{caller}(policy=...)")
    check_device_supports(resolved, device.type)
    if model is None:
        return Prepared(resolved, device, compute_plan(resolved, device.type))
    check_fp32_entries(model, resolved)
    lowered = lowered_parameters(model, resolved) if resolved.param_dtype != torch.float32 else []
    return Prepared(
        resolved,
        device,
        compute_plan(resolved, device.type),
        model,
        tuple(fp32_modules(model, resolved)),
        tuple(lowered),
        tuple(model.parameters()),
        tuple(bf16_modules(model, resolved)),
        bf16_plan(resolved, device.type),
    )


def _same_target(prepared: Prepared, model: nn.Module | None, device: str | torch.device | None) -> Prepared:
    """A Prepared handed on: refused where it was made for another model or device, or the model changed since
    (parameters added, replaced or moved: its lists of FP32 modules and lowered parameters would be stale)."""
    if model is not None and prepared.model is not model:
        made_for = (
            "without a model" if prepared.model is None else f"for another model ({type(prepared.model).__name__})"
        )
        raise ValueError(
            f"the policy was prepared {made_for}, not for this {type(model).__name__}: call "
            "mixprec.prepare(model, policy) with the model it will run."
        )
    if device is not None and not _same_device(torch.device(device), prepared.device):
        raise ValueError(
            f"the policy was prepared for device {prepared.device}, not {device}: prepare it on the device it runs on."
        )
    if prepared.model is not None:
        now = tuple(prepared.model.parameters())
        same = len(now) == len(prepared.parameters) and all(map(operator.is_, now, prepared.parameters))
        if not same:
            raise ValueError(
                "the model's parameters changed after mixprec.prepare (a layer added or replaced, weights loaded "
                "with assign=True): prepare it again, after the change."
            )
        if now and not _same_device(now[0].device, prepared.device):
            raise ValueError(
                f"the model was moved to {now[0].device} after mixprec.prepare (for {prepared.device}): prepare it "
                "again on the device it runs on."
            )
    return prepared


def _same_device(given: torch.device, prepared: torch.device) -> bool:
    """The same device; an index left out ("cuda") matches any of its type."""
    if given.type != prepared.type:
        return False
    return given.index is None or prepared.index is None or given.index == prepared.index


def refuse_foreign_autocast(model: nn.Module) -> None:
    """Raise ValueError when another framework already runs ``model`` under its own autocast: Accelerate's
    ``Accelerator(mixed_precision="fp16"|"bf16")`` replaces ``model.forward`` and keeps the original as
    ``_original_forward`` (on the model, or on a model its wrappers hold: DDP's ``module``, torch.compile's
    ``_orig_mod``, at any depth)."""
    module: Any = model
    seen: list[nn.Module] = []  # a module whose `module` attribute leads back would loop
    while isinstance(module, nn.Module) and all(module is not other for other in seen):
        seen.append(module)
        if "_original_forward" in vars(module):
            raise ValueError(
                "mixprec: the model's forward already runs under another framework's autocast (Accelerate's "
                "Accelerator(mixed_precision='fp16' or 'bf16') replaced model.forward); two mixed-precision "
                "systems would fight (autocast twice, two loss scalers). Use Accelerator(mixed_precision='no') "
                "and let the mixprec policy set the precision."
            )
        module = getattr(module, wrapper_attribute(module) or "module", None)  # and other wrappers' `module`
