"""The checks that protect a training step, on one list, called at the step's four points.

    with mp.autocast():   guards.before_forward()     the model is still as the policy prepared it
        loss = ...
    mp.backward(loss):    guards.before_gradients()   nothing edited the gradients while they carried the scale
                          ... backward ...
                          guards.after_backward()     remember the gradients as backward left them
    mp.unscale_(), mp.clip_grad_norm_():  guards.before_gradients()
    mp.step():            guards.before_update()      before anything is unscaled, applied or skipped

A call refused for its order (``engine/call_order.py``) is refused before the guards run. A guard is an object
with any of these four methods (each takes the MixedPrecision); the list keeps, per point, only the guards that
define it, so a point nobody watches costs one empty loop. The engine's own guards
are made with each MixedPrecision (:mod:`~mixprec.engine.parameter_guard`, :mod:`~mixprec.engine.pending_grads`,
:mod:`~mixprec.engine.master_drift`); a framework's (``mixprec.integrations``) register a factory with
:func:`register_guard`, so the core never reads another framework's state itself. Guards add no host sync (the
master drift check reads one flag before the first update, and later only for a weight written since) and no
device work (the pending-gradient guard compares a replaced gradient with the one it replaced, the drift guard a
written weight with its master), and they raise before the step changes anything: a refused step leaves the
weights, masters, optimizer state and scale untouched.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

__all__ = ["GuardList", "register_guard", "registered_guards"]

POINTS = ("before_forward", "before_gradients", "after_backward", "before_update")

_FACTORIES: list[Callable[[], Any]] = []


def register_guard(factory: Callable[[], Any]) -> None:
    """Add a guard to every MixedPrecision made from now on: ``factory()`` returns the guard, or None where it
    has nothing to watch. Registering the same factory twice adds it once."""
    if factory not in _FACTORIES:
        _FACTORIES.append(factory)


def registered_guards() -> list[Any]:
    """A new guard from each registered factory (those that have something to watch)."""
    return [guard for guard in (factory() for factory in _FACTORIES) if guard is not None]


class GuardList:
    """Guards called in order at each point of the step."""

    def __init__(self, guards: Iterable[Any]) -> None:
        self.guards = tuple(guards)
        for point in POINTS:  # bound once: a point costs a loop over its own hooks, no lookups
            setattr(self, f"_{point}", [getattr(guard, point) for guard in self.guards if hasattr(guard, point)])

    def before_forward(self, mp: Any) -> None:
        for hook in self._before_forward:
            hook(mp)

    def before_gradients(self, mp: Any) -> None:
        for hook in self._before_gradients:
            hook(mp)

    def after_backward(self, mp: Any) -> None:
        for hook in self._after_backward:
            hook(mp)

    def before_update(self, mp: Any) -> None:
        for hook in self._before_update:
            hook(mp)
