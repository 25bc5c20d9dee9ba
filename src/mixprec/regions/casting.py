"""Applying a policy to a module: which submodules stay FP32, and casting parameters and buffers.

``cast_module(model, policy)`` stores every floating parameter and buffer in ``policy.param_dtype``,
except inside the modules the policy keeps in FP32 (by class, ``norm`` meaning every normalization
layer, or by dotted-name glob). Like ``Module.to``, it changes tensors in place, so an optimizer
built before the cast still holds the same Parameter objects.

Example:
    >>> import torch.nn as nn
    >>> from mixprec.policy.parse import get_policy
    >>> model = cast_module(nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4)), get_policy("o2_bf16"))
    >>> [p.dtype for p in model.parameters()]
    [torch.bfloat16, torch.bfloat16, torch.float32, torch.float32]
"""

from __future__ import annotations

import difflib
import fnmatch
import re
import warnings
from collections.abc import Callable, Iterable, Iterator

import torch
from torch import nn

from mixprec.policy.parse import get_policy
from mixprec.policy.policy import DTYPE_NAMES, NORM, Policy

__all__ = [
    "MIXED_DTYPE_NORMS",
    "bf16_modules",
    "cast_module",
    "check_fp32_entries",
    "enclosing",
    "fp32_modules",
    "lowered_parameters",
    "unwrapped",
    "wrapper_attribute",
]

_TORCH_NORMS = (
    nn.modules.batchnorm._NormBase,  # BatchNorm*d, InstanceNorm*d, SyncBatchNorm
    nn.LayerNorm,
    nn.GroupNorm,
    nn.LocalResponseNorm,
    nn.RMSNorm,
)
# Norms whose kernels take 16-bit inputs with FP32 parameters, compute in FP32 and return the input's
# dtype (as cuDNN does): kept in FP32, they need no FP32 copy of their input.
MIXED_DTYPE_NORMS = (nn.modules.batchnorm._BatchNorm, nn.LayerNorm, nn.GroupNorm)
# Normalization layers defined outside torch (LlamaRMSNorm, T5LayerNorm, ...) by naming convention.
_NORM_NAME = re.compile(r"(Norm|Normalization)(\d+d)?$")


def _is_kept_class(module: nn.Module, classes: tuple[str, ...]) -> bool:
    if NORM in classes and (isinstance(module, _TORCH_NORMS) or _named_like_a_norm(module)):
        return True
    return any(cls.__name__ in classes for cls in type(module).__mro__)


def _named_like_a_norm(module: nn.Module) -> bool:
    """A norm defined outside torch, by its class name, holding its parameters itself: a model or block whose name
    ends in ``Norm`` but holds layers (``PreNorm(dim, attention)``, a root ``ResNetNoNorm``) is not one, or the whole
    of it would stay FP32 under every preset, silently."""
    if not _NORM_NAME.search(type(module).__name__):
        return False
    return not any(True for child in module.children() for _ in child.parameters())


def _is_kept_name(name: str, globs: tuple[str, ...], wrappers: tuple[str, ...] = ()) -> bool:
    # "*.lm_head" also matches a top-level "lm_head": match against ".lm_head" as well; and the name without the
    # prefix a wrapper adds ("module.fc2" under DDP is also "fc2"), so that one policy names the model wrapped or not
    names = {name, _unwrapped_name(name, wrappers)} - {""}
    return any(fnmatch.fnmatchcase(n, g) or fnmatch.fnmatchcase("." + n, g) for n in names for g in globs)


def _unwrapped_name(name: str, wrappers: tuple[str, ...]) -> str:
    for prefix in wrappers:
        if name.startswith(prefix):
            return name[len(prefix) :]
    return name


def _wrapper_prefixes(model: nn.Module) -> tuple[str, ...]:
    """The prefixes wrappers put before every module name, longest first: DDP's ``module.``, torch.compile's
    ``_orig_mod.`` (nested: ``_orig_mod.module.``)."""
    prefix, prefixes = "", []
    while (attribute := wrapper_attribute(model)) is not None:
        prefix += attribute + "."
        prefixes.append(prefix)
        model = getattr(model, attribute)
    return tuple(reversed(prefixes))


def enclosing(name: str, modules: Iterable[str]) -> str | None:
    """The first of ``modules`` (dotted names) that is the module ``name`` or holds it; None."""
    return next((outer for outer in modules if name == outer or name.startswith(outer + ".")), None)


def unwrapped(model: nn.Module) -> nn.Module:
    """The model inside its wrappers (DDP's, torch.compile's), or the model itself."""
    while (attribute := wrapper_attribute(model)) is not None:
        model = getattr(model, attribute)
    return model


def wrapper_attribute(model: nn.Module) -> str | None:
    """The attribute holding the model a wrapper wraps: DDP's ``module``, torch.compile's ``_orig_mod``; None."""
    if isinstance(model, nn.parallel.DistributedDataParallel):
        return "module"
    if type(model).__name__ == "OptimizedModule" and hasattr(model, "_orig_mod"):
        return "_orig_mod"
    return None


def fp32_modules(model: nn.Module, policy: Policy | str) -> Iterator[tuple[str, nn.Module]]:
    """The outermost submodules of ``model`` that ``policy`` (a Policy, or a name or string as get_policy takes)
    keeps in FP32, as (dotted name, module).

    A kept module's children are kept with it and are not listed again.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"fp32_modules(model=...) needs an nn.Module; received {type(model).__name__}.")
    policy = get_policy(policy, argument="fp32_modules(policy=...)")
    if not (policy.fp32_modules or policy.fp32_names):
        return
    wrappers = _wrapper_prefixes(model)
    yield from _outermost(
        model,
        lambda name, module: (
            _is_kept_class(module, policy.fp32_modules)
            or bool(name and _is_kept_name(name, policy.fp32_names, wrappers))
        ),
    )


def bf16_modules(model: nn.Module, policy: Policy) -> Iterator[tuple[str, nn.Module]]:
    """The outermost submodules of ``model`` that ``policy`` computes in bf16 (``bf16_names``), as (dotted name,
    module): none inside a module kept in FP32 (FP32 wins); a listed module's children are not listed again."""
    if not policy.bf16_names:
        return
    wrappers = _wrapper_prefixes(model)
    yield from _outermost(
        model,
        lambda name, module: bool(name and _is_kept_name(name, policy.bf16_names, wrappers)),
        skipped=[name for name, _ in fp32_modules(model, policy)],
    )


def _outermost(
    model: nn.Module, matches: Callable[[str, nn.Module], bool], skipped: list[str] | None = None
) -> Iterator[tuple[str, nn.Module]]:
    """The modules ``matches`` picks, outermost first, none inside one picked or inside one of ``skipped``. A module
    registered under several names (``model.b = model.a``) is picked by any of them, and listed once."""
    taken = list(skipped or [])
    inside: set[int] = set()  # the modules within those picked, whatever their names
    for name, module in model.named_modules(remove_duplicate=False):
        if id(module) in inside or enclosing(name, taken) is not None:
            continue
        if matches(name, module):
            taken.append(name)
            inside.update(map(id, module.modules()))
            yield name, module


def attention_projections(model: nn.Module) -> set[str]:
    """The Linear layers inside nn.MultiheadAttention, whose own forward the attention never calls (it reads
    their weights in ``F.multi_head_attention_forward``)."""
    names = set()
    for prefix, module in model.named_modules():
        if isinstance(module, nn.MultiheadAttention):
            names |= {f"{prefix}.{name}" if prefix else name for name, _ in module.named_modules() if name}
    return names


def _warn_bypassed(model: nn.Module, policy: Policy) -> None:
    """Warn of modules kept in FP32 whose forward is never called (a MultiheadAttention's ``out_proj``): their
    weights stay FP32, but they compute in the region's dtype."""
    bypassed = attention_projections(model)
    kept = [name for name, _ in fp32_modules(model, policy) if name in bypassed]
    if kept:
        parents = sorted({name.rsplit(".", 1)[0] for name in kept if "." in name})
        warnings.warn(
            f"{kept}: kept in FP32 by the policy, but nn.MultiheadAttention computes with their weights itself, not "
            "through their forward, so they compute in the region's dtype (their weights stay FP32). Keep the "
            f"attention instead: names={'+'.join(parents) or '<the attention module>'}.",
            stacklevel=3,
        )


def classes_named(policy: Policy) -> list[str]:
    """The module classes the policy keeps in FP32 by name, ``norm`` aside: presets list it for any model."""
    return [cls for cls in policy.fp32_modules if cls != NORM]


def check_fp32_entries(model: nn.Module, policy: Policy) -> None:
    """Raise ValueError for an entry of the policy's ``fp32_names``, ``bf16_names`` or ``fp32_modules`` (``norm``
    aside, which presets list for any model) that matches no module of ``model``: a typo would keep nothing in
    FP32, silently (a name of the doctor's advice mistyped: every fp16 step then overflowed and was skipped)."""
    named_classes = classes_named(policy)
    if not (policy.fp32_names or policy.bf16_names or named_classes):  # the presets' norm alone: nothing to check
        return
    _check_tied_across(model, policy)
    named = [(name, module) for name, module in model.named_modules(remove_duplicate=False) if name]  # every alias
    wrappers = _wrapper_prefixes(model)
    for key in ("fp32_names", "bf16_names"):
        for glob in getattr(policy, key):
            if not any(_is_kept_name(name, (glob,), wrappers) for name, _ in named):
                names = [n for n in dict.fromkeys(_unwrapped_name(name, wrappers) for name, _ in named) if n]
                raise ValueError(_unmatched(policy, key, glob, names, "module names", model))
    _check_bf16_outside_fp32(model, policy, named, wrappers)
    classes = {cls.__name__ for module in model.modules() for cls in type(module).__mro__}
    for cls in named_classes:
        if cls not in classes:
            raise ValueError(_unmatched(policy, "fp32_modules", cls, sorted(classes), "module classes", model))
    _warn_bypassed(model, policy)


def _check_tied_across(model: nn.Module, policy: Policy) -> None:
    """Raise ValueError for a parameter held both by a module the policy keeps in FP32 and by one whose parameters
    it stores in 16 bits (tied weights: a GPT's embedding and output head): one tensor has one dtype, and the
    module cast last decided it, silently (the FP32 rule dropped, or a master made for an FP32 weight)."""
    if policy.param_dtype == torch.float32:  # every parameter stays FP32: nothing to disagree on
        return
    kept = {id(m) for _, root in fp32_modules(model, policy) for m in root.modules()}
    holders: dict[int, tuple[list[str], list[str]]] = {}  # a parameter's holders: (lowered, kept)
    for name, module in model.named_modules(remove_duplicate=False):
        for key, param in module.named_parameters(recurse=False):
            if param.is_floating_point():
                holders.setdefault(id(param), ([], []))[id(module) in kept].append(f"{name}.{key}" if name else key)
    for lowered, fp32 in holders.values():
        if lowered and fp32:
            owners = [name.rpartition(".")[0] or name for name in (fp32[0], lowered[0])]
            raise ValueError(
                f"policy {policy}: the parameter {fp32[0]!r} is also {lowered[0]!r} (one tensor: tied weights); "
                f"{owners[0]!r} is kept in FP32 and {owners[1]!r} stores its parameters in "
                f"{DTYPE_NAMES.get(policy.param_dtype, policy.param_dtype)}, and one tensor has one dtype. Keep both "
                f"in FP32 (names={owners[0]}+{owners[1]}), or neither, or untie the weights."
            )


def _check_bf16_outside_fp32(
    model: nn.Module, policy: Policy, named: list[tuple[str, nn.Module]], wrappers: list[str]
) -> None:
    """Raise ValueError for a ``bf16_names`` entry whose every module lies in a module kept in FP32: FP32 wins
    there, so the entry would compute nothing in bf16, silently."""
    if not policy.bf16_names:
        return
    fp32 = [name for name, _ in fp32_modules(model, policy)]
    for glob in policy.bf16_names:
        matched = [name for name, _ in named if _is_kept_name(name, (glob,), wrappers)]
        outer = [enclosing(name, fp32) for name in matched]
        if matched and None not in outer:
            shown = ", ".join(sorted({_unwrapped_name(p, wrappers) for p in outer}))
            raise ValueError(
                f"policy {policy}: bf16_names entry {glob!r} matches only modules kept in FP32 ({shown}: FP32 "
                "wins inside them), so nothing would compute in bf16 for it. Take the entry out of bf16_names, or "
                "its module out of names= (or fp32_modules) to compute it in bf16."
            )


def _unmatched(policy: Policy, key: str, entry: str, candidates: list[str], what: str, model: nn.Module) -> str:
    close = difflib.get_close_matches(entry, candidates, n=3, cutoff=0.5)
    hint = f"did you mean {' or '.join(close)}? " if close else ""
    shown = ", ".join(candidates[:8]) + (", ..." if len(candidates) > 8 else "")
    effect = "compute in bf16" if key == "bf16_names" else "be kept in FP32"
    return (
        f"policy {policy}: {key} entry {entry!r} matches no module of this {type(model).__name__}, so nothing would "
        f"{effect} for it. {hint}Its {what}: {shown or 'none'}. Names are dotted paths as in "
        "model.named_modules() (globs allowed: *.lm_head); a wrapper's prefix (DDP's module., torch.compile's "
        "_orig_mod.) may be left out."
    )


def _target_dtypes(model: nn.Module, policy: Policy) -> Iterator[tuple[nn.Module, torch.dtype]]:
    kept = {id(m) for _, root in fp32_modules(model, policy) for m in root.modules()}
    for module in model.modules():
        yield module, torch.float32 if id(module) in kept else policy.param_dtype


def lowered_parameters(model: nn.Module, policy: Policy) -> list[nn.Parameter]:
    """The floating parameters that ``cast_module(model, policy)`` stores below FP32, each once."""
    unique: dict[int, nn.Parameter] = {}
    for module, dtype in _target_dtypes(model, policy):
        if dtype != torch.float32:
            for param in module.parameters(recurse=False):
                if param.is_floating_point():
                    unique.setdefault(id(param), param)
    return list(unique.values())


def cast_module(model: nn.Module, policy: Policy | str) -> nn.Module:
    """Cast ``model``'s floating parameters and buffers per ``policy``, in place; returns ``model``.

    Parameters of kept modules are cast to FP32 (so a policy can also be re-applied to an already
    low-precision model); non-floating buffers (counters, indices) are left alone.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.
        ValueError: a tied parameter held by a module the policy keeps in FP32 and by one it stores in 16 bits.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"cast_module(model=...) needs a torch.nn.Module; received an object of type {type(model).__name__}."
        )
    policy = get_policy(policy, argument="cast_module(policy=...)")
    if policy.fp32_names or policy.bf16_names or classes_named(policy):  # the norms alone tie nothing
        _check_tied_across(model, policy)  # as a region's preparation: one tensor cannot take two dtypes
    for module, dtype in _target_dtypes(model, policy):
        if isinstance(module, MIXED_DTYPE_NORMS) and dtype != torch.float32:
            _install_norm_input_cast(module)
        for param in module.parameters(recurse=False):
            if param.is_floating_point() and param.dtype != dtype:
                param.data = param.data.to(dtype)
                if param.grad is not None:
                    param.grad = param.grad.to(dtype)
        for key, buffer in module.named_buffers(recurse=False):
            if buffer is not None and buffer.is_floating_point() and buffer.dtype != dtype:
                setattr(module, key, buffer.to(dtype))
    return model


def _norm_input_to_params(module: nn.Module, args: tuple) -> tuple | None:
    """A norm with 16-bit parameters takes FP32 input in its parameters' dtype (PyTorch's CPU kernels
    refuse FP32 input with 16-bit parameters; a model's inputs often arrive in FP32)."""
    weight = getattr(module, "weight", None)
    if not args or not isinstance(args[0], torch.Tensor) or weight is None:
        return None
    if args[0].dtype == torch.float32 and weight.dtype in (torch.float16, torch.bfloat16):
        return (args[0].to(weight.dtype), *args[1:])
    return None


def _install_norm_input_cast(module: nn.Module) -> None:
    # Installed once and kept (a model's casts are permanent), so torch.compile sees the same hooks each step.
    if _norm_input_to_params not in module._forward_pre_hooks.values():
        module.register_forward_pre_hook(_norm_input_to_params)
