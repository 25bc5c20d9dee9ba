"""Gradients changed in place while they still carry the loss scale, noticed before they are unscaled.

From ``mp.backward()`` to the unscale (in ``mp.step()``, ``mp.unscale_()`` or ``mp.clip_grad_norm_()``) every
gradient is multiplied by the loss scale, 2^16 at first. Code that clips or edits gradients there sees values
that many times too large: ``torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)``, or Accelerate's
``accelerator.clip_grad_norm_`` which calls it, clips a gradient of true norm 0.9 as if its norm were 59000,
and the update comes out 65536x too small, silently (measured: an fp16 MLP with SGD ended 3 epochs at loss 2.17
instead of 0.23). Autograd bumps a tensor's version counter at every in-place change, so the counters recorded
at the end of each backward tell whether anything wrote to the gradients since, or replaced them.

A guard (:mod:`mixprec.engine.guards`): it records after each backward that left scaled gradients, and refuses
before anything else touches them (the next backward, an unscale, a clip, the update) while they still carry the
scale. Cost: a Python loop over the parameters at each of those points; no host sync, and device work only for a
replaced gradient (compared with the one it replaced).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

__all__ = ["ScaledGradsGuard"]


class ScaledGradsGuard:
    """The gradients as the last backward left them: each one's tensor and version counter, by parameter."""

    def __init__(self, params: Callable[[], Iterable[torch.Tensor]]) -> None:
        self._params = params  # the model's and the optimizer's now (o2's masters hold the unscaled ones)
        self._seen: dict[int, tuple[torch.Tensor, torch.Tensor, int]] = {}  # id(param) -> (param, grad, version)

    def before_forward(self, mp: Any) -> None:
        if not mp._grads_carry_scale:  # unscaled or dropped: hold no reference to them while the forward allocates
            self.forget()

    def after_backward(self, mp: Any) -> None:
        if mp._grads_carry_scale:  # unscaled gradients are the caller's to edit
            self.record(self._params())

    def before_gradients(self, mp: Any) -> None:
        """Before a backward adds to the gradients or an unscale divides them: nothing may have edited them."""
        self._refuse_changed(mp)

    before_update = before_gradients  # before an update the same: nothing may have edited them

    def _refuse_changed(self, mp: Any) -> None:
        if not mp._grads_carry_scale:  # unscaled (by mixprec) or dropped since the record: nothing to watch
            self.forget()
            return
        param = self.changed()
        if param is None:
            return
        mp.zero_grad()  # the window's gradients are spoiled: retrying must not apply them
        name = next((n for n, p in mp.model.named_parameters() if p is param), "a master weight")
        raise RuntimeError(
            f"MixedPrecision: the gradient of {name!r} was changed after mp.backward() while still multiplied "
            "by the loss scale: clipping or editing scaled gradients (torch.nn.utils.clip_grad_norm_, "
            "accelerator.clip_grad_norm_) sees them the loss scale (2^16 at first) times too large, and the update "
            "would shrink silently. Nothing was applied, and this window's gradients were dropped. Clip with "
            "mp.clip_grad_norm_(max_norm), which unscales first, or change gradients after mp.unscale_() (then the "
            "optimizer's: under o2 policies the FP32 masters in optimizer.param_groups hold them; in Lightning, in "
            "on_before_optimizer_step, where they are unscaled), or in a gradient hook during backward."
        )

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
