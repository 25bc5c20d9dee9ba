"""Trainer: a training loop for built-in tasks and simple user models, on top of MixedPrecision.

It has no numerics of its own: casting, scaling, skipping and master weights are MixedPrecision's.
What it adds: epochs and steps, evaluation, metrics (JSONL, TensorBoard), progress, checkpoints that
resume bit-identically, a clean stop on Ctrl-C, and a refusal to train on non-finite inputs. When a run
stops, what a stop saves and when a checkpoint is due are its :class:`~mixprec.app.lifecycle.RunLifecycle`'s;
what a checkpoint holds is :mod:`mixprec.app.trainer_state`'s.

Records in ``metrics.jsonl``:
    train  step, epoch, loss (mean since the last record), scale, skipped_steps (cumulative), skipped_at
           (steps skipped since the last record), samples_per_s, ms_per_step, lr, time (seconds)
    eval   step, loss, and the task's metric (e.g. accuracy)

Its settings are four frozen values (:mod:`mixprec.app.trainer_options`): TrainData, UpdateOptions,
RunOptions and BatchChecks.

Host syncs: one per logged step (the running loss), one per step for the input check
(``BatchChecks.check_inputs``), those of MixedPrecision.step(), and under torchrun the lifecycle's one
all-reduce per update.
"""

from __future__ import annotations

import contextlib
import logging
import math
import random
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from mixprec.app.checkpoint import list_checkpoints
from mixprec.app.evaluate import batch_size, evaluate, to_device
from mixprec.app.failures import BadBatchError
from mixprec.app.lifecycle import RunLifecycle, TrainingInterrupted
from mixprec.app.metrics_log import LogInterval, MetricsLog
from mixprec.app.progress import ProgressBar
from mixprec.app.resume import restore_latest
from mixprec.app.torchrun import even_samples, shard
from mixprec.app.trainer_options import BatchChecks, RunOptions, TrainData, UpdateOptions
from mixprec.app.trainer_state import load_trainer_state, trainer_state, write_trainer_checkpoint
from mixprec.checks import whole_number
from mixprec.compute import dropped_roundings_note
from mixprec.distributed import agree_max, copy_from_main, reduce_across_ranks, world
from mixprec.doctor import NonFiniteTracer
from mixprec.engine import MixedPrecision, Stats, StepResult
from mixprec.parallel import is_sharded, wrap_ddp
from mixprec.persist import RUN, claim_folder
from mixprec.policy import Policy

__all__ = ["FitResult", "Trainer", "TrainingInterrupted"]

logger = logging.getLogger("mixprec")


@dataclass(frozen=True)
class FitResult:
    steps: int
    epochs: int
    seconds: float
    train_loss: float
    eval: dict[str, float]
    ms_per_step: float
    samples_per_s: float
    stats: Stats
    history: list[dict[str, Any]]
    run_dir: Path | None
    resumed_from: int | None = None  # the step this fit() continued from, when it resumed
    timed_steps: int = 0  # the updates behind ms_per_step (this fit() only)


class Trainer:
    """Train ``model`` with ``optimizer`` under ``policy`` on ``data``; evaluate, log, checkpoint, resume.

    Example:
        >>> trainer = Trainer(  # doctest: +SKIP
        ...     model, optimizer, TrainData(train_loader, test_loader, loss_fn, metric=accuracy), "mixed_bf16",
        ...     update=UpdateOptions(max_grad_norm=1.0), run=RunOptions(out_dir="runs/mine"),
        ... )
        >>> trainer.fit(epochs=10).eval  # doctest: +SKIP

    Args:
        model, optimizer, policy: as for :class:`mixprec.MixedPrecision`.
        data: the training and evaluation data, the loss and the metric (:class:`TrainData`).
        scheduler: an LR scheduler, stepped after each applied update (never after a skipped one).
        update: the scaler, clipping, gradient accumulation and FP32 reduction (:class:`UpdateOptions`).
        run: the run folder, seed and the cadence of logs, evaluations and checkpoints (:class:`RunOptions`).
        checks: the guards against NaN/inf batches (:class:`BatchChecks`).

    Raises:
        TypeError: ``data``, ``update``, ``run`` or ``checks`` of the wrong type.

    Under torchrun the model trains data-parallel: wrapped in DistributedDataParallel, or as it is when
    :func:`mixprec.fully_shard` has sharded it (FSDP2); each rank takes its slice of every batch.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        data: TrainData,
        policy: Policy | str = "auto",
        *,
        scheduler: Any = None,
        update: UpdateOptions | None = None,
        run: RunOptions | None = None,
        checks: BatchChecks | None = None,
    ) -> None:
        update = UpdateOptions() if update is None else update
        run = RunOptions() if run is None else run
        checks = BatchChecks() if checks is None else checks
        _check_settings(data=data, update=update, run=run, checks=checks)
        self.model = model
        # under torchrun: DDP (or FSDP2 shards) for the training forward, a slice of every batch, files
        # from rank 0 only
        self.world = world()
        if update.frozen_updates and self.world.distributed:
            raise ValueError(
                "Trainer: a frozen phase (UpdateOptions(frozen_updates=...), --frozen-epochs) under torchrun: DDP and "
                "FSDP2 expect a gradient for every trainable parameter at each update. Pass --frozen-epochs 0."
            )
        if self.world.distributed and not is_sharded(model):  # the masters from the weights DDP will broadcast
            copy_from_main([*model.parameters(), *model.buffers()])
        # every skipped step between two train records is listed there (skipped_at): the engine keeps as many
        self.mp = MixedPrecision(
            model, optimizer, policy, update.scaler, accumulation_steps=update.accumulation_steps,
            history=max(32, run.log_every),
        )  # fmt: skip
        self._train_model: nn.Module = model
        if self.world.distributed and not self.mp.sharded:
            self._train_model = wrap_ddp(model, reduce_in_fp32=update.reduce_in_fp32)
        if run.compile:  # the training forward only: checkpoints and evaluation keep the plain module
            # emulate_precision_casts: inductor keeps the 16-bit roundings of emulated ops, so compiled = eager
            self._train_model = torch.compile(self._train_model, options={"emulate_precision_casts": True})
            plan = self.mp.compute_plan
            if note := dropped_roundings_note(plan.emulates, plan.dtype, self.mp.device):
                logger.warning(note)
        self.optimizer, self.scheduler = optimizer, scheduler
        self.data, self.update_options, self.run_options, self.checks = data, update, run, checks
        self.out_dir = Path(run.out_dir) if run.out_dir is not None else None
        # where the first inf/NaN of each skipped step appeared (mixprec.doctor.NonFiniteTracer)
        self.tracer = NonFiniteTracer(model) if checks.trace_nonfinite else None
        self.updates_done, self.skipped_batches = 0, 0  # updates (applied or skipped); bad batches dropped
        self.epoch, self.batch_in_epoch = 0, 0  # the epoch, and the micro-batches consumed in it
        self._told_uneven = False  # a batch cut to a multiple of the world size was said
        self._interval: LogInterval | None = None  # the running train record of the fit under way
        self.resumed_unrecorded: dict[str, Any] | None = None  # a checkpoint's loss since its last record
        self._frozen_phase: bool | None = None  # whether update.frozen was last set frozen (None: not set yet)
        # stop signals (Ctrl-C, SIGTERM, SIGUSR1), the position committed after each update, checkpoints due
        self._lifecycle = RunLifecycle(self, run, self.mp, self.world)
        if self.out_dir is not None:
            if self.world.is_main:  # refused: a folder of files mixprec did not write
                claim_folder(self.out_dir, RUN, "RunOptions(out_dir=...)")
            else:
                self.out_dir.mkdir(parents=True, exist_ok=True)
        self.log = MetricsLog(self.out_dir if self.world.is_main else None)

    @property
    def device(self) -> torch.device:
        return self.mp.device

    @property
    def checkpoint_dir(self) -> Path | None:
        return self.out_dir / "checkpoints" if self.out_dir is not None else None

    # -- the loop --------------------------------------------------------------------------------
    def fit(self, epochs: int | None = None, steps: int | None = None, resume: bool = False) -> FitResult:
        """Train for ``epochs`` passes or ``steps`` updates (exactly one of them); ``resume`` continues from
        the newest valid checkpoint in the run folder.

        A stop signal (``RunOptions.stop_signals``: Ctrl-C, SIGTERM, SIGUSR1) stops after the current update
        with a checkpoint; a second one stops at once, saving the last completed update's state.

        Raises:
            TrainingInterrupted: on a stop signal, after saving a checkpoint.
            ValueError: bad arguments.
            BadBatchError: a batch with non-finite inputs or loss under ``on_bad_batch="stop"`` (a ValueError).
        """
        total = self.total_steps(epochs, steps)
        self._start(total, resume, "steps" if steps is not None else "epochs")
        first = self.updates_done
        bar = ProgressBar(total, "training", self.run_options.progress and self.world.is_main, start=first)
        interval = LogInterval(self.log.records if resume else ())  # a resumed run's "time" goes on
        if resume:
            interval.carry_on(self.resumed_unrecorded)  # the loss since the checkpoint's last record
        self._interval = interval
        start = time.perf_counter()
        with self._lifecycle.running(total, bar):  # a stop signal ends fit with a checkpoint (TrainingInterrupted)
            with self.tracer or contextlib.nullcontext():
                # a stop ends the run after an update: an epoch that ran out in the middle of an accumulation
                # window goes on into the next epoch first (a checkpoint holds no window's gradients)
                while self.updates_done < total and not (self._lifecycle.stop_requested and self.mp.micro_step == 0):
                    self._run_epoch(total, interval, bar)
            self._lifecycle.updates_ended()  # past the last update the run ends whole; before it, a stop ends it
            seconds = time.perf_counter() - start
            self.save_checkpoint()
            evaluation = self._final_evaluation()
        self.log.close()
        return self._result(seconds, evaluation, first, resume)

    def _result(self, seconds: float, evaluation: dict[str, float], first: int, resumed: bool) -> FitResult:
        """What fit() returns (``first``: the update it started from): the medians of this fit's train records (a
        resumed run's earlier ones are another process's, on what may be another machine), the engine's
        statistics, the history."""
        train = [r for r in self.log.records if r["kind"] == "train"]
        own = [r for r in train if r["step"] > first]
        timed = [r["ms_per_step"] for r in own if r["ms_per_step"] > 0]
        return FitResult(
            steps=self.updates_done,
            epochs=self.epoch,
            seconds=seconds,
            train_loss=train[-1]["loss"] if train else math.nan,
            eval=evaluation,
            ms_per_step=float(np.median(timed)) if timed else math.nan,
            samples_per_s=float(np.median([r["samples_per_s"] for r in own])) if own else math.nan,
            stats=self.mp.stats(),
            history=list(self.log.records),
            run_dir=self.out_dir,
            resumed_from=first if resumed else None,
            timed_steps=self.updates_done - first if timed else 0,
        )

    def _start(self, total: int, resume: bool, given: str) -> None:
        """Where fit starts: the run's newest checkpoint, or a fresh seeded run."""
        if resume:
            self._resume()
            self.check_resume_length(total, self.updates_done, given)
        self._lifecycle.check_start(resumed=resume)  # half-updated weights go on only from a checkpoint
        if not resume:
            self.check_new_run()
            if self.updates_done == 0:  # a Trainer that trained already goes on with its own records
                self._set_aside_an_earlier_run()
            self._seed_everything()

    @staticmethod
    def check_resume_length(total: int, step: int, given: str) -> None:
        """Refuse to resume a run already past its target: ``--steps`` and ``--epochs`` are the run's total."""
        if total < step:
            more = "steps" if given == "steps" else "updates (its epochs)"
            raise ValueError(
                f"resume: the run is at update {step}, past the {total} {more} asked for; --{given} (fit({given}=...)) "
                f"counts the whole run, not the updates added: ask for more than {step} updates to continue it."
            )

    def total_steps(self, epochs: int | None = None, steps: int | None = None) -> int:
        """The updates ``fit(epochs=..., steps=...)`` runs to in all (exactly one of the two given)."""
        if (epochs is None) == (steps is None):
            raise ValueError(f"fit() takes exactly one of epochs= or steps=; received epochs={epochs}, steps={steps}.")
        value, name = (epochs, "epochs") if epochs is not None else (steps, "steps")
        whole_number(value, f"fit({name}=...)")
        if steps is not None:
            return steps
        try:
            batches = len(self.data.train_data)  # type: ignore[arg-type]
        except TypeError:
            raise ValueError("fit(epochs=...) needs TrainData.train_data with a length; pass steps= instead.") from None
        per_epoch = batches // self.mp.accumulation_steps
        if per_epoch < 1:
            raise ValueError(
                f"one epoch has {batches} batches, fewer than accumulation_steps={self.mp.accumulation_steps}: "
                "lower the batch size or the accumulation steps."
            )
        return epochs * per_epoch

    def check_new_run(self) -> None:
        """Refuse to start a fresh run in a folder that already holds one (its checkpoints would be lost)."""
        if self.checkpoint_dir is not None and list_checkpoints(self.checkpoint_dir):
            raise ValueError(
                f"{self.out_dir} already holds a run with checkpoints; resume it (resume=True; mixprec train "
                f"--out {self.out_dir} --resume) or choose a new folder."
            )

    def _set_aside_an_earlier_run(self) -> None:
        """A run in this folder that saved no checkpoint (killed before its first): its metrics are set aside,
        not mixed with this run's."""
        count, kept = self.log.set_aside()
        if count:
            logger.warning(
                "%s held %d metric records of an earlier run that saved no checkpoint; this run starts over, "
                "and they are kept in %s", self.out_dir, count, kept,
            )  # fmt: skip

    def _seed_everything(self) -> None:
        seed = self.run_options.seed
        torch.manual_seed(seed)
        random.seed(seed)
        np.random.seed(seed % 2**32)

    def _seed_epoch(self) -> None:
        generator = getattr(self.data.train_data, "generator", None)
        if isinstance(generator, torch.Generator):
            generator.manual_seed(self.run_options.seed * 1_000_003 + self.epoch)

    def _run_epoch(self, total: int, interval: LogInterval, bar: ProgressBar) -> None:
        """One pass over the training data (what is left of it, resumed mid-epoch), or up to the run's end."""
        self._seed_epoch()
        self.model.train()
        batches = iter(self.data.train_data)
        for _ in range(self.batch_in_epoch):  # resuming mid-epoch: replay the order, skip what was done
            next(batches)
        for inputs, targets, samples in self._ready(batches):
            self._freeze(self.updates_done < self.update_options.frozen_updates)
            with self.mp.autocast():
                loss = self.data.loss_fn(self._train_model(inputs), targets)
            if self.checks.check_inputs and not self._loss_ok(loss, inputs, targets):
                continue
            self.mp.backward(loss)
            if self.update_options.max_grad_norm is not None and self.mp.at_update_boundary:
                self.mp.clip_grad_norm_(self.update_options.max_grad_norm)
            interval.add(loss.detach(), samples)
            with self._lifecycle.update():  # a second stop signal waits: weights, schedule, position together
                result = self.mp.step()
                if not result.update_step:
                    continue
                self._on_update(result)
                self.updates_done += 1  # committed by the lifecycle as the update's section ends
            checkpoint_due = self._lifecycle.after_update()  # the same stop and checkpoint on every rank
            interval.updates += 1
            self._log_and_evaluate(total, interval, bar)
            if checkpoint_due:
                with interval.paused():
                    self.save_checkpoint()
            if self.updates_done >= total or self._lifecycle.stop_requested:
                break
        else:
            self._next_epoch()
            return
        if self._epoch_read():  # stopped on the epoch's last batch (or window): it is complete
            self._next_epoch()

    def _epoch_read(self) -> bool:
        """Whether the epoch's batches are all read, at an update: what is left is fewer than a window. An epoch
        shorter than one window (``fit(steps=...)`` only) leaves nothing out: its windows go on into the next."""
        length, window = _length(self.data.train_data), self.mp.accumulation_steps
        if length is None:
            return False
        if length < window:
            return self.batch_in_epoch >= length
        return self.mp.micro_step == 0 and length - self.batch_in_epoch < window

    def _freeze(self, frozen: bool) -> None:
        """The frozen phase's parameters without gradients (so without an update: under o2 their masters get no
        gradient either) while it lasts; from the first update after it, trained. Follows ``updates_done``, so a
        resumed run is in the same phase; the parameters are set when the phase changes, not at every batch."""
        if frozen == self._frozen_phase:
            return
        self._frozen_phase = frozen
        for param in self.update_options.frozen:
            param.requires_grad_(not frozen)

    def _ready(self, batches: Iterator) -> Iterator[tuple[Any, Any, int]]:
        """Each batch on the device with its sample count, counted in ``batch_in_epoch``: with non-finite inputs
        refused or dropped (:meth:`_inputs_ok`), under torchrun this rank's slice of it. An epoch's last batches,
        fewer than an accumulation window at an update, are left out (read by no window): so an epoch makes
        ``batches // accumulation_steps`` updates, as ``fit(epochs=...)`` counts them; a window carried into the next
        epoch made ``--epochs 2`` end one batch short of its second epoch."""
        while not self._epoch_read():
            try:
                inputs, targets = next(batches)
            except StopIteration:
                return
            self.batch_in_epoch += 1
            inputs, targets = to_device(inputs, self.device), to_device(targets, self.device)
            if self.checks.check_inputs and not self._inputs_ok(inputs):
                continue
            samples = batch_size(targets)
            if self.world.distributed:
                if not (samples := self._shared_samples(samples)):
                    continue
                inputs, targets = shard((inputs, targets), self.world.rank, self.world.size, samples)
            yield inputs, targets, samples

    def _shared_samples(self, samples: int) -> int:
        """Under torchrun, the samples of a batch the ranks train on: a multiple of the world size, said once
        per run where a batch (an epoch's last) loses some; 0 where it has fewer samples than ranks (dropped,
        as every rank reads the same batch, all of them drop it)."""
        kept = even_samples(samples, self.world.size)
        if kept < samples and not self._told_uneven and self.world.rank == 0:
            self._told_uneven = True
            logger.warning(
                "batch %d of epoch %d has %d samples for %d ranks: %s, so that every rank trains on an equal "
                "share (said once per run)", self.batch_in_epoch, self.epoch, samples, self.world.size,
                f"{samples - kept} of them dropped" if kept else "dropped",
            )  # fmt: skip
        return kept

    def _on_update(self, result: StepResult) -> None:
        """An update was made, applied or skipped: the tracer names where a skipped one's first inf/NaN appeared
        (and forgets the records of a clean one); the LR schedule steps (:meth:`MixedPrecision.step_scheduler`)."""
        if self.tracer is not None:
            if result:  # host sync, once per update (CPU optimizers sync for the skip decision anyway)
                self.tracer.clear()
            elif (event := self.tracer.check(step=self.updates_done + 1)) is not None:
                logger.warning("%s", event)
        if self.scheduler is not None:
            self.mp.step_scheduler(self.scheduler)

    def _log_and_evaluate(self, total: int, interval: LogInterval, bar: ProgressBar) -> None:
        """A train record every ``log_every`` updates and at the last; an evaluation every ``eval_every``."""
        if self.updates_done % self.run_options.log_every == 0 or self.updates_done == total:
            record = self._train_record(interval)
            bar.update(self.updates_done, loss=record["loss"], scale=record["scale"])
        every = self.run_options.eval_every
        if every and self.updates_done % every == 0 and self.data.eval_data is not None:
            with interval.paused():
                self._evaluate_and_log()

    def _next_epoch(self) -> None:
        ended_at = self.batch_in_epoch
        self.epoch += 1
        self.batch_in_epoch = 0
        self._lifecycle.epoch_ended(ended_at)

    def _inputs_ok(self, inputs: Any) -> bool:
        tensor = inputs if isinstance(inputs, torch.Tensor) else None
        if tensor is None or not tensor.is_floating_point() or bool(torch.isfinite(tensor).all()):  # host sync
            return True
        where = f"batch {self.batch_in_epoch} of epoch {self.epoch}"
        if self.checks.on_bad_batch == "stop":
            raise BadBatchError(
                f"{where} has NaN or inf in its inputs; refusing to train on it. Clean the data, or pass "
                "checks=BatchChecks(on_bad_batch='skip') (CLI: --skip-bad-batches) to drop such batches."
            )
        self.skipped_batches += 1
        logger.warning("Skipping %s: NaN or inf in its inputs (%d bad batches so far)", where, self.skipped_batches)
        return False

    def _loss_ok(self, loss: torch.Tensor, inputs: Any, targets: Any) -> bool:
        """A non-finite loss from finite inputs: the forward pass (or the loss) made an inf or NaN.
        Never train on it: stop naming the module where it first appeared, or drop the batch.

        One host sync per micro-batch (free on the CPU; on accelerators the step's skip decision
        syncs anyway). Under torchrun the ranks agree, so that all of them drop the same batch.
        """
        bad = (~torch.isfinite(loss.detach())).any().reshape(1).float()
        if self.world.distributed:
            bad = agree_max([bad])[0]
        if not bad.item():
            return True
        where = f"batch {self.batch_in_epoch} of epoch {self.epoch}"
        origin = self._nonfinite_origin(inputs, targets)
        if self.checks.on_bad_batch == "stop":
            fp16 = (
                " Under fp16 an activation above 65504 overflows where FP32 and bf16 hold it: `mixprec doctor` "
                "names the modules to keep in FP32, or train under a bf16 policy."
                if self.mp.policy.compute_dtype == torch.float16
                else ""
            )
            raise BadBatchError(
                f"{where}: {origin}; refusing to train on it. Fix the model or the data, or pass "
                f"checks=BatchChecks(on_bad_batch='skip') (CLI: --skip-bad-batches) to drop such batches.{fp16}"
            )
        self.skipped_batches += 1
        logger.warning("Skipping %s: %s (%d bad batches so far)", where, origin, self.skipped_batches)
        return False

    def _nonfinite_origin(self, inputs: Any, targets: Any) -> str:
        """Run the batch's forward again under a NonFiniteTracer (random state kept) and say where
        the first inf or NaN appeared."""
        devices = [self.device] if self.device.type == "cuda" else []
        with NonFiniteTracer(self.model) as tracer, torch.random.fork_rng(devices=devices), torch.no_grad():
            with self.mp.autocast():
                loss = self.data.loss_fn(self.model(inputs), targets)
            event = tracer.check(step=self.updates_done + 1)
        if event is not None:
            return f"the forward pass produced {event.kind} first in module '{event.module}' ({event.tensor})"
        kind = "nan" if bool(torch.isnan(loss).any()) else "inf"
        return f"the loss function produced {kind} from finite model outputs"

    def _train_record(self, interval: LogInterval) -> dict[str, Any]:
        if self.world.distributed and interval.loss is not None:  # every rank logs the mean over ranks
            interval.loss = reduce_across_ranks(interval.loss) / self.world.size
        stats = self.mp.stats()
        since = self.log.last_train_step
        record = {
            "kind": "train",
            "step": self.updates_done,
            "epoch": self.epoch,
            **interval.flush(),
            "scale": stats.scale,
            "skipped_steps": stats.skipped_steps,
            "skipped_at": [s + 1 for s in stats.recent_overflow_steps if s + 1 > since],
            "lr": float(self.optimizer.param_groups[0]["lr"]),
        }
        self.log.write(record)
        return record

    # -- evaluation ------------------------------------------------------------------------------
    def evaluate(self) -> dict[str, float]:
        """Mean loss (and the metric) over ``eval_data`` under the policy, without gradients."""
        data = self.data
        if data.eval_data is None:
            raise ValueError("evaluate() needs eval_data; the Trainer was built with TrainData(eval_data=None).")
        return evaluate(self.model, data.eval_data, data.loss_fn, data.metric, self.mp.autocast, self.device)

    def _final_evaluation(self) -> dict[str, float]:
        if self.data.eval_data is None:
            return {}
        last = self.log.records[-1] if self.log.records else None
        done = last is not None and last["kind"] == "eval" and last["step"] == self.updates_done  # just evaluated here
        if self.world.distributed:  # rank 0 holds the log (a resumed rank 1 holds none): its answer goes for
            # every rank, as evaluating is a collective under FSDP2 (and DDP's buffer broadcast)
            (needed,) = agree_max([torch.tensor(float(self.world.is_main and not done), device=self.device)])
            done = not bool(needed)  # host sync: once, at the end of fit()
        if done:
            return {k: v for k, v in last.items() if k not in ("kind", "step")} if last is not None else {}
        return self._evaluate_and_log()

    def _evaluate_and_log(self) -> dict[str, float]:
        result = self.evaluate()
        self.log.write({"kind": "eval", "step": self.updates_done, **result})
        return result

    # -- checkpoints -----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue bit-identically (:func:`mixprec.app.trainer_state.trainer_state`).

        With FSDP2 shards this is a collective: the full state is gathered to rank 0 (other ranks get
        empty model and optimizer entries). Checkpoints of such runs do not gather: each rank writes its
        own shards (:meth:`save_checkpoint`).
        """
        return trainer_state(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned; ValueError (with what does not fit) for anything else."""
        load_trainer_state(self, state)

    def unrecorded_loss(self) -> dict[str, Any] | None:
        """The loss since the last train record, for a checkpoint; None in a distributed run (each rank holds its
        own, and only rank 0 writes: the record after a resume there covers the batches since it)."""
        if self._interval is None or self.world.distributed:
            return None
        return self._interval.unrecorded()

    def save_checkpoint(self) -> Path | None:
        """Write a checkpoint: DDP and single processes from rank 0 (DDP ranks hold identical state);
        FSDP2 runs from every rank, each its own shards (a collective; see :mod:`mixprec.app.checkpoint`)."""
        if self.checkpoint_dir is None:
            return None
        with self._lifecycle.saving():  # a second stop signal lets the write (a collective, sharded) finish
            return write_trainer_checkpoint(self, self.checkpoint_dir)

    def _resume(self) -> None:
        if self.checkpoint_dir is None:
            raise ValueError("resume=True needs RunOptions(out_dir=...): the run folder that holds the checkpoints.")
        path, _ = restore_latest(self, self.checkpoint_dir, allow_foreign=self.run_options.allow_foreign_checkpoint)
        self.log.truncate_after(self.updates_done)
        logger.info("Resumed from %s (step %d, epoch %d)", path, self.updates_done, self.epoch)


def _check_settings(**settings: Any) -> None:
    """The Trainer's four settings, each of its frozen type (:mod:`mixprec.app.trainer_options`)."""
    kinds = {"data": TrainData, "update": UpdateOptions, "run": RunOptions, "checks": BatchChecks}
    for name, value in settings.items():
        kind = kinds[name]
        if not isinstance(value, kind):
            raise TypeError(
                f"Trainer({name}=...) needs a mixprec.app.{kind.__name__}; received {value!r} "
                f"(of type {type(value).__name__}). Build one: {name}={kind.__name__}(...)."
            )


def _length(data: Iterable) -> int | None:
    try:
        return len(data)  # type: ignore[arg-type]
    except TypeError:
        return None
