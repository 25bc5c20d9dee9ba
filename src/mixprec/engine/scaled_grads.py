"""Gradients changed in place while they still carry the loss scale, noticed before they are unscaled.

From ``mp.backward()`` to the unscale (in ``mp.step()``, ``mp.unscale_()`` or ``mp.clip_grad_norm_()``) every
gradient is multiplied by the loss scale, 2^16 at first. Code that clips or edits gradients there sees values
that many times too large: ``torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)``, or Accelerate's
``accelerator.clip_grad_norm_`` which calls it, clips a gradient of true norm 0.9 as if its norm were 59000,
and the update comes out 65536x too small, silently (measured: an fp16 MLP with SGD ended 3 epochs at loss 2.17
instead of 0.23). Autograd bumps a tensor's version counter at every in-place change, so the counters recorded
at the end of each backward tell whether anything wrote to the gradients since, or replaced them.

Cost: a Python loop over the parameters at each backward and each unscale; no device work, no host sync.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

__all__ = ["ScaledGradsWatch"]


class ScaledGradsWatch:
    """The gradients as the last backward left them: each one's tensor and version counter, by parameter."""

    def __init__(self) -> None:
        self._seen: dict[int, tuple[torch.Tensor, torch.Tensor, int]] = {}  # id(param) -> (param, grad, version)

    def record(self, params: Iterable[torch.Tensor]) -> None:
        """Remember the gradients of ``params`` now (the end of a backward)."""
        self._seen = {id(p): (p, p.grad, p.grad._version) for p in params if p.grad is not None}

    def forget(self) -> None:
        """The gradients are unscaled now: changing them is the caller's business."""
        self._seen = {}

    def changed(self) -> torch.Tensor | None:
        """The first parameter whose gradient was written to or replaced since :meth:`record` (a gradient set
        to None is not counted: nothing of it reaches the update), or None. A replacement by an equal copy,
        the old tensor untouched, is not a change: DDP with ``gradient_as_bucket_view`` moves gradients into
        its rebuilt buckets that way (a comparison on the device, only then)."""
        for key, (param, grad, version) in self._seen.items():
            now = param.grad
            if now is None or (now is grad and now._version == version):
                continue
            if now is not grad and grad._version == version and torch.equal(now, grad):
                self._seen[key] = (param, now, now._version)
                continue
            return param
        return None
