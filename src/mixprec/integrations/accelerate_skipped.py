"""Accelerate's ``step_was_skipped``, told by MixedPrecision: a prepared scheduler does not advance on a skip.

``accelerator.prepare(scheduler)`` wraps an LR scheduler in Accelerate's ``AcceleratedScheduler``, whose
``step()`` passes the call on only when no prepared optimizer reports ``step_was_skipped``. Accelerate sets that
flag only in its own GradScaler branch; with ``Accelerator(mixed_precision="no")`` (mixprec's setting) it stays
False, so a plain ``scheduler.step()`` after a skipped update advanced the schedule (measured: 8 scheduler steps
for 7 applied updates) and ``accelerator.optimizer_step_was_skipped`` said False.

mixprec extends the property: for an optimizer a MixedPrecision steps (the one it was built with, which the
``AcceleratedOptimizer`` wraps, or that ``AcceleratedOptimizer`` itself) it is True when that MixedPrecision's
last ``step()`` applied no update: an overflow, or a micro-batch inside its own accumulation window, so the
schedule counts applied updates as ``mp.step_scheduler`` does. Any other optimizer reads Accelerate's own flag.
The property is extended once, at the first ``mp.step()`` after Accelerate's optimizer module was imported (a
guard on the engine's list, :mod:`mixprec.engine.guards`), and only where it is the property this module knows.
Reading it costs a dict lookup and, after an update step, ``StepResult``'s host sync (``mp.step()`` read the same
flag already, except with a fused optimizer on a GPU). This module imports neither Accelerate nor torch.
"""

from __future__ import annotations

import sys
import weakref
from typing import Any

from mixprec.engine import register_guard

__all__ = ["SkippedStepReport"]

_STEPPED_BY: weakref.WeakKeyDictionary[Any, weakref.ref] = weakref.WeakKeyDictionary()  # optimizer -> its mp


class SkippedStepReport:
    """At the first ``mp.step()`` with Accelerate imported: note which optimizer this MixedPrecision steps."""

    def __init__(self) -> None:
        self._noted = False

    def before_update(self, mp: Any) -> None:
        if self._noted or (module := sys.modules.get("accelerate.optimizer")) is None:
            return
        self._noted = True
        _STEPPED_BY[mp.optimizer] = weakref.ref(mp)
        extend_step_was_skipped(getattr(module, "AcceleratedOptimizer", None))


register_guard(SkippedStepReport)


def extend_step_was_skipped(accelerated_optimizer: type | None) -> None:
    """Make ``AcceleratedOptimizer.step_was_skipped`` ask the MixedPrecision that steps the optimizer, once."""
    accelerate_own = getattr(accelerated_optimizer, "__dict__", {}).get("step_was_skipped")
    if not isinstance(accelerate_own, property) or getattr(accelerate_own.fget, "mixprec", False):
        return  # another layout of Accelerate, or extended already

    def step_was_skipped(self: Any) -> bool:
        ref = _STEPPED_BY.get(self) or _STEPPED_BY.get(getattr(self, "optimizer", None))
        mp = ref() if ref is not None else None
        if mp is None or mp.last_step is None:
            return accelerate_own.fget(self)
        return not mp.last_step

    step_was_skipped.mixprec = True  # type: ignore[attr-defined]
    step_was_skipped.__doc__ = f"{accelerate_own.__doc__} (mixprec: whether MixedPrecision's last step() applied none)"
    accelerated_optimizer.step_was_skipped = property(step_was_skipped)
