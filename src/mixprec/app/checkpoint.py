"""The checkpoints of a run: one per saved step, in the run's ``checkpoints/`` folder, newest last.

A checkpoint is either a file, ``step-00001200.safetensors`` (:mod:`mixprec.persist.state_file`:
the whole training state, checksummed, written atomically), or, for FSDP2 runs, a folder,
``step-00001200.sharded/`` (:mod:`mixprec.app.sharded_checkpoint`: every rank writes its own shards).
A folder is written under a hidden staging name and renamed once every rank's part and the state
file are complete, so a checkpoint's name only ever shows a complete checkpoint.

After each save all but the newest ``keep`` are deleted, with anything a killed writer left (one
process writes a run's checkpoints: :mod:`mixprec.app.run_lock`). A full disk (ENOSPC; for a sharded
checkpoint, on any rank) deletes every checkpoint but the newest and tries once more: the run keeps
going with one fallback rather than stopping with several; if it still fails, the error names the
checkpoint and the intact one to resume from, on every rank.

Reading verifies everything: a damaged, edited or misnamed checkpoint raises ``CheckpointError``
naming it and what is wrong, whatever the damage, and ``load_latest`` falls back to the previous one
(or, when none verifies, says why for each).
"""

from __future__ import annotations

import errno
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from mixprec.app.sharded_checkpoint import read_sharded, write_sharded
from mixprec.distributed import agree_max, barrier, world
from mixprec.persist import CheckpointError, encode_checkpoint, fsync_directory, read_checkpoint_file, write_atomically

__all__ = [
    "CheckpointError",
    "list_checkpoints",
    "load_checkpoint",
    "load_latest",
    "newest_step",
    "save_checkpoint",
    "save_sharded_checkpoint",
    "set_aside",
]

logger = logging.getLogger("mixprec")

_NAME = re.compile(r"step-(\d{8})\.safetensors")  # a file
_SHARDED = re.compile(r"step-(\d{8})\.sharded")  # a folder
_STAGING = re.compile(r"\.step-\d{8}\.(safetensors\.tmp-\d+|sharded\.tmp|sharded\.old)")  # what a killed writer leaves


def save_checkpoint(directory: str | Path, step: int, state: dict[str, Any], keep: int = 3) -> Path:
    """Write ``state`` as the checkpoint file of ``step`` in ``directory``; keep the newest ``keep``."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    data = encode_checkpoint(step, state)
    final = directory / f"step-{step:08d}.safetensors"
    try:
        write_atomically(final, data)
    except OSError as exc:
        older = _up_to(directory, step)[:-1]
        if exc.errno != errno.ENOSPC or not older:
            raise _write_error(final, exc) from None
        # the disk is full: make room by deleting all but the newest checkpoint, never fewer than one
        for old in older:
            _remove(old)
        logger.warning("Disk full writing %s: deleted %d older checkpoints to make room", final.name, len(older))
        try:
            write_atomically(final, data)
        except OSError as again:
            raise _write_error(final, again) from None
    _prune(directory, keep, step)
    return final


def save_sharded_checkpoint(
    directory: str | Path, step: int, state: dict[str, Any], keep: int = 3, device: torch.device | str = "cpu"
) -> Path:
    """Write the sharded checkpoint of ``step`` in ``directory`` (each rank its own DTensors' shards;
    see :mod:`mixprec.app.sharded_checkpoint`); keep the newest ``keep``. A collective: every rank calls
    it with its own ``state``, and it returns on every rank once the checkpoint is complete, or raises
    on every rank when any rank's part failed. A full disk on any rank is handled as for a single file:
    rank 0 deletes every checkpoint but the newest and all ranks write once more. ``device``: the
    process group's (a CUDA device under NCCL), for the ranks' agreement on the outcome."""
    directory = Path(directory)
    final = directory / f"step-{step:08d}.sharded"
    error, failed, full, older = _write_sharded_once(directory, final, step, state, device)
    if failed and full and older:
        if world().is_main:
            older_checkpoints = _up_to(directory, step)[:-1]
            for old in older_checkpoints:
                _remove(old)
            logger.warning("Disk full writing %s: deleted %d older checkpoints", final.name, len(older_checkpoints))
        error, failed, _, _ = _write_sharded_once(directory, final, step, state, device)
    if failed:
        if world().is_main:
            _remove(_staging(final))  # its parts: room on a full disk
        if error is not None and not isinstance(error, OSError):
            raise error
        raise _write_error(final, error or OSError(errno.EIO, "another rank could not write its part")) from None
    if world().is_main:
        _prune(directory, keep, step)
    return final


def _write_sharded_once(
    directory: Path, final: Path, step: int, state: dict[str, Any], device: torch.device | str
) -> tuple[Exception | None, bool, bool, bool]:
    """One attempt: (this rank's error, whether any rank failed, whether any rank found its disk full,
    whether rank 0 sees an older checkpoint to delete). Its all-reduce is also the barrier that keeps
    every rank (which could otherwise exit, ending the job) until the checkpoint is complete."""
    staging = _staging(final)
    main = world().is_main
    if main:
        directory.mkdir(parents=True, exist_ok=True)
        _remove(staging)  # a killed writer's, of this same step, or this save's failed attempt
        staging.mkdir()
    barrier()  # the staging folder exists, empty, before any rank writes into it
    error: Exception | None = None
    try:
        write_sharded(staging, step, state)
        if main:
            _publish(staging, final)
    except Exception as exc:  # said after the agreement, so that no rank is left waiting for it
        error = exc
    full = isinstance(error, OSError) and error.errno == errno.ENOSPC
    older = main and len(list_checkpoints(directory)) > 1
    flags = [torch.tensor(float(flag), device=device) for flag in (error is not None, full, older)]
    failed, full, older = (bool(flag) for flag in agree_max(flags))  # host sync: once per checkpoint
    return error, failed, full, older


def _staging(final: Path) -> Path:
    """Where a sharded checkpoint is written before it is complete (never taken for a checkpoint)."""
    return final.with_name(f".{final.name}.tmp")


def _publish(staging: Path, final: Path) -> None:
    """Rename the complete ``staging`` folder to ``final`` (replacing an older save of that step)."""
    if final.exists():
        replaced = final.with_name(f".{final.name}.old")
        _remove(replaced)
        os.replace(final, replaced)
        os.replace(staging, final)
        _remove(replaced)
    else:
        os.replace(staging, final)
    fsync_directory(final.parent)


def _up_to(directory: Path, step: int) -> list[Path]:
    """The checkpoints of ``directory`` up to ``step`` (the one being saved), oldest first. One named past it is
    not this run's line (a damaged one a resume went back from, normally set aside by then): never counted as
    the newest, so never the reason to delete one that loads."""
    return [path for path in list_checkpoints(directory) if (_step(path) or 0) <= step]


def _prune(directory: Path, keep: int, step: int) -> None:
    """Delete all but the newest ``keep`` checkpoints up to ``step``, and whatever a killed writer left."""
    for old in _up_to(directory, step)[:-keep] if keep > 0 else []:
        _remove(old)
    for stale in directory.iterdir():  # ours is renamed by now: a killed writer's
        if _STAGING.fullmatch(stale.name):
            _remove(stale)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _write_error(final: Path, error: OSError) -> OSError:
    """The failed write, with which checkpoint it was and what is still there to resume from."""
    previous = [p for p in list_checkpoints(final.parent) if p != final]
    intact = (
        f"the newest checkpoint, {previous[-1].name}, is intact: resume from it with --resume"
        if previous
        else "there is no earlier checkpoint"
    )
    return OSError(error.errno, f"could not write checkpoint {final} ({error.strerror or error}); {intact}")


def _step(path: Path) -> int | None:
    """The step a checkpoint's name says, for a file or a folder of the right kind; else None."""
    named = _NAME.fullmatch(path.name) if path.is_file() else _SHARDED.fullmatch(path.name) if path.is_dir() else None
    return int(named.group(1)) if named else None


def list_checkpoints(directory: str | Path) -> list[Path]:
    """Checkpoints in ``directory`` (files and sharded folders), oldest first; staging names are not
    checkpoints, nor is a folder named like a checkpoint file (never loaded, never pruned)."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = [(step, path) for path in directory.iterdir() if (step := _step(path)) is not None]
    return [path for _, path in sorted(found)]


def newest_step(directory: str | Path, verify_past: int | None = None) -> int | None:
    """The step the newest checkpoint's name says (None without one); read from names, no file opened.

    ``verify_past``: a checkpoint named past that step counts only if it verifies (read and checksummed, only
    then): a damaged one that a resume would skip for an older one is not where the run is."""
    for path in reversed(list_checkpoints(directory)):
        step = _step(path)
        if verify_past is None or step is None or step <= verify_past:
            return step
        try:
            load_checkpoint(path)
        except CheckpointError:
            continue
        return step
    return None


def set_aside(path: Path) -> Path:
    """Rename a checkpoint a resume skipped (damaged, or not this model's) out of the run's line, kept for a look:
    ``step-00000300.safetensors.skipped``. Left in place it would count as the newest checkpoint, and pruning
    would delete the ones that load in its favour."""
    aside = path.with_name(f"{path.name}.skipped")
    _remove(aside)
    os.replace(path, aside)
    fsync_directory(path.parent)
    return aside


def load_checkpoint(path: str | Path, share: tuple[int, int] = (0, 1)) -> dict[str, Any]:
    """Read and verify one checkpoint (file or sharded folder); raises CheckpointError naming it and
    the problem. A sharded checkpoint's tensors stay in its files (``state["shards"]``); ``share``: the
    part of its shard files this rank verifies (see :func:`~mixprec.app.sharded_checkpoint.read_sharded`)."""
    path = Path(path)
    if path.is_dir() and (sharded := _SHARDED.fullmatch(path.name)):
        return read_sharded(path, int(sharded.group(1)), share)
    named = _NAME.fullmatch(path.name)
    return read_checkpoint_file(path, int(named.group(1)) if named else None)


def load_latest(directory: str | Path) -> tuple[Path, dict[str, Any]] | None:
    """The newest checkpoint that verifies, skipping damaged ones (reported when an older one is used).

    Returns None when there is no checkpoint file at all.

    Raises:
        CheckpointError: there are checkpoint files, and every one is damaged; the message lists why.
    """
    problems = []
    for path in reversed(list_checkpoints(directory)):
        try:
            found = path, load_checkpoint(path)
        except CheckpointError as exc:
            problems.append(str(exc))
            continue
        for problem in problems:
            logger.warning("Skipped a damaged checkpoint: %s; using %s", problem, path.name)
        return found
    if problems:
        raise CheckpointError(f"no usable checkpoint in {directory}: " + "; ".join(problems))
    return None
