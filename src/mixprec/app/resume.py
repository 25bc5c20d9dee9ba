"""Resuming a run: which checkpoint, whether it belongs to this run, and a load that cannot half-apply.

A checkpoint carries the run's identity (policy, seed, model architecture, optimizer and its
settings), written with it and covered by its checksum. Resuming walks the checkpoints newest first:
one that does not verify (damaged, edited, misnamed) or does not load into this model is skipped with
one line naming the file and the reason (or, when none is usable, one error listing them all), and
the next older one is tried; the trainer's state is put back as it was after each failed attempt.
Under FSDP2 the ranks agree on which checkpoint is damaged, so that they all load the same one.
One that verifies but belongs to another run stops the resume with the differences, unless the
caller allows foreign checkpoints.

It knows the Trainer only as :class:`RunParts` (what identifies a run) and :class:`Resumable` (a state
that goes out and back in): the Trainer's own state lives in :mod:`mixprec.app.trainer_state`.
"""

from __future__ import annotations

import copy
import hashlib
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from mixprec.app.checkpoint import CheckpointError, list_checkpoints, load_checkpoint, set_aside
from mixprec.app.optimizer import KERNEL_CHOICES
from mixprec.distributed import agree_max
from mixprec.policy import resumes_under

if TYPE_CHECKING:
    from mixprec.app.trainer_options import RunOptions, TrainData
    from mixprec.distributed import World
    from mixprec.engine import MixedPrecision

__all__ = ["ForeignCheckpointError", "Resumable", "RunParts", "check_run_identity", "restore_latest", "run_identity"]

logger = logging.getLogger("mixprec")


class ForeignCheckpointError(ValueError):
    """A valid checkpoint of another run (another seed, policy, model or optimizer setting)."""


class RunParts(Protocol):
    """What identifies a run (a :class:`~mixprec.app.trainer.Trainer` has it): the model, the optimizer, the
    engine's policy, the run's seed and its data (their batch size)."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    mp: MixedPrecision
    run_options: RunOptions
    data: TrainData


class Resumable(RunParts, Protocol):
    """What a resume loads a checkpoint into (a Trainer is one): its training state, out and back in, and the
    ranks and device it runs on."""

    world: World

    @property
    def device(self) -> torch.device: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


def run_identity(trainer: RunParts) -> dict[str, Any]:
    """What makes a run this run: policy, seed, model architecture, optimizer and its settings, and the batch
    size of its training data (a resume indexes the same samples only with the same batches)."""
    shapes = ";".join(f"{name}:{tuple(p.shape)}" for name, p in trainer.model.named_parameters())
    settings = {
        k: v
        for k, v in trainer.optimizer.defaults.items()
        if isinstance(v, (bool, int, float, str)) and k not in KERNEL_CHOICES
    }
    return {
        "policy": str(trainer.mp.policy),
        "seed": trainer.run_options.seed,
        "model": f"{_model_class(trainer.model)} {hashlib.sha256(shapes.encode()).hexdigest()[:16]}",
        "optimizer": type(trainer.optimizer).__name__,
        **{f"optimizer {key}": value for key, value in sorted(settings.items())},
        "batch size": getattr(trainer.data.train_data, "batch_size", None),  # a DataLoader's, or the task's
    }


# identity keys newer than some checkpoints: compared only where the checkpoint records them
_ADDED_LATER = frozenset({"batch size"})


def _model_class(model: torch.nn.Module) -> str:
    """The model's own class name: FSDP2 makes a subclass (FSDPTinyGPT for TinyGPT) that is not the identity."""
    own = next((c for c in type(model).__mro__ if not c.__module__.startswith("torch.distributed")), type(model))
    return own.__name__


def restore_latest(trainer: Resumable, directory: Path, *, allow_foreign: bool = False) -> tuple[Path, dict]:
    """Load the newest usable checkpoint of ``directory`` into ``trainer``; returns its path and state.

    Raises:
        ValueError: no checkpoint file at all, or none usable (the reason for each).
        ForeignCheckpointError: the newest valid checkpoint belongs to another run (``allow_foreign``:
            warn and load it).
    """
    paths = list(reversed(list_checkpoints(directory)))
    if not paths:
        raise ValueError(f"no checkpoint in {directory}; nothing to resume.")
    before = None if trainer.mp.sharded else copy.deepcopy(trainer.state_dict())  # put back after a failed load
    problems = []
    for path in paths:
        try:
            state = _verified(trainer, path)
            check_run_identity(trainer, path, state, allow_foreign=allow_foreign)
        except CheckpointError as exc:  # every rank skips it: _verified agrees on damage across ranks
            problems.append(str(exc))
            continue
        try:
            trainer.load_state_dict(state)
        except ValueError as exc:
            if before is None:  # FSDP2: a verified checkpoint that does not fit this model fails on every rank
                raise
            trainer.load_state_dict(before)
            problems.append(str(exc))
            continue
        if trainer.world.is_main:  # one line each, from rank 0, said once; the skipped ones set aside
            for problem, skipped in zip(problems, paths, strict=False):
                aside = set_aside(skipped)
                logger.warning("Skipped a checkpoint: %s; using %s (the skipped one set aside as %s)",
                               problem, path.name, aside.name)  # fmt: skip
        return path, state
    raise ValueError(f"no usable checkpoint in {directory}: " + "; ".join(problems))


def _verified(trainer: Resumable, path: Path) -> dict:
    """The verified state of ``path``; CheckpointError if it is damaged, under FSDP2 on any rank (each
    rank checksums its share of the shard files; one all-reduce makes them all skip a checkpoint together)."""
    error, state = None, {}
    share = (trainer.world.rank, trainer.world.size) if trainer.mp.sharded else (0, 1)
    try:
        state = load_checkpoint(path, share)
    except CheckpointError as exc:
        error = exc
    if trainer.mp.sharded:
        (damaged,) = agree_max([torch.tensor(float(error is not None), device=trainer.device)])
        if bool(damaged) and error is None:  # host sync: once per checkpoint tried, at resume
            error = _found_by_another_rank(path) if trainer.world.is_main else CheckpointError(f"{path}: damaged")
    if error is not None:
        raise error
    return state


def _found_by_another_rank(path: Path) -> CheckpointError:
    """What another rank found wrong in ``path``, found again by checking all of it (rank 0 says it)."""
    try:
        load_checkpoint(path)
    except CheckpointError as exc:
        return exc
    return CheckpointError(f"{path}: damaged as another rank read it")


def check_run_identity(trainer: RunParts, path: Path, state: dict, *, allow_foreign: bool = False) -> None:
    """Raise ForeignCheckpointError when the checkpoint ``state`` (read from ``path``) belongs to another
    run than ``trainer``'s (``allow_foreign``: warn instead); CheckpointError when it records no identity."""
    saved, here = state.get("identity"), run_identity(trainer)
    if not isinstance(saved, dict):
        raise CheckpointError(f"{path}: records no run identity")
    differences = [
        f"{key} {saved.get(key)!r} there, {value!r} here"
        for key, value in here.items()
        if saved.get(key) != value
        and (key in saved or key not in _ADDED_LATER)
        and not (key == "policy" and isinstance(saved.get(key), str) and resumes_under(saved[key], trainer.mp.policy))
    ]
    if not differences:
        return
    message = f"{path} belongs to another run ({'; '.join(differences)})"
    if allow_foreign:
        logger.warning("%s; loading it anyway (allow_foreign_checkpoint)", message)
        return
    raise ForeignCheckpointError(
        f"{message}. Remove it, or pass --allow-foreign-checkpoint (allow_foreign_checkpoint=True) to resume from it."
    )
