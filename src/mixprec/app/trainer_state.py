"""The Trainer's state: what its checkpoints hold, taken out (whole, or each rank's FSDP2 shards), written,
and put back.

The state is the model's and the optimizer's, MixedPrecision's (scales, masters, counters), the LR
scheduler's, the random states (rank 0's), the position in the run and the run's identity (checked on
resume: a checkpoint of another run is refused, :mod:`mixprec.app.resume`). The position keeps the names it
has in every earlier checkpoint: ``step`` is the Trainer's ``updates_done``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import torch

from mixprec.app.checkpoint import save_checkpoint, save_sharded_checkpoint
from mixprec.app.optimizer import KERNEL_CHOICES
from mixprec.app.resume import Resumable, run_identity
from mixprec.app.rng_state import get_rng_state, set_rng_state
from mixprec.app.sharded_checkpoint import Shards, fill_sharded, load_sharded, split_sharded
from mixprec.parallel import gather_state, scatter_state, sharded_state

__all__ = ["POSITION", "TrainerParts", "load_trainer_state", "trainer_state", "write_trainer_checkpoint"]

POSITION = ("step", "epoch", "batch_in_epoch", "skipped_batches")  # a checkpoint's "position" entry


class TrainerParts(Resumable, Protocol):
    """What the state is made of (a :class:`~mixprec.app.trainer.Trainer`): besides what identifies the run, the
    scheduler and the position in the run."""

    scheduler: Any
    updates_done: int
    epoch: int
    batch_in_epoch: int
    skipped_batches: int
    resumed_unrecorded: dict[str, Any] | None

    def unrecorded_loss(self) -> dict[str, Any] | None: ...


def trainer_state(trainer: TrainerParts) -> dict[str, Any]:
    """Everything needed to continue bit-identically.

    With FSDP2 shards this is a collective: the full state is gathered to rank 0 (other ranks get
    empty model and optimizer entries). Checkpoints of such runs do not gather: each rank writes its
    own shards (:func:`write_trainer_checkpoint`).
    """
    if trainer.mp.sharded:
        model_state, optimizer_state = gather_state(trainer.model, trainer.optimizer)
    else:
        model_state, optimizer_state = trainer.model.state_dict(), trainer.optimizer.state_dict()
    return {"model": model_state, "optimizer": optimizer_state, **_run_state(trainer)}


def _run_state(trainer: TrainerParts) -> dict[str, Any]:
    """The state besides the model's and the optimizer's: the same on every rank (rank 0's RNG)."""
    return {
        "identity": run_identity(trainer),  # checked on resume: a checkpoint of another run is refused
        "sharded": trainer.mp.sharded,  # FSDP2: tensors keyed by name, whole or in a sharded checkpoint
        "mixed_precision": trainer.mp.state_dict(),
        "scheduler": trainer.scheduler.state_dict() if trainer.scheduler is not None else None,
        "rng": get_rng_state(),
        "unrecorded": trainer.unrecorded_loss(),  # the train loss since the last record (None: not carried)
        "position": {
            "step": trainer.updates_done,
            "epoch": trainer.epoch,
            "batch_in_epoch": trainer.batch_in_epoch,
            "skipped_batches": trainer.skipped_batches,
            "seed": trainer.run_options.seed,
        },
    }


def load_trainer_state(trainer: TrainerParts, state: dict[str, Any]) -> None:
    """Restore what :func:`trainer_state` returned; ValueError (with what does not fit) for anything else."""
    if not isinstance(state, dict):
        raise ValueError(f"a training state is a dict; received {type(state).__name__}.")
    mp = trainer.mp
    if bool(state.get("sharded", False)) != mp.sharded:
        saved, here = ("an FSDP2", "without FSDP2") if state.get("sharded") else ("a non-sharded", "under FSDP2")
        raise ValueError(
            f"the checkpoint comes from {saved} run and this one runs {here}; resume it the way it was "
            "trained (mixprec train --parallel fsdp under torchrun, with any number of ranks, or without)."
        )
    try:
        if mp.sharded:  # a collective: every rank keeps its own shards
            _load_sharded_model(trainer, state)
        else:
            trainer.model.load_state_dict(state["model"])
        mp.load_state_dict(state["mixed_precision"])  # after the model: masters overwrite lowered weights
        if not mp.sharded:
            kernels = [{k: g[k] for k in KERNEL_CHOICES if k in g} for g in trainer.optimizer.param_groups]
            trainer.optimizer.load_state_dict(state["optimizer"])
            for group, kept in zip(trainer.optimizer.param_groups, kernels, strict=True):
                group.update(kept)  # this run's update kernel (fused), not the saved run's
        if trainer.scheduler is not None and state["scheduler"] is not None:
            trainer.scheduler.load_state_dict(state["scheduler"])
            _lr_of_this_plan(trainer.scheduler, trainer.optimizer)
        set_rng_state(state["rng"])
        position = state["position"]
        if not all(type(position[k]) is int and position[k] >= 0 for k in POSITION):
            raise TypeError(f"position {position!r}: expected whole numbers >= 0 for {', '.join(POSITION)}")
    except (KeyError, RuntimeError, TypeError, AttributeError, IndexError, ValueError) as exc:
        raise ValueError(f"the checkpoint does not fit this model and optimizer: {type(exc).__name__}: {exc}") from None
    trainer.updates_done, trainer.epoch = position["step"], position["epoch"]
    trainer.batch_in_epoch, trainer.skipped_batches = position["batch_in_epoch"], position["skipped_batches"]
    trainer.resumed_unrecorded = state.get("unrecorded")  # absent from an earlier release's checkpoints


def _lr_of_this_plan(scheduler: Any, optimizer: Any) -> None:
    """The learning rate the schedule gives at the step resumed, into the optimizer: its saved state holds the
    saved run's, which a run extended on resume (its schedule re-planned for the new length) used for its first
    update (0.0003, the old plan's last, where the new plan gave 0.00165). A LambdaLR's rate is a formula of the
    step, so this is the value the saved run held when its plan is the same (the resume stays bit for bit)."""
    if isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR):
        step = scheduler.last_epoch
        lrs = [base * factor(step) for base, factor in zip(scheduler.base_lrs, scheduler.lr_lambdas, strict=True)]
        for group, lr in zip(optimizer.param_groups, lrs, strict=True):
            group["lr"] = lr
        scheduler._last_lr = lrs


def _load_sharded_model(trainer: TrainerParts, state: dict[str, Any]) -> None:
    """The model's and optimizer's state into the FSDP2 shards: from a sharded checkpoint's files (at
    any world size: each rank reads its part), or from a whole-model file of an earlier version."""
    shards = state.get("shards")
    if not isinstance(shards, Shards):
        scatter_state(trainer.model, trainer.optimizer, state["model"], state["optimizer"])
        return
    model_now, optimizer_now = sharded_state(trainer.model, trainer.optimizer)
    targets, _ = split_sharded({"model": model_now, "optimizer": optimizer_now})
    load_sharded(shards, targets)  # in place, into this rank's shards
    saved = fill_sharded({"model": state["model"], "optimizer": state["optimizer"]}, targets)
    scatter_state(trainer.model, trainer.optimizer, saved["model"], saved["optimizer"], full=False)


def write_trainer_checkpoint(trainer: TrainerParts, directory: Path) -> Path | None:
    """Write the checkpoint of ``trainer.updates_done`` into ``directory``, keeping ``RunOptions.keep_checkpoints``:
    DDP and single processes from rank 0 (DDP ranks hold identical state), FSDP2 runs from every rank, each its
    own shards (a collective; see :mod:`mixprec.app.checkpoint`). None on the ranks that write no file."""
    keep = trainer.run_options.keep_checkpoints
    if trainer.mp.sharded:
        model_state, optimizer_state = sharded_state(trainer.model, trainer.optimizer)
        state = {"model": model_state, "optimizer": optimizer_state, **_run_state(trainer)}
        return save_sharded_checkpoint(directory, trainer.updates_done, state, keep=keep, device=trainer.device)
    if not trainer.world.is_main:
        return None
    return save_checkpoint(directory, trainer.updates_done, trainer.state_dict(), keep=keep)
