"""GatedScheduler: an LR scheduler that does not advance after a skipped update (inf/NaN gradients).

A framework steps its learning-rate scheduler after every optimizer step; the adapters in this package
wrap such a scheduler so that the call is passed on only when :meth:`mixprec.MixedPrecision.step` applied
that update. The schedule then counts applied updates, as ``mp.step_scheduler(scheduler)`` does in a loop
of one's own. Framework-free: Lightning's and the Hugging Face Trainer's adapters both use it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["GatedScheduler"]


class GatedScheduler:
    """An LR scheduler that does not advance after a skipped update; everything else is the scheduler's.

    The framework calls ``step()`` after each optimizer step; the gate passes the call on only when
    ``applied()`` says the adapter's last update was applied. ``scheduler`` is the wrapped one (a
    LightningModule's ``self.lr_schedulers()`` and the Hugging Face Trainer's ``trainer.lr_scheduler`` return
    the gate); ``state_dict()`` is the scheduler's own, so checkpoints do not change.
    """

    def __init__(self, scheduler: Any, applied: Callable[[], bool]) -> None:
        self.scheduler = scheduler
        self._applied = applied

    def step(self, *args: Any, **kwargs: Any) -> None:
        if self._applied():
            self.scheduler.step(*args, **kwargs)

    def state_dict(self) -> dict[str, Any]:
        return self.scheduler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state)

    def __getattr__(self, name: str) -> Any:
        if name == "scheduler":  # not set yet (unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.scheduler, name)

    def __repr__(self) -> str:
        return f"GatedScheduler({self.scheduler!r})"
