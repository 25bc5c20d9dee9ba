"""Gradients changed in place before the unscale, while they are not yet the ones the update takes.

From ``mp.backward()`` to the unscale (in ``mp.step()``, ``mp.unscale_()`` or ``mp.clip_grad_norm_()``) the
gradients are the engine's, for one of two reasons:

- **They carry the loss scale**, 2^16 at first. Code that clips or edits them there sees values that many times
  too large: ``torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)``, or Accelerate's
  ``accelerator.clip_grad_norm_`` which calls it, clips a gradient of true norm 0.9 as if its norm were 59000,
  and the update comes out 65536x too small, silently (measured: an fp16 MLP with SGD ended 3 epochs at loss
  2.17 instead of 0.23).
- **They are o2's 16-bit copies** (``o2_bf16`` has no scale): the unscale widens them into the FP32 masters,
  whose gradients the optimizer and ``mp.clip_grad_norm_`` read. A clip of the model's gradients computes the
  norm in 16 bits and rounds the clipped values to 16 bits (measured under ``o2_bf16``:
  ``accelerator.clip_grad_norm_`` returned a bf16 norm, 58.5), and with ``accumulate_in_fp32`` it would find no
  gradient on the model at all.

Autograd bumps a tensor's version counter at every in-place change, so the counters recorded at the end of each
backward tell whether anything wrote to the gradients since, or replaced them. FSDP2's gradients are DTensors,
whose foreach ops (``clip_grad_norm_``'s ``_foreach_mul_``) move neither their counter nor their local shard's
(torch 2.13): for them the guard also keeps each local shard's norm (:func:`_shard_norms`) and compares it.

A guard (:mod:`mixprec.engine.guards`): it records after each backward, and refuses before anything else touches
the gradients (the next backward, an unscale, a clip, the update) while they are pending. Cost: at each of those
points, two loops over the parameters in C (map: the gradient each holds, and its version counter), about 0.2 us
a parameter; no host sync, and device work only for a replaced gradient (compared with the one it replaced).
DTensor (FSDP2) gradients pending: one foreach norm of the local shards after each backward and at each check (a
read of the shards, as an unscale), and one host sync at each check, to compare them.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Callable, Iterable
from typing import Any

import torch

from mixprec.distributed.ranks import local

_GRAD, _VERSION = operator.attrgetter("grad"), operator.attrgetter("_version")

__all__ = ["GradSnapshot", "PendingGradsGuard", "grads_pending"]


def grads_pending(mp: Any) -> bool:
    """Whether the last backward's gradients are not yet the update's: they carry a loss scale, or they are o2's
    16-bit copies (``_scaled_by``: a backward whose gradients no unscale has taken yet)."""
    return mp._grads_carry_scale or (mp.masters is not None and mp._scaled_by is not None)


class GradSnapshot:
    """The gradients of ``params`` as they are now (the parameters with one, each gradient and its version
    counter, and DTensor gradients' local shard norms): :meth:`changed` tells which was written to or replaced
    since. The pending guard's record of a backward's gradients; MixedPrecision's of the optimizer's after an
    unscale that showed none on the model."""

    def __init__(self, params: Iterable[torch.Tensor] = ()) -> None:
        params = list(params)
        grads = list(map(_GRAD, params))
        if not all(map(operator.is_not, grads, itertools.repeat(None))):  # (`None in grads` would compare tensors)
            params = [p for p, g in zip(params, grads, strict=True) if g is not None]
            grads = [g for g in grads if g is not None]
        self._seen = (params, grads, list(map(_VERSION, grads)))
        # the DTensor gradients among them (indices into _seen) and their local shards' norms now
        sharded = [index for index, grad in enumerate(grads) if hasattr(grad, "placements")]
        self._sharded = (sharded, _shard_norms([grads[i] for i in sharded]))

    def changed(self) -> torch.Tensor | None:
        """The first parameter whose gradient was written to or replaced since the snapshot (a gradient set
        to None is not counted: nothing of it reaches the update), or None. A replacement by an equal copy,
        the old tensor untouched, is not a change: DDP with ``gradient_as_bucket_view`` moves gradients into
        its rebuilt buckets that way (a comparison on the device, only then)."""
        params, grads, versions = self._seen
        now = list(map(_GRAD, params))
        if all(map(operator.is_, now, grads)) and list(map(_VERSION, now)) == versions:
            return self._changed_shard()  # every gradient the one recorded, no counter moved: two loops in C
        for index, (param, grad, version, held) in enumerate(zip(params, grads, versions, now, strict=True)):
            if held is None or (held is grad and held._version == version):
                continue
            if held is not grad and grad._version == version and torch.equal(held, grad):
                grads[index], versions[index] = held, held._version
                continue
            return param
        return None

    def _changed_shard(self) -> torch.Tensor | None:
        """The first parameter whose DTensor gradient's local shard no longer has the norm it had (host sync)."""
        indices, norms = self._sharded
        if norms is None:
            return None
        now = _shard_norms([self._seen[1][i] for i in indices])
        same = (now == norms) | (now.isnan() & norms.isnan())  # an overflow's NaN stays a NaN: no edit
        if bool(same.all()):
            return None
        return self._seen[0][indices[int((~same).nonzero()[0])]]


class PendingGradsGuard:
    """The gradients as the last backward left them (a :class:`GradSnapshot`), refused if changed before the
    unscale takes them."""

    def __init__(self, params: Callable[[Any], Iterable[torch.Tensor]]) -> None:
        # params(mp): the model's and the optimizer's now (o2's masters hold the unscaled ones); given the engine
        # at each call rather than bound to it, so the engine holds no cycle through its guards (freed at `del`)
        self._params = params
        self._snapshot = GradSnapshot()

    def before_forward(self, mp: Any) -> None:
        if not grads_pending(mp):  # unscaled or dropped: hold no reference to them while the forward allocates
            self.forget()

    def after_backward(self, mp: Any) -> None:
        if grads_pending(mp):  # unscaled gradients are the caller's to edit
            self._snapshot = GradSnapshot(self._params(mp))

    def before_gradients(self, mp: Any) -> None:
        """Before a backward adds to the gradients or an unscale divides them: nothing may have edited them."""
        self._refuse_changed(mp)

    before_update = before_gradients  # before an update the same: nothing may have edited them

    def _refuse_changed(self, mp: Any) -> None:
        if not grads_pending(mp):  # unscaled (by mixprec) or dropped since the record: nothing to watch
            self.forget()
            return
        param = self._snapshot.changed()
        if param is None:
            return
        message = changed_message(param, mp)
        mp.zero_grad()  # the window's gradients are spoiled: retrying must not apply them
        raise RuntimeError(message)

    def forget(self) -> None:
        """The gradients are unscaled now: changing them is the caller's business."""
        self._snapshot = GradSnapshot()


def _shard_norms(grads: list[torch.Tensor]) -> torch.Tensor | None:
    """The norm of each DTensor gradient's local shard, in FP32 (no host sync); None without any."""
    if not grads:
        return None
    shards = [local(grad) for grad in grads]
    return torch.stack([norm.to(shards[0].device) for norm in torch._foreach_norm(shards, 2, dtype=torch.float32)])


def changed_message(param: torch.Tensor, mp: Any) -> str:
    """Why an edit of ``param``'s pending gradient is refused, and where to make it instead."""
    name = next((n for n, p in mp.model.named_parameters() if p is param), "a master weight")
    if mp._grads_carry_scale:
        why = (
            "while still multiplied by the loss scale: clipping or editing scaled gradients "
            "(torch.nn.utils.clip_grad_norm_, accelerator.clip_grad_norm_) sees them the loss scale (2^16 at first) "
            "times too large, and the update would shrink silently."
        )
    else:
        why = (
            "before the unscale, on the 16-bit model: under o2 policies the update takes the FP32 masters' "
            "gradients, so a clip there (torch.nn.utils.clip_grad_norm_, accelerator.clip_grad_norm_) measures "
            "the norm in 16 bits and rounds the result."
        )
    return (
        f"MixedPrecision: the gradient of {name!r} was changed after mp.backward() {why} Nothing was applied, and "
        "this window's gradients were dropped. Clip with mp.clip_grad_norm_(max_norm), which unscales first and "
        "measures in FP32, or change gradients after mp.unscale_() (the model's: under o2_bf16 unscale_() shows the "
        "FP32 masters' gradients there until step(), and an edit reaches the masters; or the optimizer's, under "
        "o2_fp16 the FP32 masters; in Lightning, in on_before_optimizer_step), or in a gradient hook during backward."
    )
