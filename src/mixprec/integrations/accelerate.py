"""Accelerate's ``accelerator.accumulate(model)``, seen from ``MixedPrecision.step()``: a guard on the engine's list.

Accelerate needs no adapter: ``Accelerator(mixed_precision="no")`` and a MixedPrecision beside it
(docs/integrations.md).

Around the micro-batches it does not sync, ``accumulate`` enters DDP's ``no_sync`` and sets Accelerate's
process-wide ``GradientState.sync_gradients`` to False. An update applied there would use this rank's own
gradients: the replicas drift apart, silently, and nothing accumulates. MixedPrecision counts the
micro-batches itself (``accumulation_steps``), so an update while Accelerate says "not synced" is refused.
Read only where Accelerate is already imported; a dict lookup, no device work. This module imports neither
Accelerate nor torch: ``import mixprec`` registers the guard with every MixedPrecision made after.
"""

from __future__ import annotations

import sys
from typing import Any

from mixprec.engine import register_guard

__all__ = ["AccumulateGuard", "unsynced_update_problem"]


class AccumulateGuard:
    """Refuses an update inside ``accelerator.accumulate()`` on a micro-batch Accelerate left unsynchronized."""

    def before_update(self, mp: Any) -> None:
        if mp.at_update_boundary and (problem := unsynced_update_problem()):
            raise RuntimeError(problem)


register_guard(AccumulateGuard)


def unsynced_update_problem() -> str | None:
    """Why an update now would apply unsynchronized gradients, or None (also where Accelerate is not in use)."""
    state = sys.modules.get("accelerate.state")
    shared = getattr(getattr(state, "GradientState", None), "_shared_state", None)
    try:
        synced = shared.get("sync_gradients", True) if shared is not None else True
    except (AttributeError, TypeError):  # another layout of Accelerate's state: nothing to read
        return None
    if synced is not False:
        return None
    return (
        "MixedPrecision.step() would apply an update inside accelerator.accumulate(), on a micro-batch whose "
        "gradients Accelerate left unsynchronized: each process would update with its own gradients (the replicas "
        "drift apart) and nothing would accumulate. Nothing was applied. Drop accelerator.accumulate() and pass "
        "the number of micro-batches to MixedPrecision(..., accumulation_steps=N), calling mp.step() after every "
        "mp.backward(): it updates once per N."
    )
