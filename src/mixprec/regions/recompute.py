"""Activation checkpointing inside a policy's region: the recomputed forward runs where the forward ran.

``torch.utils.checkpoint`` recomputes a block's forward during backward, after the region has exited. It
restores ``torch.autocast``'s state, but not the rest of a region: the emulation's 16-bit roundings, the
policy's FP32 ops and FP32 modules, bf16 GEMM attention. The recomputed activations, and the gradients
made from them, would then differ from the forward's. Here the region the forward ran in is re-entered
for the recompute, through ``torch.utils.checkpoint``'s own ``context_fn``:

    forward, inside the region:   checkpoint(block, x)  -> remembers the region (and whether an FP32
                                                           module's forward is open around the call)
    backward, region exited:      recompute block(x)     -> inside that region again

so gradients with checkpointing equal those without, bit for bit (tested per policy). Needs the
non-reentrant checkpoint (``use_reentrant=False``); the reentrant one takes no ``context_fn``.

Hugging Face models hold the checkpoint function their layers call (``_gradient_checkpointing_func``, set by
``model.gradient_checkpointing_enable()``); a region on such a model wraps it (:func:`wire_checkpointing`),
so enabling checkpointing on the model is all a user does. Compiled code is left to the compiler, which
traces the checkpointed block and recomputes from that graph, except in an emulated region: the emulation
does not reach a traced checkpoint's body, so there the block runs eagerly (a graph break).

Example:
    >>> import torch, torch.nn as nn, mixprec
    >>> block = nn.Sequential(nn.Linear(4, 4), nn.GELU())
    >>> x = torch.randn(2, 4, requires_grad=True)
    >>> with mixprec.autocast("mixed_bf16", block):
    ...     y = mixprec.checkpoint(block, x)
    >>> y.sum().backward()  # the recompute ran in mixed_bf16's region
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from mixprec.checks import flag, shown
from mixprec.compute.emulation import active_emulation
from mixprec.compute.foreign_recompute import (
    claim_checkpoint,
    entered_region,
    entered_regions,
    innermost_region,
    mixprec_checkpoint_forward,
)

__all__ = ["checkpoint", "recompute_context", "wire_checkpointing"]


@dataclasses.dataclass(eq=False)
class Frame:
    """One entered region on this thread: how to enter it again, how a module of each format the policy names
    computes in a recompute (``"fp32"``: kept in FP32, ``"bf16"``: an fp16 policy's ``bf16_names``), and the formats
    of the module forwards open now, innermost last."""

    region: Any  # a regions.autocast.Region (not imported: that module imports this one)
    module_regions: dict[str, Callable[[], contextlib.AbstractContextManager]]
    open: list[str] = dataclasses.field(default_factory=list)


def current_frame() -> Frame | None:
    """The innermost region entered on this thread (eager code; compiled regions are not tracked)."""
    region = innermost_region()
    return None if region is None else region.record


@contextlib.contextmanager
def entered(frame: Frame | None) -> Iterator[None]:
    """Track ``frame`` as the innermost region while inside (a no-op for None: compiled code)."""
    if frame is None:
        yield
        return
    with entered_region(frame):
        yield


def recompute_context() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
    """A ``context_fn`` for ``torch.utils.checkpoint.checkpoint(use_reentrant=False)``: around the forward, a
    mark that this checkpoint's recompute re-enters the region (the region's parts refuse torch's checkpoint
    without it, see compute/foreign_recompute.py); around the recompute, the regions the forward runs in now,
    outermost first (another model's region around this one's keeps its own routed modules computing: a student
    called inside a teacher's region); nothing around either if no region is active.

    Raises:
        ValueError: a region's GEMM layers compute in FP8 now (a recompute would record their amax again).
    """
    frames = [entry.record for entry in entered_regions()]
    if not frames:
        return contextlib.nullcontext(), contextlib.nullcontext()
    regions = [frame.region for frame in frames]
    for region in regions:
        if region.computes_fp8():
            raise ValueError(
                f"activation checkpointing under policy {region.policy} is not supported: its FP8 layers "
                "record each tensor's amax in the forward, and the recompute would record it a second time and "
                "advance the scales. Checkpoint under a policy without fp8, or train FP8 without checkpointing."
            )
    inside = frames[-1].open[-1] if frames[-1].open else None
    return mixprec_checkpoint_forward(), _Reusable(functools.partial(_recompute_in, regions, inside))


class _Reusable:
    """A context manager made anew from ``make`` at each entry: torch's checkpoint enters its recompute context once
    per recompute, and a graph kept with ``retain_graph=True`` recomputes at each backward (a generator-based
    context entered twice raised AttributeError)."""

    def __init__(self, make: Callable[[], contextlib.AbstractContextManager]) -> None:
        self.make = make
        self.entered: list[contextlib.AbstractContextManager] = []

    def __enter__(self) -> None:
        context = self.make()
        context.__enter__()
        self.entered.append(context)

    def __exit__(self, *exc_info: Any) -> bool | None:
        return self.entered.pop().__exit__(*exc_info)


@contextlib.contextmanager
def _recompute_in(regions: list[Any], inside: str | None) -> Iterator[None]:
    """The regions again (outermost first), entered for the recompute also where the backward runs inside one of
    them (a recompute in the emulation's own entry, which saves 16-bit copies for backward, raised CheckpointError:
    the recomputed tensors' metadata differed); the region of the module the checkpoint was called inside
    (``inside``: its format; an FP32 module's, a bf16 module's), if any."""
    with contextlib.ExitStack() as stack:
        for region in regions:
            stack.enter_context(region.enter(recomputing=True))
        if inside is not None:
            stack.enter_context(current_frame().module_regions[inside]())
        yield


def _with_recompute(context_fn: Callable | None) -> Callable:
    """``context_fn`` (a user's, e.g. selective checkpointing's) with the region entered around its recompute."""
    import torch.utils.checkpoint  # here: it loads torch's compiler (1.4 s of every start)

    if context_fn is None or context_fn is torch.utils.checkpoint.noop_context_fn:
        return recompute_context

    def both() -> tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
        forward, recompute = context_fn()
        mark, region = recompute_context()
        return _nested(mark, forward), _Reusable(functools.partial(_nested, region, recompute))

    return both


@contextlib.contextmanager
def _nested(outer: contextlib.AbstractContextManager, inner: contextlib.AbstractContextManager) -> Iterator[None]:
    with outer, inner:
        yield


def _reentrant_refused(who: str, fix: str) -> ValueError:
    return ValueError(
        f"{who} checkpoints activations with use_reentrant=True, which recomputes outside the policy's region "
        f"(it takes no context_fn), so backward would differ from forward. {fix}"
    )


def checkpoint(function: Callable, *args: Any, use_reentrant: bool = False, **kwargs: Any) -> Any:
    """``torch.utils.checkpoint.checkpoint`` whose recompute runs in the region the forward ran in.

    The same arguments as torch's (``use_reentrant`` must stay False); a ``context_fn`` of your own (e.g.
    selective checkpointing) is kept, with the region entered around its recompute context.

    Raises:
        ValueError: ``use_reentrant=True``; the region computes GEMM layers in FP8.
    """
    import torch.utils.checkpoint  # here: it loads torch's compiler (1.4 s of every start)

    if not callable(function):
        raise TypeError(f"mixprec.checkpoint(function=...) needs a callable; received {shown(function)}.")
    if flag(use_reentrant, "mixprec.checkpoint(use_reentrant=...)"):
        raise _reentrant_refused("mixprec.checkpoint", "Use use_reentrant=False.")
    return _checkpoint_in_region(torch.utils.checkpoint.checkpoint, function, *args, **kwargs)


def _eager(reason: str) -> Callable[[Callable], Callable]:
    """``torch.compiler.disable`` with the reason its graph break reports (torch versions that take one)."""
    try:
        return torch.compiler.disable(reason=reason)
    except TypeError:
        return torch.compiler.disable


def _checkpoint_in_region(checkpoint_fn: Callable, function: Callable, *args: Any, **kwargs: Any) -> Any:
    if not torch.compiler.is_compiling():
        return _checkpoint_with_context(checkpoint_fn, function, *args, **kwargs)
    if active_emulation() is None:
        # the compiler recomputes from the graph it traced, with autocast, FP32 ops and modules as traced
        return checkpoint_fn(function, *args, use_reentrant=False, **kwargs)
    return _eager_checkpoint()(checkpoint_fn, function, *args, **kwargs)


_EAGER: dict[str, Callable] = {}  # not functools.cache: torch 2.11's dynamo traces past it, with a warning


def _eager_checkpoint() -> Callable:
    """:func:`_checkpoint_with_context`, run eagerly from compiled code. Traced, a checkpointed block loses the
    emulation's roundings (measured, torch 2.13: the mode does not reach the checkpoint's traced body), so
    compiled code calls it eagerly, at the cost of a graph break; where the region itself was entered in the
    compiled code, that break is an error (see regions/autocast.py)."""
    eager = _EAGER.get("checkpoint")
    if eager is None:
        eager = _EAGER["checkpoint"] = _eager(
            "mixprec.checkpoint in an emulated 16-bit region runs eagerly: traced, the checkpointed block would "
            "lose the emulation's roundings. Enter the region outside the compiled code: with mp.autocast(): "
            "compiled_model(x)"
        )(_checkpoint_with_context)
    return eager


def _checkpoint_with_context(checkpoint_fn: Callable, function: Callable, *args: Any, **kwargs: Any) -> Any:
    context_fn = _with_recompute(kwargs.pop("context_fn", None) or _bound(checkpoint_fn).get("context_fn"))

    def claimed(*inner_args: Any, **inner_kwargs: Any) -> Any:
        claim_checkpoint()  # the checkpoint hook innermost now is this checkpoint's: a torch one inside is not
        return function(*inner_args, **inner_kwargs)

    return checkpoint_fn(claimed, *args, use_reentrant=False, context_fn=context_fn, **kwargs)


class InRegion:
    """A model's own checkpoint function (Hugging Face's ``_gradient_checkpointing_func``: torch's checkpoint
    with the model's arguments), recomputing in the region the forward ran in."""

    def __init__(self, checkpoint_fn: Callable) -> None:
        self.checkpoint_fn = checkpoint_fn

    def __call__(self, function: Callable, *args: Any, **kwargs: Any) -> Any:
        return _checkpoint_in_region(self.checkpoint_fn, function, *args, **kwargs)

    def __repr__(self) -> str:
        return f"mixprec.regions.recompute.InRegion({self.checkpoint_fn!r})"


def _bound(checkpoint_fn: Callable) -> dict[str, Any]:
    """The keyword arguments bound to ``checkpoint_fn`` by (nested) ``functools.partial``."""
    bound: dict[str, Any] = {}
    while isinstance(checkpoint_fn, functools.partial):
        bound = {**checkpoint_fn.keywords, **bound}  # an outer partial's keywords win
        checkpoint_fn = checkpoint_fn.func
    return bound


def checkpointing_modules(model: nn.Module) -> list[nn.Module]:
    """The modules that may call a checkpoint function of their own (Hugging Face's convention: a
    ``gradient_checkpointing`` flag, and ``_gradient_checkpointing_func`` once enabled)."""
    return [module for module in model.modules() if hasattr(module, "gradient_checkpointing")]


def wire_checkpointing(modules: list[nn.Module]) -> None:
    """Wrap each module's checkpoint function in :class:`InRegion` (once; again after it was re-enabled).

    Raises:
        ValueError: the function was bound with ``use_reentrant=True``.
    """
    for module in modules:
        checkpoint_fn = vars(module).get("_gradient_checkpointing_func")
        if checkpoint_fn is None or isinstance(checkpoint_fn, InRegion):
            continue
        if _bound(checkpoint_fn).get("use_reentrant"):
            raise _reentrant_refused(
                type(module).__name__,
                "Enable it with use_reentrant=False (transformers' default): "
                "model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': False}).",
            )
        module._gradient_checkpointing_func = InRegion(checkpoint_fn)
