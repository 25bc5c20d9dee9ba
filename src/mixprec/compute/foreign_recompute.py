"""Detects ``torch.utils.checkpoint`` called directly inside a region, whose recompute would leave the region.

Torch's non-reentrant checkpoint drops what a block saves for backward and runs the block again during
backward, after the region has exited. It restores ``torch.autocast``'s state and nothing else, so the parts
of a region that autocast does not hold (the emulation's roundings, the policy's FP32 ops and modules, GEMM
attention, FP8 layers) would compute the recomputed activations differently from the forward's. Often torch
notices (a ``CheckpointError``: the recomputed dtypes differ), but not always: under fp16 emulation every
activation is an FP32 tensor, so the recompute silently skips the 16-bit roundings and backward's gradients
come from other activations than the loss did.

The region hands :func:`refuse_foreign_recompute` to each of those parts where it builds them (regions/autocast.py,
once), and each part calls it where it computes something: while torch's
checkpoint is recording a forward (its saved-tensor hook is the innermost one), and the checkpoint was not
made by mixprec (whose recompute re-enters the region, see regions/recompute.py, and marks its forward with
:func:`mixprec_checkpoint_forward`), the forward stops with the fix. The reentrant checkpoint
(``use_reentrant=True``) runs its forward with autograd off and no hook: inside a region entered with autograd
on (:func:`entered_region`), an op run with autograd off looks for that checkpoint's forward among its
callers. A checkpoint begun before the region was entered (the region inside the checkpointed block) is
fine: its recompute enters the region again with the block.

Costs about 1 µs per op these parts handle (measured 0.8 to 1.1 µs), and a walk up the call stack (a few µs) for those
run with autograd off inside a training region once torch.utils.checkpoint is imported; nothing for
autocast's own ops, which torch's checkpoint restores correctly. Not detected: torch's checkpoint inside a
compiled model (the compiler traces it, and these parts do not run); with ``context_fn=recompute_context``
passed to torch's checkpoint directly, a torch checkpoint nested inside before any op the region handles.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
import threading
from collections.abc import Iterator
from typing import Any

import torch

__all__ = [
    "EnteredRegion",
    "checkpoint_holds_saved",
    "claim_checkpoint",
    "closing_failed_checkpoints",
    "entered_region",
    "innermost_region",
    "mixprec_checkpoint_forward",
    "refuse_foreign_recompute",
]

_local = threading.local()
# torch.utils.checkpoint's saved-tensor hook while it records a forward (a class of torch's, by its name)
_TORCH_CHECKPOINT_HOOK = "_checkpoint_hook."
_TORCH_RECOMPUTE_HOOK = "_recomputation_hook."  # and while it recomputes one


@contextlib.contextmanager
def mixprec_checkpoint_forward() -> Iterator[None]:
    """Marks the forward of a checkpoint whose recompute re-enters the region (a ``context_fn``'s forward part).
    The mark claims the checkpoint hook torch pushes after this context is entered (:func:`claim_checkpoint`,
    else the first one an op meets), so a torch checkpoint nested inside is still refused."""
    marks = _stack("marks")
    marks.append([None])
    try:
        yield
    finally:
        marks.pop()


def claim_checkpoint() -> None:
    """Called first thing inside mixprec's checkpointed function: the checkpoint hook innermost now is its own."""
    marks = _stack("marks")
    if marks and marks[-1][0] is None:
        marks[-1][0] = _top_pack()


@dataclasses.dataclass(eq=False)
class EnteredRegion:
    """A region entered on this thread (eager code): whether autograd was on (a training forward, where an op
    run with autograd off may be a reentrant checkpoint's forward), the saved-tensor hook innermost at entry (a
    checkpoint begun before the region recomputes the region with its block), and the region's own record
    (regions/recompute.py's Frame: how to enter it again)."""

    training: bool
    entry_pack: object | None
    record: Any


@contextlib.contextmanager
def entered_region(record: Any) -> Iterator[None]:
    """Track a region as the innermost one on this thread while inside."""
    regions = _stack("regions")
    entry = EnteredRegion(torch.is_grad_enabled(), _top_pack(), record)
    regions.append(entry)
    try:
        yield
    finally:
        regions.remove(entry)


def innermost_region() -> EnteredRegion | None:
    """The innermost region entered on this thread (eager code; compiled regions are not tracked)."""
    regions = _stack("regions")
    return regions[-1] if regions else None


def entered_regions() -> list[EnteredRegion]:
    """The regions entered on this thread, outermost first (eager code)."""
    return list(_stack("regions"))


def _stack(name: str) -> list:
    stack = getattr(_local, name, None)
    if stack is None:
        stack = []
        setattr(_local, name, stack)
    return stack


def _top_pack() -> object | None:
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    return None if hooks is None else hooks[0]


def checkpoint_holds_saved() -> bool:
    """Whether torch's checkpoint takes what autograd saves now: its forward's hook or its recompute's is the
    innermost saved-tensor hook (eager code)."""
    name = getattr(_top_pack(), "__qualname__", "")
    return name.startswith((_TORCH_CHECKPOINT_HOOK, _TORCH_RECOMPUTE_HOOK))


def refuse_foreign_recompute(part: str) -> None:
    """Raise ValueError when torch's own checkpoint records this forward (eager), begun inside the region and
    not made by mixprec; ``part``: what of the region would be missing from its recompute, for the message."""
    region = innermost_region()
    if torch.compiler.is_compiling() or region is None:
        return
    if not torch.is_grad_enabled():
        if region.training and _in_reentrant_checkpoint():
            raise ValueError(_refusal("torch.utils.checkpoint(..., use_reentrant=True)", part, reentrant=True))
        return
    pack = _top_pack()
    torchs = getattr(pack, "__qualname__", "").startswith(_TORCH_CHECKPOINT_HOOK)
    if not torchs or pack is region.entry_pack:
        return
    marks = _stack("marks")
    if marks and marks[-1][0] is None:
        marks[-1][0] = pack  # mixprec's checkpoint: the first checkpoint hook its forward meets is its own
    if marks and marks[-1][0] is pack:
        return
    raise ValueError(_refusal("torch.utils.checkpoint", part, reentrant=False))


@contextlib.contextmanager
def closing_failed_checkpoints() -> Iterator[None]:
    """Around a region's inside: an exception that leaves it through non-reentrant checkpoints (a refusal, an
    error of the user's in the checkpointed function) closes what those checkpoints pushed for their forward.

    torch 2.12 and older never resume the generator that pops them when the checkpointed function raises: its
    saved-tensor hook stays innermost, so tensors saved afterwards are kept for a recompute that never comes,
    and the region's own exit pops that hook instead of its own (on torch 2.11 the emulation's hook then
    stayed on outside any region, and every later checkpoint failed). The checkpoints the exception passed
    through are in its traceback; closing their generators, innermost first, runs their exits in order.
    Newer torch throws the exception into the generator itself: nothing is done there.
    """
    try:
        yield
    except BaseException as error:
        _close_checkpoints_in(error.__traceback__)
        raise


def _close_checkpoints_in(traceback: Any) -> None:
    module = sys.modules.get("torch.utils.checkpoint")
    function = getattr(module, "checkpoint", None)
    code = getattr(getattr(function, "__wrapped__", function), "__code__", None)
    if code is None or "throw" in code.co_names:
        return
    generators = []
    while traceback is not None:  # outermost frame first
        if traceback.tb_frame.f_code is code:
            generators.append(traceback.tb_frame.f_locals.get("gen"))
        traceback = traceback.tb_next
    for generator in reversed(generators):
        if generator is not None and hasattr(generator, "close"):
            generator.close()


def _in_reentrant_checkpoint() -> bool:
    """Whether the reentrant checkpoint's forward is among the callers (only once its module is imported)."""
    module = sys.modules.get("torch.utils.checkpoint")
    function = getattr(module, "CheckpointFunction", None)
    code = getattr(getattr(function, "forward", None), "__code__", None)
    frame = sys._getframe(2)
    while frame is not None and code is not None:
        if frame.f_code is code:
            return True
        frame = frame.f_back
    return False


def _refusal(call: str, part: str, reentrant: bool) -> str:
    fix = (
        "Call mixprec.checkpoint(function, *args) instead (non-reentrant, with the same other arguments)."
        if reentrant
        else "Call mixprec.checkpoint(function, *args, ...) instead (the same arguments), or pass "
        "context_fn=mixprec.recompute_context to torch.utils.checkpoint.checkpoint(..., use_reentrant=False)."
    )
    return (
        f"{call} was called inside a mixprec region: its recompute runs during backward, after the region has "
        f"exited, without {part}, so backward would use other activations than the forward. {fix}"
    )
