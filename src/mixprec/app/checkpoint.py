"""Checkpoints: one safetensors file each, written atomically, verified when read, never unpickled.

Layout of ``step-00001200.safetensors``: the tensors of the nested training state (see
:mod:`mixprec.app.serialize`), and in the header's metadata the JSON skeleton that puts them back
together (every number, string and flag of the state: position, counters, RNG, scaler, policy), the
step, and a SHA-256 over every metadata field and every tensor's bytes: no byte that resuming depends
on can change unnoticed.

Writing: serialize in memory, write to a hidden temporary file in the same folder, fsync it, rename
it over the final name (atomic on POSIX), fsync the folder; then delete all but the newest ``keep``,
and any temporary file a killed writer left (one process writes a run's checkpoints). A full disk
(ENOSPC) deletes every checkpoint but the newest and tries once more: the run keeps going with one
fallback rather than stopping with several; if it still fails, the error names the checkpoint and the
intact one to resume from.
A process killed at any moment leaves either the previous set of checkpoints or the new one, never a
half-written file under a checkpoint's name.

Reading: the header must parse, the checksum must match, the step must equal the file's name and the
skeleton must rebuild; otherwise a ``CheckpointError`` names the file and what is wrong, whatever the
damage (any shape, depth or type), and ``load_latest`` falls back to the previous checkpoint (or,
when none verifies, says why for each).
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import re
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save as safetensors_bytes

from mixprec.app.serialize import flatten, unflatten

__all__ = ["CheckpointError", "list_checkpoints", "load_checkpoint", "load_latest", "save_checkpoint"]

logger = logging.getLogger("mixprec")

FORMAT = "mixprec-checkpoint"
VERSION = "2"  # 1: the checksum covered the tensors only
_NAME = re.compile(r"step-(\d{8})\.safetensors")


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: missing, truncated, corrupt, or not a mixprec checkpoint."""


def _digest(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> str:
    """SHA-256 of every metadata field but the digest itself, then every tensor's name, type and bytes."""
    sha = hashlib.sha256()
    for key in sorted(k for k in metadata if k != "sha256"):
        sha.update(f"{len(key)}:{key}={len(metadata[key])}:{metadata[key]};".encode())
    for name in sorted(tensors):
        tensor = tensors[name].contiguous()
        sha.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)};".encode())
        sha.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return sha.hexdigest()


def save_checkpoint(directory: str | Path, step: int, state: dict[str, Any], keep: int = 3) -> Path:
    """Write ``state`` as the checkpoint of ``step`` in ``directory``; keep the newest ``keep``."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors, skeleton = flatten(state)
    cpu = {name: tensor.cpu() for name, tensor in tensors.items()}
    metadata = {"format": FORMAT, "version": VERSION, "step": str(step), "skeleton": json.dumps(skeleton)}
    metadata["sha256"] = _digest(cpu, metadata)
    data = safetensors_bytes(cpu, metadata=metadata)
    final = directory / f"step-{step:08d}.safetensors"
    try:
        _write_atomically(final, data)
    except OSError as exc:
        older = list_checkpoints(directory)[:-1]
        if exc.errno != errno.ENOSPC or not older:
            raise _write_error(final, exc) from None
        # the disk is full: make room by deleting all but the newest checkpoint, never fewer than one
        for old in older:
            old.unlink(missing_ok=True)
        logger.warning("Disk full writing %s: deleted %d older checkpoints to make room", final.name, len(older))
        try:
            _write_atomically(final, data)
        except OSError as again:
            raise _write_error(final, again) from None
    for old in list_checkpoints(directory)[:-keep] if keep > 0 else []:
        old.unlink(missing_ok=True)
    for stale in directory.glob(".step-*.safetensors.tmp-*"):  # ours is renamed by now: a killed writer's
        stale.unlink(missing_ok=True)
    return final


def _write_atomically(final: Path, data: bytes) -> None:
    """Write to a hidden temporary file, fsync it, rename it over ``final``, fsync the folder."""
    temporary = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    try:
        with open(temporary, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, final)
    finally:
        temporary.unlink(missing_ok=True)
    _fsync_directory(final.parent)


def _write_error(final: Path, error: OSError) -> OSError:
    """The failed write, with which checkpoint it was and what is still there to resume from."""
    previous = [p for p in list_checkpoints(final.parent) if p != final]
    intact = (
        f"the newest checkpoint, {previous[-1].name}, is intact: resume from it with --resume"
        if previous
        else "there is no earlier checkpoint"
    )
    return OSError(error.errno, f"could not write checkpoint {final} ({error.strerror or error}); {intact}")


def _fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def list_checkpoints(directory: str | Path) -> list[Path]:
    """Checkpoint files in ``directory``, oldest first (temporary files are not checkpoints)."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    # a folder (or anything but a file) named like a checkpoint is not one: never loaded, never pruned
    return sorted(p for p in directory.iterdir() if _NAME.fullmatch(p.name) and p.is_file())


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """Read and verify one checkpoint; raises CheckpointError naming the file and the problem."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: no such checkpoint file")
    try:
        with safe_open(str(path), framework="pt") as reader:
            metadata = reader.metadata() or {}
            tensors = {name: reader.get_tensor(name) for name in reader.keys()}  # noqa: SIM118 (not a dict)
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise CheckpointError(f"{path}: not a readable checkpoint (truncated or corrupt: {exc})") from None
    if metadata.get("format") != FORMAT:
        raise CheckpointError(f"{path}: a safetensors file, but not a mixprec checkpoint (no '{FORMAT}' header)")
    if metadata.get("version") != VERSION:
        raise CheckpointError(
            f"{path}: checkpoint format version {metadata.get('version')!r}, expected {VERSION!r} (version 1, "
            "written before the checksum covered the metadata, is not read)"
        )
    if _digest(tensors, metadata) != metadata.get("sha256"):
        raise CheckpointError(f"{path}: checksum mismatch; the file was changed or damaged after saving")
    named = _NAME.fullmatch(path.name)
    if named and metadata.get("step") != str(int(named.group(1))):
        raise CheckpointError(f"{path}: holds step {metadata.get('step')!r}, not the step its name says")
    try:
        state = unflatten(json.loads(metadata["skeleton"]), tensors)
    except RecursionError:
        raise CheckpointError(f"{path}: damaged checkpoint structure (nested too deeply)") from None
    except (KeyError, json.JSONDecodeError, ValueError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"{path}: damaged checkpoint structure ({type(exc).__name__}: {exc})") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{path}: damaged checkpoint structure (a {type(state).__name__}, not a state dict)")
    return state


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
