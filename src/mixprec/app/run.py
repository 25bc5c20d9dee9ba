"""One training run from a TrainConfig: build the task, train, evaluate, write the run folder.

The run folder holds ``config.json``, ``metrics.jsonl``, ``checkpoints/``, ``tensorboard/`` (when the
extra is installed), the plots and ``report.md``. The CLI's ``train`` and ``compare`` are thin layers
over :func:`run_training`.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mixprec.app.checkpoint import newest_step
from mixprec.app.config import TrainConfig, check_device, decided_by_the_machine
from mixprec.app.machine import machine_info
from mixprec.app.optimizer import adamw_for
from mixprec.app.report import plot_run, write_run_report
from mixprec.app.run_lock import run_lock
from mixprec.app.stop_signals import held
from mixprec.app.task import TaskConfig, TaskParts, build_task
from mixprec.app.torchrun import init_from_env
from mixprec.app.trainer import FitResult, Trainer
from mixprec.app.trainer_options import BatchChecks, RunOptions, TrainData, UpdateOptions
from mixprec.distributed import world
from mixprec.doctor import NonFiniteEvent
from mixprec.engine import saved_activation_bytes
from mixprec.parallel import fully_shard
from mixprec.persist import RUN, claim_folder
from mixprec.policy import Policy, get_policy
from mixprec.regions import ComputePlan, prepare
from mixprec.scaling import DynamicLossScaler

logger = logging.getLogger("mixprec")

__all__ = ["RunOutcome", "build_trainer", "check_policies_fit", "resolve_device", "run_training"]


@dataclass(frozen=True)
class RunOutcome:
    config: TrainConfig
    run_dir: Path
    policy: Policy
    compute_plan: ComputePlan
    result: FitResult
    parameters: int
    activation_bytes: int
    description: str
    metric: str | None
    report: Path
    nonfinite: list[NonFiniteEvent] | None = None  # with trace_nonfinite: the first inf/NaN of each skipped step
    world_size: int = 1  # processes training data-parallel (torchrun)
    parallel: str | None = None  # how: "DDP" (replicas) or "FSDP2" (shards); None in one process


def resolve_device(spec: str) -> str:
    check_device(spec, "device")
    if spec == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if spec.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device={spec!r}: no CUDA device is visible; use --device cpu (or auto).")
    index = torch.device(spec).index
    if index is not None and index >= torch.cuda.device_count():
        raise ValueError(
            f"device={spec!r}: this machine has {torch.cuda.device_count()} CUDA device(s), numbered from 0."
        )
    return spec


def _cosine(total: int):
    """LR multiplier: cosine decay from 1 to 0.1 over the run (a closure, so schedulers stay JSON-able)."""
    return lambda step: 0.1 + 0.45 * (1 + math.cos(math.pi * min(step, total) / total))


def _parameter_groups(parts: TaskParts, weight_decay: float) -> list[dict[str, Any]]:
    """AdamW's parameter groups: one, or (with ``TaskParts.no_weight_decay``) the decayed parameters and
    the others at weight decay 0."""
    named = list(parts.model.named_parameters())
    if parts.no_weight_decay is None:
        return [{"params": [p for _, p in named]}]
    kept = [p for name, p in named if parts.no_weight_decay(name, p)]
    decayed = [p for name, p in named if not parts.no_weight_decay(name, p)]
    groups = [{"params": decayed, "weight_decay": weight_decay}, {"params": kept, "weight_decay": 0.0}]
    return [group for group in groups if group["params"]]


def _frozen(parts: TaskParts) -> tuple[torch.nn.Parameter, ...]:
    """The parameters of the task's frozen phase (its pretrained body); refused for a task without one."""
    if parts.frozen is None:
        raise ValueError(
            "frozen_epochs (--frozen-epochs): this task has no pretrained body to freeze; the vision task has one."
        )
    return tuple(p for name, p in parts.model.named_parameters() if parts.frozen(name, p))


def build_trainer(
    config: TrainConfig,
    run_dir: Path | None,
    progress: bool,
    allow_foreign_checkpoint: bool = False,
    policy: Policy | None = None,
) -> tuple[Trainer, TaskParts, dict]:
    """The task, optimizer, scheduler and Trainer a config describes; returns (trainer, parts, settings).
    ``policy``: ``config.policy`` parsed already (by the caller that checked it), else parsed here, once."""
    # under torchrun: join the process group (FSDP2 in one process: a group of one)
    device = init_from_env(
        resolve_device(config.device), sharded=config.parallel == "fsdp", timeout=config.collective_timeout
    )
    # the policy before the task: a misspelt one is said before a model loads
    policy = policy if policy is not None else get_policy(config.policy, device=device, argument="policy=...")
    parts = build_task(config.task, TaskConfig(config.batch_size, config.seed, device, config.size))
    settings = _settings(config, parts.defaults)
    if config.parallel == "fsdp" and world().backend is not None:  # shard before the optimizer sees the parameters
        fully_shard(parts.model, policy, reduce_dtype=torch.float32 if config.reduce_fp32 else None)
    groups = _parameter_groups(parts, settings["weight_decay"])
    optimizer = adamw_for(policy, groups, device, lr=settings["lr"], weight_decay=settings["weight_decay"])
    per_epoch = len(parts.train_data) // config.accumulation_steps  # updates
    total = settings.get("steps") or settings["epochs"] * per_epoch
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, (parts.schedule or _cosine)(max(total, 1)))
    scaler = None
    if config.loss_scale is not None:
        scaler = DynamicLossScaler(init_scale=config.loss_scale, max_scale=max(2.0**24, config.loss_scale))
    trainer = Trainer(
        parts.model,
        optimizer,
        TrainData(parts.train_data, parts.eval_data, parts.loss_fn, parts.metric),
        policy,
        scheduler=scheduler,
        update=UpdateOptions(
            scaler,
            settings["max_grad_norm"],
            config.accumulation_steps,
            config.reduce_fp32,
            frozen=_frozen(parts) if settings["frozen_epochs"] else (),
            frozen_updates=settings["frozen_epochs"] * per_epoch,
        ),
        run=RunOptions(
            out_dir=run_dir,
            seed=config.seed,
            eval_every=config.eval_every,
            log_every=config.log_every,
            checkpoint_every=config.checkpoint_every,
            keep_checkpoints=config.keep_checkpoints,
            checkpoint_every_minutes=config.checkpoint_every_minutes,
            stop_signals=config.stop_signal_names,
            allow_foreign_checkpoint=allow_foreign_checkpoint,
            progress=progress,
            compile=config.compile,
        ),
        checks=BatchChecks(
            on_bad_batch="skip" if config.skip_bad_batches else "stop", trace_nonfinite=config.trace_nonfinite
        ),
    )
    return trainer, parts, settings


def check_policies_fit(config: TrainConfig, policies: list[tuple[str, Policy]]) -> None:
    """Refuse a policy the task's model cannot take (an FP32 name matching no module, tied weights split between
    FP32 and 16 bits) before any run trains: ``compare`` trains its policies one after the other, and found a bad
    last one after training the others. ``policies``: (as given, parsed). Builds the task once."""
    device = resolve_device(config.device)
    model = build_task(config.task, TaskConfig(config.batch_size, config.seed, device, config.size)).model
    for spec, policy in policies:
        try:
            prepare(model, policy)  # the checks alone: nothing is cast
        except ValueError as error:
            raise ValueError(f"--policies {spec!r}: {error}") from None


def _settings(config: TrainConfig, defaults: dict) -> dict:
    """The run's learning rate, weight decay, clipping and length: the config's, else the task's defaults."""
    settings = {
        "lr": config.lr if config.lr is not None else defaults.get("lr", 1e-3),
        "weight_decay": config.weight_decay if config.weight_decay is not None else defaults.get("weight_decay", 0.0),
        "max_grad_norm": config.max_grad_norm if config.max_grad_norm is not None else defaults.get("max_grad_norm"),
        "frozen_epochs": config.frozen_epochs if config.frozen_epochs is not None else defaults.get("frozen_epochs", 0),
    }
    if config.steps is None and config.epochs is None:
        settings.update({k: defaults[k] for k in ("steps", "epochs") if k in defaults})
        if "steps" not in settings and "epochs" not in settings:
            settings["epochs"] = 1
    else:
        settings.update({"steps": config.steps} if config.steps is not None else {"epochs": config.epochs})
    return settings


def run_training(
    config: TrainConfig,
    run_dir: Path,
    *,
    resume: bool = False,
    progress: bool = True,
    allow_foreign_checkpoint: bool = False,
    claimed: bool = False,
    policy: Policy | None = None,
) -> RunOutcome:
    """Train as ``config`` says into ``run_dir`` (``resume``: continue the run already there, refusing a
    checkpoint of another run unless ``allow_foreign_checkpoint``; ``claimed``: the caller created the empty
    folder to reserve its name; ``policy``: ``config.policy`` parsed already).

    A run that fails before it starts (a bad policy, device or task) leaves no folder behind.
    """
    if int(os.environ.get("RANK", "0")) == 0:  # under torchrun rank 0 claims it (and locks it) for every rank
        created = claim_folder(run_dir, RUN, "--out") or claimed  # refused: a folder of files mixprec did not write
    else:
        created = claimed or not run_dir.exists()
        run_dir.mkdir(parents=True, exist_ok=True)
    with run_lock(run_dir):  # RunFolderBusy: the folder is another run's, left as it is
        return _train_in(run_dir, created, config, resume, progress, allow_foreign_checkpoint, policy)


def _train_in(  # long: the run's steps in order, each one or two lines
    run_dir: Path,
    created: bool,
    config: TrainConfig,
    resume: bool,
    progress: bool,
    allow_foreign: bool,
    policy: Policy | None,
) -> RunOutcome:
    try:
        trainer, parts, settings = build_trainer(config, run_dir, progress, allow_foreign, policy)
        length = {"steps": settings["steps"]} if "steps" in settings else {"epochs": settings["epochs"]}
        step = newest_step(trainer.checkpoint_dir) if resume else None
        requeued = resume and step is None  # a requeued job whose run died before its first checkpoint
        resume = resume and not requeued
        if not resume:
            trainer.check_new_run()  # before config.json is written over an existing run
            trainer.total_steps(**length)  # a length that cannot run (an epoch shorter than a window): no folder left
            _refuse_finished(run_dir)
            if requeued:
                logger.warning("%s holds no checkpoint (its run ended before the first): starting the run over from "
                               "its config.json", run_dir)  # fmt: skip
        else:  # a length the run is past: refused before anything is written
            total = trainer.total_steps(**length)
            # a checkpoint named past the length is read first: a damaged one, which the resume would skip, is
            # not where the run is
            trainer.check_resume_length(total, newest_step(trainer.checkpoint_dir, total) or 0, next(iter(length)))
    except BaseException:
        if created:
            shutil.rmtree(run_dir, ignore_errors=True)
        raise
    main = trainer.world.is_main
    if main:  # on resume too: a length or checkpoint setting given with --resume holds for later resumes
        # the policy as resolved here: a resume goes on with the policy the run trained under
        decided = decided_by_the_machine(config.policy)
        (config.replace(policy=str(trainer.mp.policy)) if decided else config).save(run_dir)
    result = trainer.fit(**length, resume=resume)
    with held(trainer.run_options.stop_signals, "writing the run's report"):  # the run is complete: the report follows
        return _report(run_dir, config, trainer, parts, settings, result)


def _refuse_finished(run_dir: Path) -> None:
    """A finished run (its report.md) whose checkpoints are gone: nothing to resume, and starting over would
    write over its report, config and plots."""
    if (run_dir / REPORT).exists():
        raise ValueError(
            f"--out {run_dir}: this folder holds a finished run (its {REPORT}) with no checkpoint left to resume; "
            "a new run there would write over its report, config and plots: name a new folder."
        )


REPORT = "report.md"


def _report(
    run_dir: Path, config: TrainConfig, trainer: Trainer, parts: TaskParts, settings: dict, result: FitResult
) -> RunOutcome:
    """The saved activations' size, the plots and report.md of a finished run."""
    main = trainer.world.is_main
    inputs, _ = next(iter(parts.eval_data))
    inputs = inputs.to(trainer.device)
    with trainer.mp.autocast():
        activations = saved_activation_bytes(lambda: trainer.model(inputs), trainer.model)
    metric = parts.metric.name if parts.metric is not None else None
    parallel = "FSDP2" if trainer.mp.sharded else "DDP" if trainer.world.distributed else None
    report = run_dir / REPORT
    if main:
        plots = plot_run(result.history, run_dir, f"{config.task} under {config.policy}", metric)
        results = _results(result, activations, trainer.world.size, parallel)
        _write_report(report, config, {**settings, "task description": parts.description}, trainer, results, plots)
    return RunOutcome(
        config=config,
        run_dir=run_dir,
        policy=trainer.mp.policy,
        compute_plan=trainer.mp.compute_plan,
        result=result,
        parameters=sum(p.numel() for p in trainer.model.parameters()),
        activation_bytes=activations,
        description=parts.description,
        metric=metric,
        report=report,
        nonfinite=trainer.tracer.events if trainer.tracer is not None else None,
        world_size=trainer.world.size,
        parallel=parallel,
    )


def _results(result: FitResult, activations: int, world_size: int, parallel: str | None) -> dict[str, Any]:
    """The report's results table: length, speed, losses, the metric, skips, scale, memory, processes."""
    stats = result.stats
    return {
        "steps": result.steps,
        "epochs": result.epochs,
        "seconds": result.seconds,
        "ms_per_step": result.ms_per_step,
        "samples_per_s": result.samples_per_s,
        "final train loss": result.train_loss,
        **{f"eval {k}": v for k, v in result.eval.items()},
        "skipped steps": stats.skipped_steps,
        "final loss scale": stats.scale,
        "model state bytes/param": stats.bytes_per_param.total,
        "saved activations (MB, one eval batch)": activations / 2**20,
        "processes (data parallel)": world_size,
        **({"parallel": parallel} if parallel else {}),
    }


def _write_report(
    report: Path, config: TrainConfig, settings: dict, trainer: Trainer, results: dict[str, Any], plots: list[Path]
) -> None:
    """``report.md``: the config (with the resolved ``settings``), machine, policy and compute plan with
    their reasons, the results and the plots."""
    plan = trainer.mp.compute_plan
    write_run_report(
        report,
        title=f"mixprec run: {config.task} under {config.policy}",
        config={**config.to_dict(), **settings},
        machine=machine_info(),
        policy=str(trainer.mp.policy),
        policy_reason=f"{trainer.mp.policy.reason}; compute {plan.mode}: {plan.reason}",
        results=results,
        plots=plots,
    )
