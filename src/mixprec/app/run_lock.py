"""One run per folder: an OS lock on the run folder itself, held while a run writes there.

Two runs started into the same ``--out`` at the same moment would otherwise both write: one's
config.json, the other's checkpoints, both runs' rows in metrics.jsonl. The lock is ``flock``
(exclusive, non-blocking) on the folder's own descriptor, so no lock file is left in the folder; the
kernel releases it when the process ends however it ends (a kill, a crash): a stale lock cannot block
a later run. Under torchrun rank 0 holds it for the whole group. POSIX only (fcntl).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

__all__ = ["RunFolderBusy", "run_lock"]


class RunFolderBusy(ValueError):
    """Another process holds the run folder's lock."""


@contextlib.contextmanager
def run_lock(run_dir: Path) -> Iterator[None]:
    """Hold ``run_dir``'s lock (the folder must exist); RunFolderBusy if another process holds it."""
    if int(os.environ.get("RANK", "0")) != 0:  # torchrun: rank 0 holds it for every rank
        yield
        return
    descriptor = os.open(run_dir, os.O_RDONLY)
    try:
        try:
            fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RunFolderBusy(
                f"{run_dir} is in use by another mixprec run; wait for it to end, or choose another --out."
            ) from None
        yield
    finally:
        os.close(descriptor)  # releases the lock
