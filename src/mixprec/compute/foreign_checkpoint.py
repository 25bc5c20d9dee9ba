"""Detects ``torch.utils.checkpoint`` called directly inside a region, whose recompute would leave the region.

Torch's non-reentrant checkpoint drops what a block saves for backward and runs the block again during
backward, after the region has exited. It restores ``torch.autocast``'s state and nothing else, so the parts
of a region that autocast does not hold (the emulation's roundings, the policy's FP32 ops and modules, GEMM
attention, FP8 layers) would compute the recomputed activations differently from the forward's. Often torch
notices (a ``CheckpointError``: the recomputed dtypes differ), but not always: under fp16 emulation every
activation is an FP32 tensor, so the recompute silently skips the 16-bit roundings and backward's gradients
come from other activations than the loss did.

Each of those parts calls :func:`refuse_foreign_checkpoint` where it computes something with autograd on:
while torch's checkpoint is recording a forward (its saved-tensor hook is the innermost one), and the
checkpoint was not made by mixprec (whose recompute re-enters the region, see regions/recompute.py, and
marks its forward with :func:`mixprec_checkpoint_forward`), the forward stops with the fix.

Costs one C call (about 0.2 µs) per op these parts handle; nothing for autocast's own ops, which torch's
checkpoint restores correctly. Not detected: torch's checkpoint nested inside a mixprec one, and the
reentrant checkpoint (``use_reentrant=True``), whose forward runs without autograd and without hooks.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

__all__ = ["mixprec_checkpoint_forward", "refuse_foreign_checkpoint"]

_local = threading.local()
# torch.utils.checkpoint's saved-tensor hook while it records a forward (a class of torch's, by its name)
_TORCH_CHECKPOINT_HOOK = "_checkpoint_hook."


@contextlib.contextmanager
def mixprec_checkpoint_forward() -> Iterator[None]:
    """Marks the forward of a checkpoint whose recompute re-enters the region (a ``context_fn``'s forward part)."""
    _local.depth = getattr(_local, "depth", 0) + 1
    try:
        yield
    finally:
        _local.depth -= 1


def refuse_foreign_checkpoint(part: str) -> None:
    """Raise ValueError when torch's own checkpoint records this forward (eager, autograd on); ``part``: what
    of the region would be missing from its recompute, for the message."""
    if not torch.is_grad_enabled() or torch.compiler.is_compiling() or getattr(_local, "depth", 0):
        return
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    if hooks is None or not getattr(hooks[0], "__qualname__", "").startswith(_TORCH_CHECKPOINT_HOOK):
        return
    raise ValueError(
        "torch.utils.checkpoint was called inside a mixprec region: its recompute runs during backward, after the "
        f"region has exited, without {part}, so backward would use other activations than the forward. Call "
        "mixprec.checkpoint(function, *args, ...) instead (the same arguments), or pass "
        "context_fn=mixprec.recompute_context to torch.utils.checkpoint.checkpoint(..., use_reentrant=False)."
    )
