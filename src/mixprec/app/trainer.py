"""Trainer: a training loop for built-in tasks and simple user models, on top of MixedPrecision.

It has no numerics of its own: casting, scaling, skipping and master weights are MixedPrecision's.
What it adds: epochs and steps, evaluation, metrics (JSONL, TensorBoard), progress, checkpoints that
resume bit-identically, a clean stop on Ctrl-C, and a refusal to train on non-finite inputs.

Records in ``metrics.jsonl``:
    train  step, epoch, loss (mean since the last record), scale, skipped_steps (cumulative), skipped_at
           (steps skipped since the last record), samples_per_s, ms_per_step, lr, time (seconds)
    eval   step, loss, and the task's metric (e.g. accuracy)

Its settings are four frozen values (:mod:`mixprec.app.trainer_options`): TrainData, UpdateOptions,
RunOptions and BatchChecks.

Host syncs: one per logged step (the running loss), one per step for the input check
(``BatchChecks.check_inputs``), and those of MixedPrecision.step().
"""

from __future__ import annotations

import contextlib
import logging
import math
import random
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from mixprec.app.checkpoint import list_checkpoints, save_checkpoint, save_sharded_checkpoint
from mixprec.app.evaluate import batch_size, evaluate, to_device
from mixprec.app.metrics_log import MetricsLog
from mixprec.app.optimizer import KERNEL_CHOICES
from mixprec.app.progress import ProgressBar
from mixprec.app.resume import restore_latest, run_identity
from mixprec.app.rng_state import get_rng_state, set_rng_state
from mixprec.app.sharded_checkpoint import Shards, fill_sharded, load_sharded, split_sharded
from mixprec.app.stop_signals import StopRequest
from mixprec.app.torchrun import shard
from mixprec.app.trainer_options import BatchChecks, RunOptions, TrainData, UpdateOptions
from mixprec.checks import whole_number
from mixprec.compute import dropped_roundings_note
from mixprec.distributed.ranks import agree_max, copy_from_main, reduce_across_ranks, world
from mixprec.doctor.trace import NonFiniteTracer
from mixprec.engine.mixed_precision import MixedPrecision, StepResult
from mixprec.engine.stats import Stats
from mixprec.parallel.ddp import wrap_ddp
from mixprec.parallel.fsdp import is_sharded
from mixprec.parallel.state import gather_state, scatter_state, sharded_state
from mixprec.policy.policy import Policy

__all__ = ["FitResult", "Trainer", "TrainingInterrupted"]

logger = logging.getLogger("mixprec")


class TrainingInterrupted(Exception):
    """A stop signal during fit() (Ctrl-C, SIGTERM, SIGUSR1): a checkpoint was saved (when the run has a
    folder); ``checkpoint`` is its path, ``signal`` the signal's name."""

    def __init__(self, step: int, checkpoint: Path | None, signal: str = "SIGINT", cut_short: bool = False) -> None:
        by = "" if signal == "SIGINT" else f" by {signal}"
        if cut_short:  # in the middle of update step + 1: nothing saved from it
            saved = f" in the middle of an update; the newest checkpoint stands: {checkpoint}" if checkpoint else (
                " in the middle of an update; no checkpoint was made")  # fmt: skip
        else:
            saved = f"; checkpoint saved to {checkpoint}" if checkpoint else ""
        super().__init__(f"interrupted{by} at step {step}{saved}")
        self.step = step
        self.checkpoint = checkpoint
        self.signal = signal
        self.cut_short = cut_short  # True: update step + 1 was cut short, and ``checkpoint`` is an older one


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
        for name, value, kind in (
            ("data", data, TrainData),
            ("update", update, UpdateOptions),
            ("run", run, RunOptions),
            ("checks", checks, BatchChecks),
        ):
            if not isinstance(value, kind):
                raise TypeError(
                    f"Trainer({name}=...) needs a mixprec.app.{kind.__name__}; received {value!r} "
                    f"(of type {type(value).__name__}). Build one: {name}={kind.__name__}(...)."
                )
        self.model = model
        # under torchrun: DDP (or FSDP2 shards) for the training forward, a slice of every batch, files
        # from rank 0 only
        self.world = world()
        if self.world.distributed and not is_sharded(model):  # the masters from the weights DDP will broadcast
            copy_from_main([*model.parameters(), *model.buffers()])
        self.mp = MixedPrecision(model, optimizer, policy, update.scaler, accumulation_steps=update.accumulation_steps)
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
        self.data, self.update, self.run, self.checks = data, update, run, checks
        self.out_dir = Path(run.out_dir) if run.out_dir is not None else None
        # where the first inf/NaN of each skipped step appeared (mixprec.doctor.NonFiniteTracer)
        self.tracer = NonFiniteTracer(model) if checks.trace_nonfinite else None
        self.step = 0  # applied or skipped updates so far
        self.epoch = 0
        self.batch_in_epoch = 0  # micro-batches consumed in the current epoch
        self._committed = (0, 0)  # (epoch, batch_in_epoch) after the last completed update: where a resume starts
        self._committed_rng: dict[str, Any] | None = None  # the random state there
        self._committed_buffers: list[torch.Tensor] = []  # and the model's buffers (e.g. batch-norm statistics)
        self._half_updated = False  # an update was cut short: the weights are neither before nor after it
        self._stop = StopRequest(run.stop_signals)  # set by a stop signal (Ctrl-C, SIGTERM, SIGUSR1)
        self._saved_at = time.monotonic()  # for RunOptions(checkpoint_every_minutes=...)
        self.skipped_batches = 0  # bad input batches dropped with BatchChecks(on_bad_batch="skip")
        if self.out_dir is not None:
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
            ValueError: bad arguments, or a batch with non-finite inputs under ``on_bad_batch="stop"``.
        """
        total = self.total_steps(epochs, steps)
        self._start(total, resume, "steps" if steps is not None else "epochs")
        first_step = self.step
        self._stop, self._saved_at = StopRequest(self.run.stop_signals), time.monotonic()
        bar = ProgressBar(total, "training", self.run.progress and self.world.is_main)
        window = self._window(resume)
        start = time.perf_counter()
        with self._stop.handlers():  # until fit ends: no stop signal ends it without a checkpoint
            try:
                with self.tracer or contextlib.nullcontext():
                    # a stop ends the run after an update: an epoch that ran out in the middle of an accumulation
                    # window goes on into the next epoch first (a checkpoint holds no window's gradients)
                    while self.step < total and not (self._stop.requested and self.mp.micro_step == 0):
                        self._run_epoch(total, window, bar)
                bar.close()
                if self._stop.requested and self.step < total:  # past the last update, the run ends whole
                    raise self._stopped(self._stop.signal)
                seconds = time.perf_counter() - start
                self._stop.finishing = True
                self.save_checkpoint()
                evaluation = self._final_evaluation()
            except KeyboardInterrupt:  # a second stop signal, or a Ctrl-C raised from inside a step
                self._stop.ending()  # a further signal now would end fit without a checkpoint
                bar.close()
                if self._stop.cut_mid_update:
                    raise self._cut_short(self._stop.signal or "SIGINT") from None
                self._restore_committed()
                raise self._stopped(self._stop.signal or "SIGINT", at_once=True) from None
            finally:
                bar.close()
                self._half_updated = self._half_updated or self._stop.cut_mid_update
        self.log.close()
        train = [r for r in self.log.records if r["kind"] == "train"]
        timed = [r["ms_per_step"] for r in train if r["ms_per_step"] > 0]
        return FitResult(
            steps=self.step,
            epochs=self.epoch,
            seconds=seconds,
            train_loss=train[-1]["loss"] if train else math.nan,
            eval=evaluation,
            ms_per_step=float(np.median(timed)) if timed else math.nan,
            samples_per_s=float(np.median([r["samples_per_s"] for r in train])) if train else math.nan,
            stats=self.mp.stats(),
            history=list(self.log.records),
            run_dir=self.out_dir,
            resumed_from=first_step if resume else None,
            timed_steps=self.step - first_step if timed else 0,
        )

    def _start(self, total: int, resume: bool, given: str) -> None:
        """Where fit starts: the run's newest checkpoint, or a fresh seeded run; remembered as committed."""
        if resume:
            self._resume()
            self.check_resume_length(total, self.step, given)
            self._half_updated = False
        else:
            if self._half_updated:
                raise ValueError(
                    "fit(): this Trainer's last update was cut short, so its weights are half updated; continue "
                    "from the newest checkpoint with fit(..., resume=True), or build a new Trainer."
                )
            self.check_new_run()
            if self.step == 0:  # a Trainer that trained already goes on with its own records
                self._set_aside_an_earlier_run()
            self._seed_everything()
        self.mp.zero_grad()  # nothing of an interrupted fit's window is carried in
        self._commit()  # the state a stop at once in the first update goes back to (buffers, random state)

    def _window(self, resume: bool) -> _Window:
        """The train records' window; a resumed run's "time" goes on from where its records stop."""
        earlier = next((r.get("time", 0.0) for r in reversed(self.log.records) if r["kind"] == "train"), 0.0)
        return _Window(time.perf_counter(), earlier if resume else 0.0)

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
        seed = self.run.seed
        torch.manual_seed(seed)
        random.seed(seed)
        np.random.seed(seed % 2**32)

    def _seed_epoch(self) -> None:
        generator = getattr(self.data.train_data, "generator", None)
        if isinstance(generator, torch.Generator):
            generator.manual_seed(self.run.seed * 1_000_003 + self.epoch)

    def _trace(self, result: StepResult) -> None:
        """Name where a skipped step's first inf/NaN appeared; forget the records of a clean step."""
        if result:  # host sync, once per update (CPU optimizers sync for the skip decision anyway)
            self.tracer.clear()
            return
        event = self.tracer.check(step=self.step + 1)
        if event is not None:
            logger.warning("%s", event)

    def _run_epoch(self, total: int, window: _Window, bar: ProgressBar) -> None:
        self._seed_epoch()
        self.model.train()
        batches = iter(self.data.train_data)
        for _ in range(self.batch_in_epoch):  # resuming mid-epoch: replay the order, skip what was done
            next(batches)
        for inputs, targets in batches:
            self.batch_in_epoch += 1
            inputs, targets = to_device(inputs, self.device), to_device(targets, self.device)
            if self.checks.check_inputs and not self._inputs_ok(inputs):
                continue
            samples = batch_size(targets)
            if self.world.distributed:
                inputs, targets = shard((inputs, targets), self.world.rank, self.world.size)
            with self.mp.autocast():
                loss = self.data.loss_fn(self._train_model(inputs), targets)
            if self.checks.check_inputs and not self._loss_ok(loss, inputs, targets):
                continue
            self.mp.backward(loss)
            if self.update.max_grad_norm is not None and self.mp.at_update_boundary:
                self.mp.clip_grad_norm_(self.update.max_grad_norm)
            window.add(loss.detach(), samples)
            with self._stop.shield(update=True):  # a second stop signal waits: weights, schedule, position together
                result = self.mp.step()
                if not result.update_step:
                    continue
                if self.tracer is not None:
                    self._trace(result)
                if self.scheduler is not None:
                    self.mp.step_scheduler(self.scheduler)
                self.step += 1
                self._commit()
                self._stop.finishing = self.step >= total  # a signal from now on: the run still ends whole
            due = self._checkpoint_due()
            if self.world.distributed:
                due = self._stop.agree(self.device, due)  # the same stop and checkpoint on every rank
            window.updates += 1
            if self.step % self.run.log_every == 0 or self.step == total:
                record = self._train_record(window)
                bar.update(self.step, loss=record["loss"], scale=record["scale"])
            if self.run.eval_every and self.step % self.run.eval_every == 0 and self.data.eval_data is not None:
                self._evaluate_and_log()
            if due or (self.run.checkpoint_every and self.step % self.run.checkpoint_every == 0):
                self.save_checkpoint()
            if self.step >= total or self._stop.requested:
                break
        else:
            self._next_epoch()
            return
        if self.batch_in_epoch == _length(self.data.train_data):  # stopped on the epoch's last batch: it is complete
            self._next_epoch()

    def _stopped(self, signal: str, *, at_once: bool = False) -> TrainingInterrupted:
        """Save a checkpoint and close the log; the exception that ends fit() on a stop signal."""
        if at_once and self.mp.sharded and self.world.distributed:
            # a sharded checkpoint is a collective the other ranks may never join now: keep the last
            # periodic checkpoint rather than hang
            logger.warning("Stopped at once: the FSDP2 ranks cannot save together now; the last checkpoint stands")
            checkpoint = None
        else:
            self._stop.ending()
            checkpoint = self.save_checkpoint()
        self.log.close()
        return TrainingInterrupted(self.step, checkpoint, signal)

    def _cut_short(self, signal: str) -> TrainingInterrupted:
        """A Ctrl-C outside the stop signals cut an update short: its weights are half updated, so no checkpoint is
        made from them; the newest one stands."""
        self.log.close()
        newest = next(reversed(list_checkpoints(self.checkpoint_dir)), None) if self.checkpoint_dir else None
        logger.warning("Stopped in the middle of an update: no checkpoint made from its half-updated weights; "
                       "the newest one stands (%s)", newest)  # fmt: skip
        return TrainingInterrupted(self.step, newest, signal, cut_short=True)

    def _checkpoint_due(self) -> bool:
        """Whether ``RunOptions(checkpoint_every_minutes=...)`` of wall clock passed since the last save."""
        minutes = self.run.checkpoint_every_minutes
        return minutes is not None and time.monotonic() - self._saved_at >= minutes * 60

    def _commit(self) -> None:
        """Remember where a resume would start: position, random state, buffers (after each update)."""
        self._committed, self._committed_rng = (self.epoch, self.batch_in_epoch), get_rng_state()
        buffers = [b for b in self.model.buffers()]
        if len(self._committed_buffers) != len(buffers):
            self._committed_buffers = [b.detach().clone() for b in buffers]
        elif buffers:
            torch._foreach_copy_(self._committed_buffers, [b.detach() for b in buffers])

    def _restore_committed(self) -> None:
        """Undo an unfinished window, so that the checkpoint resumes exactly at the last update."""
        self.mp.zero_grad()
        self.epoch, self.batch_in_epoch = self._committed
        if self._committed_rng is not None:
            set_rng_state(self._committed_rng)
        with torch.no_grad():
            for buffer, saved in zip(self.model.buffers(), self._committed_buffers, strict=False):
                buffer.copy_(saved)

    def _next_epoch(self) -> None:
        self.epoch += 1
        self.batch_in_epoch = 0
        if self._committed[1] == _length(self.data.train_data):
            self._committed = (self.epoch, 0)

    def _inputs_ok(self, inputs: Any) -> bool:
        tensor = inputs if isinstance(inputs, torch.Tensor) else None
        if tensor is None or not tensor.is_floating_point() or bool(torch.isfinite(tensor).all()):  # host sync
            return True
        where = f"batch {self.batch_in_epoch} of epoch {self.epoch}"
        if self.checks.on_bad_batch == "stop":
            raise ValueError(
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
            raise ValueError(
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
            event = tracer.check(step=self.step + 1)
        if event is not None:
            return f"the forward pass produced {event.kind} first in module '{event.module}' ({event.tensor})"
        kind = "nan" if bool(torch.isnan(loss).any()) else "inf"
        return f"the loss function produced {kind} from finite model outputs"

    def _train_record(self, window: _Window) -> dict[str, Any]:
        if self.world.distributed and window.loss is not None:  # every rank logs the mean over ranks
            window.loss = reduce_across_ranks(window.loss) / self.world.size
        stats = self.mp.stats()
        since = self.log.last_train_step
        record = {
            "kind": "train",
            "step": self.step,
            "epoch": self.epoch,
            **window.flush(),
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
        done = last is not None and last["kind"] == "eval" and last["step"] == self.step  # just evaluated here
        if self.world.distributed:  # rank 0 holds the log (a resumed rank 1 holds none): its answer goes for
            # every rank, as evaluating is a collective under FSDP2 (and DDP's buffer broadcast)
            (needed,) = agree_max([torch.tensor(float(self.world.is_main and not done), device=self.device)])
            done = not bool(needed)  # host sync: once, at the end of fit()
        if done:
            return {k: v for k, v in last.items() if k not in ("kind", "step")} if last is not None else {}
        return self._evaluate_and_log()

    def _evaluate_and_log(self) -> dict[str, float]:
        result = self.evaluate()
        self.log.write({"kind": "eval", "step": self.step, **result})
        return result

    # -- checkpoints -----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue bit-identically.

        With FSDP2 shards this is a collective: the full state is gathered to rank 0 (other ranks get
        empty model and optimizer entries). Checkpoints of such runs do not gather: each rank writes its
        own shards (:meth:`save_checkpoint`).
        """
        if self.mp.sharded:
            model_state, optimizer_state = gather_state(self.model, self.optimizer)
        else:
            model_state, optimizer_state = self.model.state_dict(), self.optimizer.state_dict()
        return {"model": model_state, "optimizer": optimizer_state, **self._run_state()}

    def _run_state(self) -> dict[str, Any]:
        """The state besides the model's and the optimizer's: the same on every rank (rank 0's RNG)."""
        return {
            "identity": run_identity(self),  # checked on resume: a checkpoint of another run is refused
            "sharded": self.mp.sharded,  # FSDP2: tensors keyed by name, whole or in a sharded checkpoint
            "mixed_precision": self.mp.state_dict(),
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "rng": get_rng_state(),
            "position": {
                "step": self.step,
                "epoch": self.epoch,
                "batch_in_epoch": self.batch_in_epoch,
                "skipped_batches": self.skipped_batches,
                "seed": self.run.seed,
            },
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned; ValueError (with what does not fit) for anything else."""
        if not isinstance(state, dict):
            raise ValueError(f"a training state is a dict; received {type(state).__name__}.")
        if bool(state.get("sharded", False)) != self.mp.sharded:
            saved, here = ("an FSDP2", "without FSDP2") if state.get("sharded") else ("a non-sharded", "under FSDP2")
            raise ValueError(
                f"the checkpoint comes from {saved} run and this one runs {here}; resume it the way it was "
                "trained (mixprec train --parallel fsdp under torchrun, with any number of ranks, or without)."
            )
        try:
            if self.mp.sharded:  # a collective: every rank keeps its own shards
                self._load_sharded_model(state)
            else:
                self.model.load_state_dict(state["model"])
            self.mp.load_state_dict(state["mixed_precision"])  # after the model: masters overwrite lowered weights
            if not self.mp.sharded:
                kernels = [{k: g[k] for k in KERNEL_CHOICES if k in g} for g in self.optimizer.param_groups]
                self.optimizer.load_state_dict(state["optimizer"])
                for group, kept in zip(self.optimizer.param_groups, kernels, strict=True):
                    group.update(kept)  # this run's update kernel (fused), not the saved run's
            if self.scheduler is not None and state["scheduler"] is not None:
                self.scheduler.load_state_dict(state["scheduler"])
            set_rng_state(state["rng"])
            position = state["position"]
            if not all(type(position[k]) is int and position[k] >= 0 for k in _POSITION):
                raise TypeError(f"position {position!r}: expected whole numbers >= 0 for {', '.join(_POSITION)}")
        except (KeyError, RuntimeError, TypeError, AttributeError, IndexError, ValueError) as exc:
            raise ValueError(
                f"the checkpoint does not fit this model and optimizer: {type(exc).__name__}: {exc}"
            ) from None
        self.step, self.epoch = position["step"], position["epoch"]
        self.batch_in_epoch, self.skipped_batches = position["batch_in_epoch"], position["skipped_batches"]
        self._committed = (self.epoch, self.batch_in_epoch)

    def _load_sharded_model(self, state: dict[str, Any]) -> None:
        """The model's and optimizer's state into the FSDP2 shards: from a sharded checkpoint's files (at
        any world size: each rank reads its part), or from a whole-model file of an earlier version."""
        shards = state.get("shards")
        if not isinstance(shards, Shards):
            scatter_state(self.model, self.optimizer, state["model"], state["optimizer"])
            return
        model_now, optimizer_now = sharded_state(self.model, self.optimizer)
        targets, _ = split_sharded({"model": model_now, "optimizer": optimizer_now})
        load_sharded(shards, targets)  # in place, into this rank's shards
        saved = fill_sharded({"model": state["model"], "optimizer": state["optimizer"]}, targets)
        scatter_state(self.model, self.optimizer, saved["model"], saved["optimizer"], full=False)

    def save_checkpoint(self) -> Path | None:
        """Write a checkpoint: DDP and single processes from rank 0 (DDP ranks hold identical state);
        FSDP2 runs from every rank, each its own shards (a collective; see :mod:`mixprec.app.checkpoint`)."""
        if self.checkpoint_dir is None:
            return None
        self._saved_at = time.monotonic()
        keep = self.run.keep_checkpoints
        with self._stop.shield():  # a second stop signal lets the write (a collective, sharded) finish
            if self.mp.sharded:
                model_state, optimizer_state = sharded_state(self.model, self.optimizer)
                state = {"model": model_state, "optimizer": optimizer_state, **self._run_state()}
                return save_sharded_checkpoint(self.checkpoint_dir, self.step, state, keep=keep, device=self.device)
            if not self.world.is_main:
                return None
            return save_checkpoint(self.checkpoint_dir, self.step, self.state_dict(), keep=keep)

    def _resume(self) -> None:
        if self.checkpoint_dir is None:
            raise ValueError("resume=True needs RunOptions(out_dir=...): the run folder that holds the checkpoints.")
        path, _ = restore_latest(self, self.checkpoint_dir, allow_foreign=self.run.allow_foreign_checkpoint)
        self.log.truncate_after(self.step)
        logger.info("Resumed from %s (step %d, epoch %d)", path, self.step, self.epoch)


_POSITION = ("step", "epoch", "batch_in_epoch", "skipped_batches")


class _Window:
    """Running loss, samples and time since the last train record (the loss stays on the device)."""

    def __init__(self, now: float, earlier: float = 0.0) -> None:
        """``earlier``: seconds of training before this fit (a resumed run's), where "time" starts."""
        self.start, self.loss, self.batches, self.samples, self.updates = now, None, 0, 0, 0
        self.origin = now - earlier

    def add(self, loss: torch.Tensor, samples: int) -> None:
        self.loss = loss.float() if self.loss is None else self.loss + loss.float()
        self.batches += 1
        self.samples += samples

    def flush(self) -> dict[str, float]:
        now = time.perf_counter()
        elapsed = max(now - self.start, 1e-9)
        loss = float(self.loss) / self.batches if self.batches else math.nan  # host sync: once per record
        record = {
            "loss": loss,
            "samples_per_s": self.samples / elapsed,
            "ms_per_step": 1e3 * elapsed / max(self.updates, 1),
            "time": now - self.origin,
        }
        self.start, self.loss, self.batches, self.samples, self.updates = now, None, 0, 0, 0
        return record


def _length(data: Iterable) -> int | None:
    try:
        return len(data)  # type: ignore[arg-type]
    except TypeError:
        return None
