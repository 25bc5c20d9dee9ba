"""Progress on long work: a rich progress bar on a terminal, a plain line every few seconds elsewhere
(a log file, CI, ``| tee``), nothing in quiet mode."""

from __future__ import annotations

import sys
import time
from typing import Any

__all__ = ["ProgressBar"]

LINE_EVERY_S = 5.0  # without a terminal: one line per this many seconds, and one at the end


class ProgressBar:
    """``update(step, loss=..., scale=...)`` moves the bar and shows the latest values next to it. ``start``: the
    count already done when the bar starts (a resumed run's updates), which this process's speed leaves out."""

    def __init__(self, total: int, description: str, enabled: bool, start: int = 0) -> None:
        self._progress = None
        self._lines = False
        if not enabled:
            return
        self._total, self._description, self._first = total, description, start
        if not sys.stdout.isatty():
            self._lines, self._start, self._last_line, self._shown = True, time.monotonic(), 0.0, ""
            self._completed = start
            return
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self._progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("eta"),
            TimeRemainingColumn(),
            TextColumn("{task.fields[values]}"),
            transient=False,
        )
        self._task = self._progress.add_task(description, total=total, completed=start, values="")
        self._progress.start()

    def update(self, completed: int, **values: Any) -> None:
        shown = "  ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in values.items())
        if self._lines:
            self._completed, self._shown = completed, shown or self._shown
            if time.monotonic() - self._last_line >= LINE_EVERY_S:
                self._print_line()
            return
        if self._progress is None:
            return
        self._progress.update(self._task, completed=completed, values=shown)

    def _print_line(self) -> None:
        now = time.monotonic()
        elapsed = now - self._start
        done = self._completed / self._total if self._total else 1.0
        here = self._completed - self._first  # done by this process: a resumed run's speed is its own
        eta = f", eta {elapsed * (self._total - self._completed) / here:.0f} s" if here > 0 and done < 1 else ""
        print(
            f"{self._description} {self._completed}/{self._total} ({100 * done:.0f}%) {elapsed:.0f} s{eta}"
            + (f"  {self._shown}" if self._shown else ""),
            flush=True,
        )
        self._last_line = now

    def close(self) -> None:
        if self._lines:
            self._print_line()
            self._lines = False
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
