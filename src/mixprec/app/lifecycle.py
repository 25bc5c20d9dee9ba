"""A run's lifecycle: when it stops, what a stop saves, when a checkpoint is due, the same on every rank.

The Trainer talks to one :class:`RunLifecycle`: around a fit, and at three points of each update::

    with lifecycle.running(total, bar):             # stop signals caught; a stop ends fit() with a checkpoint
        while updates_done < total and not (lifecycle.stop_requested and mp.micro_step == 0):
            for inputs, targets in batches:
                ...                                 # forward under mp.autocast(), backward, clip
                with lifecycle.update():            # a second stop signal waits: weights, schedule and
                    result = mp.step()              # position move together; a new update is committed
                    ...; updates_done += 1
                due = lifecycle.after_update()      # a checkpoint by the clock or the count, agreed across ranks
                ...                                 # log, evaluate, save if due; break on lifecycle.stop_requested
        lifecycle.updates_ended()                   # a stop before the last update ends fit() here
        ...                                         # the final checkpoint and evaluation

Besides: :meth:`RunLifecycle.check_start` before a fit, :meth:`RunLifecycle.epoch_ended` when an epoch
ends, :meth:`RunLifecycle.saving` around each checkpoint written.

What each kind of stop leaves:

- a stop signal (Ctrl-C, SIGTERM, SIGUSR1: ``RunOptions.stop_signals``) ends the run after the current update,
  with a checkpoint of it; past the last update it lets the run end whole;
- a second one stops at once, with a checkpoint of the last committed update: the position, random state
  and model buffers (batch-norm statistics) remembered after each update are put back first, and the
  unfinished accumulation window dropped (FSDP2 ranks cannot save together then: the last periodic
  checkpoint stands). Inside a shielded section (an update being applied, a checkpoint being written) it
  waits for the section to end;
- a Ctrl-C outside the stop signals that cuts an update short (its weights half updated) saves nothing;
  the newest checkpoint stands, and the Trainer goes on only with ``fit(..., resume=True)``.

The signal mechanics (handlers, shields, the cross-rank agreement) are
:class:`~mixprec.app.stop_signals.StopRequest`'s; this class holds one per fit.

Host syncs: under torchrun, one all-reduce per update (the stop request and the clock's checkpoint
decision, agreed); none in one process.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from mixprec.app.checkpoint import list_checkpoints
from mixprec.app.rng_state import get_rng_state, set_rng_state
from mixprec.app.stop_signals import StopRequest

if TYPE_CHECKING:
    from mixprec.app.metrics_log import MetricsLog
    from mixprec.app.progress import ProgressBar
    from mixprec.app.trainer_options import RunOptions
    from mixprec.distributed import World
    from mixprec.engine import MixedPrecision

__all__ = ["Loop", "RunLifecycle", "TrainingInterrupted"]

logger = logging.getLogger("mixprec")


class TrainingInterrupted(Exception):
    """A stop signal during fit() (Ctrl-C, SIGTERM, SIGUSR1): a checkpoint was saved (when the run has a
    folder); ``checkpoint`` is its path, ``signal`` the signal's name."""

    def __init__(self, step: int, checkpoint: Path | None, signal: str = "SIGINT", cut_short: bool = False) -> None:
        by = "" if signal == "SIGINT" else f" by {signal}"
        if cut_short:  # in the middle of update step + 1: nothing saved from it
            saved = f" in the middle of an update; the newest checkpoint stands: {checkpoint}" if checkpoint else (
                " in the middle of an update; no checkpoint was made")  # fmt: skip
        else:
            saved = f"; checkpoint saved to {checkpoint}" if checkpoint else ""
        super().__init__(f"interrupted{by} at step {step}{saved}")
        self.step = step
        self.checkpoint = checkpoint
        self.signal = signal
        self.cut_short = cut_short  # True: update step + 1 was cut short, and ``checkpoint`` is an older one


class Loop(Protocol):
    """What the lifecycle reads and moves of the loop it runs (a :class:`~mixprec.app.trainer.Trainer`): its
    position, its log, and a checkpoint of it."""

    updates_done: int
    epoch: int
    batch_in_epoch: int
    log: MetricsLog

    @property
    def checkpoint_dir(self) -> Path | None: ...

    def save_checkpoint(self) -> Path | None: ...


class RunLifecycle:
    """The stop, commit and checkpoint-due state of a Trainer's runs (see the module docstring).

    Args:
        loop: the Trainer whose position is committed and put back, and whose checkpoints a stop saves.
        options: the stop signals and the checkpoint cadence (``checkpoint_every``, ``checkpoint_every_minutes``).
        mp: the engine (its model's buffers are committed with the position; its gradients dropped on a stop).
        world: the ranks that agree on each stop and checkpoint.
    """

    def __init__(self, loop: Loop, options: RunOptions, mp: MixedPrecision, world: World) -> None:
        self._loop, self._options, self._mp, self._world = loop, options, mp, world
        self._stop = StopRequest(options.stop_signals)  # set by a stop signal; a fresh one for each fit
        self._stop_agreed = False  # under torchrun: the stop request as the ranks last agreed on it
        self._saved_at = time.monotonic()  # for RunOptions(checkpoint_every_minutes=...)
        self._total = 0  # the update the running fit ends at
        self._bar: ProgressBar | None = None  # the running fit's progress bar, closed before a stop's checkpoint
        self._committed = (0, 0)  # (epoch, batch_in_epoch) after the last completed update: where a resume starts
        self._committed_rng: dict[str, Any] | None = None  # the random state there
        self._committed_buffers: list[torch.Tensor] = []  # and the model's buffers (e.g. batch-norm statistics)
        self._half_updated = False  # an update was cut short: the weights are neither before nor after it

    @property
    def stop_requested(self) -> bool:
        """A stop signal arrived: in one process, as soon as it did; under torchrun, as the ranks agreed after the
        last update. A signal that reaches one rank later (while it logs, evaluates or saves) counts at the next
        update's agreement: a rank that stopped on its own flag would leave the others waiting in that update's
        all-reduce, for ever."""
        return self._stop_agreed if self._world.distributed else self._stop.requested

    def check_start(self, resumed: bool) -> None:
        """Before a fit: a Trainer whose last update was cut short goes on only ``resumed`` from a checkpoint."""
        if resumed:
            self._half_updated = False
        elif self._half_updated:
            raise ValueError(
                "fit(): this Trainer's last update was cut short, so its weights are half updated; continue "
                "from the newest checkpoint with fit(..., resume=True), or build a new Trainer."
            )

    @contextlib.contextmanager
    def running(self, total: int, bar: ProgressBar) -> Iterator[None]:
        """Around a fit of ``total`` updates in all, from its first update to its final evaluation.

        On entry no gradients are left over and the position is committed; the stop signals are caught until
        the end. A KeyboardInterrupt inside (a second stop signal, or a Ctrl-C raised from inside a step) ends
        fit with :class:`TrainingInterrupted`, ``bar`` closed first.
        """
        self._mp.zero_grad()  # nothing of an interrupted fit's window is carried in
        self._commit()  # the state a stop at once in the first update goes back to (buffers, random state)
        self._stop, self._saved_at = StopRequest(self._options.stop_signals), time.monotonic()
        self._stop_agreed = False  # under torchrun: the stop request as the ranks last agreed on it
        self._total, self._bar = total, bar
        with self._stop.handlers():  # until fit ends: no stop signal ends it without a checkpoint
            try:
                yield
            except KeyboardInterrupt:  # a second stop signal, or a Ctrl-C raised from inside a step
                self._stop.saving_last_checkpoint = True  # a further signal now would end fit without a checkpoint
                bar.close()
                if self._stop.cut_mid_update:
                    raise self._cut_short(self._stop.signal or "SIGINT") from None
                self._restore_committed()
                raise self._stopped(self._stop.signal or "SIGINT", at_once=True) from None
            finally:
                bar.close()
                self._half_updated = self._half_updated or self._stop.cut_mid_update

    @contextlib.contextmanager
    def update(self) -> Iterator[None]:
        """Around one micro-batch's ``mp.step()``: a second stop signal lets it finish (the weights, the schedule
        and the position move together), and an update it made (``updates_done`` moved) is committed. An
        exception out of it leaves the weights half updated: no checkpoint is made from them."""
        before = self._loop.updates_done
        with self._stop.shield(update=True):
            yield
            if self._loop.updates_done != before:
                self._commit()
                # a signal from now on: the run still ends whole
                self._stop.last_update_done = self._loop.updates_done >= self._total

    def after_update(self) -> bool:
        """Whether a checkpoint is due after this update: every ``checkpoint_every`` updates, or once
        ``checkpoint_every_minutes`` of wall clock passed since the last save. Under torchrun the ranks agree
        on the clock's decision and on a stop request (one all-reduce, a host sync), so that they save and stop
        after the same update."""
        minutes = self._options.checkpoint_every_minutes
        due = minutes is not None and time.monotonic() - self._saved_at >= minutes * 60
        if self._world.distributed:
            due = self._stop.agree(self._mp.device, due)  # the same stop and checkpoint on every rank
            self._stop_agreed = self._stop.requested
        every = self._options.checkpoint_every
        return due or bool(every and self._loop.updates_done % every == 0)

    def epoch_ended(self, ended_at: int) -> None:
        """The loop moved on to a new epoch: a position committed on the batch the one before ended at (its last,
        or the last its windows read) is this epoch's start."""
        if self._committed[1] == ended_at:
            self._committed = (self._loop.epoch, 0)

    def updates_ended(self) -> None:
        """The updates are over, the progress bar closes: a stop asked for before the last one ends fit here, with
        a checkpoint; past the last one the run ends whole (a signal now lets the final checkpoint and
        evaluation finish)."""
        if self._bar is not None:
            self._bar.close()
        if self._stop.signal is not None and self._loop.updates_done < self._total:
            raise self._stopped(self._stop.signal)
        self._stop.last_update_done = True

    @contextlib.contextmanager
    def saving(self) -> Iterator[None]:
        """Around writing a checkpoint: the clock of ``checkpoint_every_minutes`` starts again, and a second stop
        signal lets the write (a collective, sharded) finish."""
        self._saved_at = time.monotonic()
        with self._stop.shield():
            yield

    def _stopped(self, signal: str, *, at_once: bool = False) -> TrainingInterrupted:
        """Save a checkpoint and close the log; the exception that ends fit() on a stop signal."""
        if at_once and self._mp.sharded and self._world.distributed:
            # a sharded checkpoint is a collective the other ranks may never join now: keep the last
            # periodic checkpoint rather than hang
            logger.warning("Stopped at once: the FSDP2 ranks cannot save together now; the last checkpoint stands")
            checkpoint = None
        else:
            self._stop.saving_last_checkpoint = True
            checkpoint = self._loop.save_checkpoint()
        self._loop.log.close()
        return TrainingInterrupted(self._loop.updates_done, checkpoint, signal)

    def _cut_short(self, signal: str) -> TrainingInterrupted:
        """A Ctrl-C outside the stop signals cut an update short: its weights are half updated, so no checkpoint is
        made from them; the newest one stands."""
        self._loop.log.close()
        directory = self._loop.checkpoint_dir
        newest = next(reversed(list_checkpoints(directory)), None) if directory else None
        logger.warning("Stopped in the middle of an update: no checkpoint made from its half-updated weights; "
                       "the newest one stands (%s)", newest)  # fmt: skip
        return TrainingInterrupted(self._loop.updates_done, newest, signal, cut_short=True)

    def _commit(self) -> None:
        """Remember where a resume would start: position, random state, buffers (after each update)."""
        self._committed, self._committed_rng = (self._loop.epoch, self._loop.batch_in_epoch), get_rng_state()
        buffers = [b for b in self._mp.model.buffers()]
        if len(self._committed_buffers) != len(buffers):
            self._committed_buffers = [b.detach().clone() for b in buffers]
        elif buffers:
            torch._foreach_copy_(self._committed_buffers, [b.detach() for b in buffers])

    def _restore_committed(self) -> None:
        """Undo an unfinished accumulation window, so that the checkpoint resumes exactly at the last update."""
        self._mp.zero_grad()
        self._loop.epoch, self._loop.batch_in_epoch = self._committed
        if self._committed_rng is not None:
            set_rng_state(self._committed_rng)
        with torch.no_grad():
            for buffer, saved in zip(self._mp.model.buffers(), self._committed_buffers, strict=False):
                buffer.copy_(saved)
