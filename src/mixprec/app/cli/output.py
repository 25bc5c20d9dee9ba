"""The command's output is never the run: a stdout or stderr that can no longer be written stops nothing.

``mixprec train ... | head -1`` closes the pipe after one line; every later write then raises
``BrokenPipeError`` (Python ignores SIGPIPE), and the first one used to come from the progress bar, before the
end-of-run checkpoint: the run was lost. The same for a stdout closed by the shell (``>&-``: ``sys.stdout`` is
None) or on a full device (``> /dev/full``: ``OSError`` ENOSPC at the flush). :func:`surviving_output` wraps
both streams so that such a write is dropped instead: from then on that stream goes to ``os.devnull`` (its
descriptor too, so that the interpreter's own flush at exit fails neither), and the run, its checkpoint, its
report and its exit status are what they would have been.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
from collections.abc import Iterator
from typing import TextIO

__all__ = ["SurvivingStream", "surviving_output"]


class SurvivingStream(io.TextIOBase):
    """A text stream whose writes and flushes never raise ``OSError``: after the first failure it is ``lost``
    and drops everything."""

    def __init__(self, stream: TextIO | None) -> None:
        super().__init__()
        self._stream = stream
        self.lost = stream is None  # a descriptor the shell closed: nothing to write to from the start

    def write(self, text: str) -> int:
        if not self.lost:
            try:
                return self._stream.write(text)
            except OSError:
                self._lose()
        return len(text)

    def flush(self) -> None:
        if not self.lost:
            try:
                self._stream.flush()
            except OSError:
                self._lose()

    def isatty(self) -> bool:
        if self.lost:
            return False
        try:
            return self._stream.isatty()
        except (OSError, ValueError):
            return False

    def writable(self) -> bool:
        return True

    @property
    def encoding(self) -> str:  # rich and logging read it
        return getattr(self._stream, "encoding", None) or "utf-8"

    def _lose(self) -> None:
        """Drop this stream's output from now on; its descriptor goes to os.devnull, so that what its buffer
        still holds flushes there (at exit too) instead of failing again."""
        self.lost = True
        with contextlib.suppress(OSError, ValueError, AttributeError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self._stream.fileno())
            os.close(devnull)


@contextlib.contextmanager
def surviving_output() -> Iterator[None]:
    """``sys.stdout`` and ``sys.stderr`` as :class:`SurvivingStream` while inside; the originals restored after."""
    saved = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = SurvivingStream(sys.stdout), SurvivingStream(sys.stderr)
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        sys.stdout, sys.stderr = saved
