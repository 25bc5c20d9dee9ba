"""Progress on long work: a rich progress bar on a terminal, nothing in quiet mode."""

from __future__ import annotations

from typing import Any

__all__ = ["ProgressBar"]


class ProgressBar:
    """``update(step, loss=..., scale=...)`` moves the bar and shows the latest values next to it."""

    def __init__(self, total: int, description: str, enabled: bool) -> None:
        self._progress = None
        if not enabled:
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
        self._task = self._progress.add_task(description, total=total, values="")
        self._progress.start()

    def update(self, completed: int, **values: Any) -> None:
        if self._progress is None:
            return
        shown = "  ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in values.items())
        self._progress.update(self._task, completed=completed, values=shown)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
