"""Graceful stops: the signals that end a run after the current update, with a checkpoint.

Ctrl-C (SIGINT), SIGTERM (what Slurm preemption and time limits, Kubernetes, ``docker stop`` and
systemd send first) and SIGUSR1 (Slurm's usual pre-timeout signal, ``#SBATCH --signal=USR1@120``) by
default. The first one asks the loop to stop after the current update; the run's lifecycle
(:mod:`mixprec.app.lifecycle`) then saves a checkpoint and raises
:class:`~mixprec.app.lifecycle.TrainingInterrupted` naming the signal. A second one stops at once (the
checkpoint then holds the last completed update), except inside a shielded section
(:meth:`StopRequest.shield`: an update being applied, a checkpoint being written), which it lets finish
first: cut short there, the weights would be one update ahead of the saved position, or the checkpoint
lost. Once the run is saving its last checkpoint (:attr:`StopRequest.saving_last_checkpoint`), further
signals are logged and change nothing.

This module is the mechanics (handlers, shields, the cross-rank agreement); it loads no torch, so that
the options can check signal names for ``mixprec --help``. The Trainer talks to
:class:`~mixprec.app.lifecycle.RunLifecycle`, which holds one :class:`StopRequest` per fit.

Under torchrun each rank receives its signal at its own moment; :meth:`StopRequest.agree` makes every
rank stop after the same update (the signal's number is all-reduced with max, so a rank that received
nothing learns which signal stopped the run).
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

from mixprec.checks import shown

if TYPE_CHECKING:
    import torch

__all__ = ["DEFAULT_STOP_SIGNALS", "STOPPABLE", "StopRequest", "check_stop_signals", "held"]

logger = logging.getLogger("mixprec")

DEFAULT_STOP_SIGNALS = ("SIGINT", "SIGTERM", "SIGUSR1")
# The signals a run may stop on: those that ask a process to end, or that schedulers send for it (SIGXCPU: a CPU
# time limit; SIGUSR1/2, SIGHUP: Slurm, nohup). Every other is refused: SIGKILL and SIGSTOP cannot be caught;
# a Python handler for a fault (SIGSEGV, SIGBUS, SIGFPE, SIGILL) returns into the faulting instruction, which
# faults again, forever, deaf to SIGTERM; and the rest arrive in the normal course of a run (SIGCHLD from data
# workers, SIGPIPE from a closed pipe, SIGWINCH from a resized terminal, SIGCONT, SIGPROF from a profiler).
STOPPABLE = ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2", "SIGXCPU", "SIGALRM")


def check_stop_signals(names: Sequence[str], what: str) -> tuple[str, ...]:
    """The signal names as a tuple; ValueError naming ``what`` for an unknown or uncatchable one."""
    if isinstance(names, str) or not all(isinstance(name, str) for name in names):
        raise TypeError(f"{what} needs a sequence of signal names such as ('SIGTERM',); received {names!r}.")
    for name in names:
        if name not in STOPPABLE or not isinstance(getattr(signal, name, None), signal.Signals):
            raise ValueError(
                f"{what}: {shown(name)} is not a signal a run can stop on (a fault, job-control or child signal "
                f"cannot be served, or arrives in the normal course of a run); use some of {', '.join(STOPPABLE)}."
            )
    return tuple(dict.fromkeys(names))  # a name given twice, once


class StopRequest:
    """Which stop signal arrived (if any): set by the handlers, read by the training loop."""

    def __init__(self, names: Sequence[str]) -> None:
        self.names = tuple(names)
        self.signal: str | None = None  # the first stop signal received
        self._shielded = 0  # how many shielded sections are open
        self._again = False  # a second signal arrived inside one: stop at once when it ends
        self.cut_mid_update = False  # an exception (a Ctrl-C outside the stop signals) left an update half done
        # every update is done: the final checkpoint and evaluation are under way, and a signal lets them finish
        self.last_update_done = False
        # the last checkpoint is being saved: nothing is left to cut short, later signals are logged and stop nothing
        self.saving_last_checkpoint = False

    @property
    def requested(self) -> bool:
        return self.signal is not None

    def agree(self, device: torch.device, checkpoint_due: bool) -> bool:
        """Make every rank see the same stop request and checkpoint decision (one all-reduce per update,
        a host sync); returns whether a checkpoint is due on any rank."""
        import torch  # here: the config checks signal names without loading torch (`mixprec --help`)

        from mixprec.distributed import agree_max

        number = signal.Signals[self.signal].value if self.signal else 0
        flags = [torch.tensor([float(value)], device=device) for value in (number, checkpoint_due)]
        number, due = (int(flag.item()) for flag in agree_max(flags))
        if number and self.signal is None:
            self.signal = signal.Signals(number).name
        return bool(due)

    @contextlib.contextmanager
    def shield(self, update: bool = False) -> Iterator[None]:
        """A section a second stop signal lets finish (an update applied and committed, a checkpoint written);
        it stops the run at once when the section ends (KeyboardInterrupt, as outside one). ``update``: the
        section changes the weights; an exception out of it (a Ctrl-C that is not a stop signal) leaves them
        half updated, which :attr:`cut_mid_update` says, so that no checkpoint is made from them."""
        self._shielded += 1
        try:
            yield
        except BaseException:
            self.cut_mid_update = self.cut_mid_update or update
            raise
        finally:
            self._shielded -= 1
        if not self._shielded and self._again:
            self._again = False
            raise KeyboardInterrupt

    def handlers(self) -> contextlib.AbstractContextManager:
        """Install the handlers for the duration of a fit (main thread only: elsewhere signals stay as they are)."""

        def handler(signum: int, frame: object) -> None:
            if self.signal is not None:  # a second stop signal: stop at once, or where the section ends
                if self.saving_last_checkpoint or self._shielded:
                    self._again = not self.saving_last_checkpoint
                    logger.warning("%s received again: %s", signal.Signals(signum).name, "already saving the last "
                                   "checkpoint" if self.saving_last_checkpoint else "stopping once this update or "
                                   "checkpoint is complete")  # fmt: skip
                    return
                raise KeyboardInterrupt
            self.signal = signal.Signals(signum).name
            if self.last_update_done:
                logger.warning("%s received: the run's last update is done; it ends after its final checkpoint "
                               "and evaluation", self.signal)  # fmt: skip
                return
            logger.warning("%s received: stopping after the current step, then saving a checkpoint; send it "
                           "again to stop at once", self.signal)  # fmt: skip

        return _installed(self.names, handler)


def held(names: Sequence[str], what: str) -> contextlib.AbstractContextManager:
    """The stop signals logged and ignored while inside (main thread only): the run has ended, its checkpoint is
    written, and ``what`` (its report, its last line) finishes first instead of a default handler killing the
    process silently or changing its exit status."""

    def handler(signum: int, frame: object) -> None:
        logger.warning("%s received while %s: the run has ended; finishing that first", signal.Signals(signum).name,
                       what)  # fmt: skip

    return _installed(names, handler)


@contextlib.contextmanager
def _installed(names: Sequence[str], handler: Callable[[int, object], None]) -> Iterator[None]:
    """``handler`` for the signals ``names`` while inside, the previous ones restored after (main thread only:
    Python installs handlers there alone, so elsewhere signals stay as they are)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {name: signal.signal(getattr(signal, name), handler) for name in names}
    try:
        yield
    finally:
        for name, old in previous.items():
            signal.signal(getattr(signal, name), old)
