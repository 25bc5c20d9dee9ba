"""The sharded checkpoint of an FSDP2 run: a folder where every rank writes its own shards.

Layout of ``step-00001200.sharded/``:

    shards/shard-0000R-model-00001-of-00001.safetensors   rank R-1's part of every sharded tensor (the
                          DTensors: parameters and optimizer state), each with its offsets in the header
                          (torch.distributed.checkpoint's safetensors format: nothing is pickled)
    state.safetensors     from rank 0, written last: everything else (identity, scaler, scheduler, RNG,
                          position, optimizer settings, replicated tensors such as buffers and step
                          counts) as one checkpoint file (:mod:`mixprec.persist.state_file`), with the
                          SHA-256 of every shard file

No rank gathers the model: each holds only its shards while writing. :func:`write_sharded` fills a
folder (the caller makes it appear atomically under its final name: :mod:`mixprec.app.checkpoint`).
:func:`read_sharded` verifies one: the state file's own checksum and step, then exactly the shard
files it lists, byte for byte (every rank reads them all once before loading; on several machines
the run folder must be on a shared file system). :func:`load_sharded` reads each tensor's part for
the tensors it is given, from whichever files hold it: under FSDP2 this rank's shards, whatever world
size wrote them (resharding); without a process group, whole tensors (``mixprec export``).
"""

from __future__ import annotations

import hashlib
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from mixprec.distributed import world
from mixprec.persist import CheckpointError, encode_checkpoint, fsync_directory, read_checkpoint_file, write_atomically

# torch.distributed.checkpoint and .tensor are imported where used: they import torch._dynamo, 1.4 s of
# every process's start, and only FSDP2 runs need them
if TYPE_CHECKING:
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.tensor import DTensor

__all__ = ["Shards", "fill_sharded", "load_sharded", "read_sharded", "split_sharded", "write_sharded"]

_SHARD = "__shard__"  # in the state file's skeleton: {"__shard__": name} stands for a tensor in the shards
STATE_FILE = "state.safetensors"


@dataclass(frozen=True)
class Shards:
    """Where a verified sharded checkpoint's tensors are, in the state :func:`read_sharded` returns."""

    folder: Path
    names: frozenset[str]


def split_sharded(state: Any, path: str = "") -> tuple[dict[str, DTensor], Any]:
    """(``{name: DTensor}``, ``state`` with each DTensor replaced by a marker naming it). A name is the
    tensor's path in the state (``model.blocks.0.weight``), the same at any world size."""
    sharded: dict[str, DTensor] = {}

    def walk(value: Any, at: str) -> Any:
        if _is_dtensor(value):
            sharded[at] = value
            return {_SHARD: at}
        if isinstance(value, dict):
            return {key: walk(item, f"{at}.{key}" if at else str(key)) for key, item in value.items()}
        if isinstance(value, (list, tuple)):
            return type(value)(walk(item, f"{at}[{i}]") for i, item in enumerate(value))
        return value

    return sharded, walk(state, path)


def fill_sharded(state: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """``state`` with every marker replaced by its tensor (KeyError for a marker ``tensors`` lacks)."""
    if isinstance(state, dict):
        if set(state) == {_SHARD}:
            return tensors[state[_SHARD]]
        return {key: fill_sharded(item, tensors) for key, item in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(fill_sharded(item, tensors) for item in state)
    return state


def _shard_names(state: Any) -> set[str]:
    """The names of the markers in ``state`` (a verified state file's skeleton)."""
    if isinstance(state, dict):
        if set(state) == {_SHARD} and isinstance(state[_SHARD], str):
            return {state[_SHARD]}
        return set().union(*(_shard_names(item) for item in state.values()))
    if isinstance(state, (list, tuple)):
        return set().union(*(_shard_names(item) for item in state))
    return set()


def write_sharded(folder: Path, step: int, state: dict[str, Any]) -> None:
    """Write ``state`` into ``folder`` (existing, empty): each rank its DTensors' shards, then rank 0
    the rest and the shards' checksums. A collective: every rank calls it with its own ``state``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    sharded, rest = split_sharded(state)
    shards = folder / "shards"
    try:
        dcp.save(sharded, storage_writer=dcp.HuggingFaceStorageWriter(str(shards), save_distributed=True))
    except CheckpointException as exc:  # raised on every rank when any rank's write failed
        first = next(iter(exc.failures.values()))[0]
        raise OSError(getattr(first, "errno", None), _failures(exc)) from None
    # save() returns on every rank once every rank's files are written and fsynced
    if not world().is_main:
        return
    rest["shard_files"] = {path.name: _sha256(path) for path in sorted(shards.iterdir())}
    fsync_directory(shards)
    write_atomically(folder / STATE_FILE, encode_checkpoint(step, rest))


def read_sharded(folder: Path, step: int, share: tuple[int, int] = (0, 1)) -> dict[str, Any]:
    """The verified state of the sharded checkpoint ``folder`` (holding ``step``); its tensors stay in
    the files, named by ``state["shards"]`` for :func:`load_sharded`. Raises CheckpointError.

    ``share`` ``(rank, ranks)``: checksum only every ``ranks``-th shard file from the ``rank``-th, for
    ranks that agree on the verdict afterwards (each file is then read once by the job, not once by
    every rank). The state file and the list of shard files are verified whole."""
    state = read_checkpoint_file(folder / STATE_FILE, step)
    listed = state.pop("shard_files", None)
    if not isinstance(listed, dict) or not all(isinstance(v, str) for v in listed.values()):
        raise CheckpointError(f"{folder}: its state file lists no shard files")
    shards = folder / "shards"
    present = {path.name for path in shards.iterdir()} if shards.is_dir() else set()
    if present != set(listed):
        missing, extra = sorted(set(listed) - present), sorted(present - set(listed))
        raise CheckpointError(f"{folder}: shard files missing {missing} or not of this checkpoint {extra}")
    rank, ranks = share
    for name, digest in sorted(listed.items())[rank::ranks]:
        try:
            same = _sha256(shards / name) == digest
        except OSError as exc:
            raise CheckpointError(f"{folder}: cannot read shards/{name} ({exc.strerror or exc})") from None
        if not same:
            raise CheckpointError(f"{folder}: checksum mismatch in shards/{name}; changed or damaged after saving")
    state["shards"] = Shards(shards, frozenset(_shard_names(state)))
    return state


def load_sharded(shards: Shards, tensors: dict[str, torch.Tensor]) -> None:
    """Read into ``tensors`` (``{name: tensor}``: DTensors under FSDP2, whole tensors otherwise) their
    values from the checkpoint, in place; ValueError naming what the checkpoint lacks."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    missing = sorted(set(tensors) - shards.names)
    if missing:
        raise ValueError(f"the checkpoint holds no {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
    reader = dcp.HuggingFaceStorageReader(str(shards.folder))
    in_group = torch.distributed.is_available() and torch.distributed.is_initialized()
    try:
        with warnings.catch_warnings():  # without a group: "assuming the intent is to load in a single process"
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(tensors, storage_reader=reader, no_dist=not in_group)
    except CheckpointException as exc:
        raise ValueError(f"{shards.folder.parent}: {_failures(exc)}") from None


def _is_dtensor(value: Any) -> bool:
    """Whether ``value`` is a DTensor; none exists before torch.distributed.tensor is imported."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(value, module.DTensor)


def _failures(exc: CheckpointException) -> str:
    """One line per failed rank (torch.distributed.checkpoint's own message is every rank's traceback)."""
    said = []
    for rank, (error, _) in sorted(exc.failures.items()):
        first_line = next((line.strip() for line in str(error).splitlines() if line.strip()), "")[:300]
        said.append(f"rank {rank}: {type(error).__name__}: {first_line}")
    return "; ".join(said)


def _sha256(path: Path) -> str:
    sha = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            sha.update(block)
    return sha.hexdigest()
