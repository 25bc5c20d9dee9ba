"""One checkpoint file: encoded, written atomically, read back verified; nothing is ever unpickled.

A file holds the tensors of a nested training state (see :mod:`mixprec.persist.serialize`) and, in the
safetensors header's metadata, the JSON skeleton that puts them back together (every number, string
and flag: position, counters, RNG, scaler, policy), the step, and a SHA-256 over every metadata field
and every tensor's bytes: no byte that resuming depends on can change unnoticed.

Writing goes to a hidden temporary file in the same folder, is fsynced and renamed over the final
name (atomic on POSIX), and the folder is fsynced: a process killed at any moment leaves the old file
or the new one, never a half-written file under the final name.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save as safetensors_bytes

from mixprec.persist.serialize import flatten, unflatten

__all__ = ["CheckpointError", "encode_checkpoint", "fsync_directory", "read_checkpoint_file", "write_atomically"]

FORMAT = "mixprec-checkpoint"
VERSION = "2"  # 1: the checksum covered the tensors only


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


def encode_checkpoint(step: int, state: dict[str, Any]) -> bytes:
    """The bytes of the checkpoint file of ``state`` at ``step``: tensors, skeleton, step and checksum."""
    tensors, skeleton = flatten(state)
    cpu = {name: tensor.cpu() for name, tensor in tensors.items()}
    metadata = {"format": FORMAT, "version": VERSION, "step": str(step), "skeleton": json.dumps(skeleton)}
    metadata["sha256"] = _digest(cpu, metadata)
    return safetensors_bytes(cpu, metadata=metadata)


def read_checkpoint_file(path: str | os.PathLike, step: int | None = None) -> dict[str, Any]:
    """Read and verify one checkpoint file (whose name says ``step``, when given); raises CheckpointError
    naming the file and the problem, whatever the damage (any shape, depth or type)."""
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
    if step is not None and metadata.get("step") != str(step):
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


def write_atomically(final: Path, data: bytes) -> None:
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
    fsync_directory(final.parent)


def fsync_directory(directory: Path) -> None:
    """Make a folder's entries (a rename, a new file) durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
