"""The Trainer's settings as four frozen values: what to learn from, how to update, the run, the guards.

Each checks its own fields when built, so a bad setting is refused where it is written, naming the
field and echoing what was received.

Example:
    >>> RunOptions(out_dir="runs/mine", log_every=5).keep_checkpoints
    3
    >>> RunOptions(log_every=0)
    Traceback (most recent call last):
    ...
    ValueError: RunOptions(log_every=...) must be an integer >= 1; received 0 (of type int).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mixprec.app.config import SEED_LIMIT
from mixprec.app.stop_signals import DEFAULT_STOP_SIGNALS, check_stop_signals
from mixprec.app.task import Metric
from mixprec.checks import flag, positive_number, whole_number
from mixprec.scaling import LossScaler

__all__ = ["BAD_BATCH_ACTIONS", "BatchChecks", "RunOptions", "TrainData", "UpdateOptions"]

BAD_BATCH_ACTIONS = ("stop", "skip")


@dataclass(frozen=True)
class TrainData:
    """What to train on and how to score it.

    Args:
        train_data, eval_data: re-iterable batches of ``(inputs, targets)`` (e.g. DataLoaders);
            ``eval_data`` may be None (no evaluation).
        loss_fn: ``loss_fn(model(inputs), targets)`` -> scalar loss.
        metric: an evaluation metric (:data:`mixprec.app.accuracy`, :data:`mixprec.app.bits_per_char`),
            or None.
    """

    train_data: Iterable
    eval_data: Iterable | None
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor]
    metric: Metric | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.train_data, Iterable):
            raise TypeError(_expected("TrainData(train_data=...)", self.train_data, "re-iterable batches"))
        if self.eval_data is not None and not isinstance(self.eval_data, Iterable):
            raise TypeError(_expected("TrainData(eval_data=...)", self.eval_data, "re-iterable batches or None"))
        if not callable(self.loss_fn):
            raise TypeError(_expected("TrainData(loss_fn=...)", self.loss_fn, "a function (outputs, targets) -> loss"))
        if self.metric is not None and not isinstance(self.metric, Metric):
            raise TypeError(_expected("TrainData(metric=...)", self.metric, "a mixprec.app.Metric or None"))


@dataclass(frozen=True)
class UpdateOptions:
    """How each update is made; passed on to :class:`mixprec.MixedPrecision` and its clipping.

    Args:
        scaler: a LossScaler (None: the policy's default, dynamic for fp16).
        max_grad_norm: clip the true (unscaled) gradient norm to this (None: no clipping).
        accumulation_steps: micro-batches per update.
        reduce_in_fp32: under torchrun with DDP, average 16-bit gradients in FP32 (for FSDP2, pass
            ``reduce_dtype=torch.float32`` to :func:`mixprec.fully_shard`).
        frozen, frozen_updates: fine-tuning's first phase, as fastai's ``fine_tune``: the parameters in
            ``frozen`` (a pretrained body) get no gradient and no update during the first ``frozen_updates``
            updates, then train with the rest.
    """

    scaler: LossScaler | None = None
    max_grad_norm: float | None = None
    accumulation_steps: int = 1
    reduce_in_fp32: bool = False
    frozen: tuple[torch.nn.Parameter, ...] = ()
    frozen_updates: int = 0

    def __post_init__(self) -> None:
        if self.scaler is not None and not isinstance(self.scaler, LossScaler):
            raise TypeError(
                _expected("UpdateOptions(scaler=...)", self.scaler, "a mixprec LossScaler, or None for the default")
            )
        if self.max_grad_norm is not None:
            _with_hint(positive_number, self.max_grad_norm, "UpdateOptions(max_grad_norm=...)", "not clip")
        whole_number(self.accumulation_steps, "UpdateOptions(accumulation_steps=...)")
        flag(self.reduce_in_fp32, "UpdateOptions(reduce_in_fp32=...)")
        whole_number(self.frozen_updates, "UpdateOptions(frozen_updates=...)", minimum=0)


@dataclass(frozen=True)
class RunOptions:
    """The run folder and the cadence of logs, evaluations and checkpoints.

    Args:
        out_dir: the run folder for metrics, checkpoints and TensorBoard (None: nothing written).
        seed: seeds the data order of every epoch (via the data's ``generator``) and the global RNGs.
        eval_every, log_every, checkpoint_every: in updates (None for eval and checkpoints: only at the end).
        keep_checkpoints: how many checkpoints to keep.
        checkpoint_every_minutes: also checkpoint when this much wall-clock time passed since the last
            save (None: by updates only). Under torchrun the ranks agree on it.
        stop_signals: signal names that stop the run after the current update with a checkpoint
            (default Ctrl-C, SIGTERM, SIGUSR1); the others keep their usual effect.
        allow_foreign_checkpoint: resume from a checkpoint whose run identity (policy, seed, model,
            optimizer settings) differs from this run's, with a warning, instead of refusing.
        progress: show a progress bar.
        compile: run the training forward through ``torch.compile`` (the model and mixprec's region trace
            without graph breaks; the first steps pay for compilation). Evaluation stays eager.
    """

    out_dir: str | Path | None = None
    seed: int = 0
    eval_every: int | None = None
    log_every: int = 10
    checkpoint_every: int | None = None
    keep_checkpoints: int = 3
    checkpoint_every_minutes: float | None = None
    stop_signals: tuple[str, ...] = DEFAULT_STOP_SIGNALS
    allow_foreign_checkpoint: bool = False
    progress: bool = True
    compile: bool = False

    def __post_init__(self) -> None:
        if self.out_dir is not None and not isinstance(self.out_dir, (str, Path)):
            raise TypeError(_expected("RunOptions(out_dir=...)", self.out_dir, "a folder path (str or Path) or None"))
        if isinstance(self.seed, bool) or not isinstance(self.seed, int):
            raise TypeError(_expected("RunOptions(seed=...)", self.seed, "an integer"))
        if not 0 <= self.seed < SEED_LIMIT:
            raise ValueError(f"RunOptions(seed=...) must be from 0 to 2**32 - 1; received {self.seed}.")
        for name, end in (("eval_every", "evaluate"), ("checkpoint_every", "checkpoint")):
            value = getattr(self, name)
            if value is not None:
                _with_hint(whole_number, value, f"RunOptions({name}=...)", f"{end} only at the end")
        whole_number(self.log_every, "RunOptions(log_every=...)")
        whole_number(self.keep_checkpoints, "RunOptions(keep_checkpoints=...)")
        minutes = self.checkpoint_every_minutes
        if minutes is not None and (isinstance(minutes, bool) or not isinstance(minutes, (int, float))):
            what = "RunOptions(checkpoint_every_minutes=...)"
            raise TypeError(_expected(what, minutes, "a number of minutes or None"))
        if minutes is not None and not 0 < minutes < math.inf:
            raise ValueError(
                f"RunOptions(checkpoint_every_minutes=...) must be a positive, finite number of minutes; received "
                f"{minutes!r}. Pass None to checkpoint by updates only."
            )
        object.__setattr__(self, "stop_signals", check_stop_signals(self.stop_signals, "RunOptions(stop_signals=...)"))
        flag(self.allow_foreign_checkpoint, "RunOptions(allow_foreign_checkpoint=...)")
        flag(self.progress, "RunOptions(progress=...)")
        flag(self.compile, "RunOptions(compile=...)")


@dataclass(frozen=True)
class BatchChecks:
    """The guards against training on bad batches.

    Args:
        check_inputs: refuse batches whose inputs hold NaN or inf, or whose loss does (the forward pass
            made one: the first module to produce it is named).
        on_bad_batch: "stop" with that message, or "skip" the batch (counted in ``trainer.skipped_batches``).
        trace_nonfinite: name the module and phase of each skipped step's first inf or NaN.
    """

    check_inputs: bool = True
    on_bad_batch: str = "stop"
    trace_nonfinite: bool = False

    def __post_init__(self) -> None:
        flag(self.check_inputs, "BatchChecks(check_inputs=...)")
        if self.on_bad_batch not in BAD_BATCH_ACTIONS:
            raise ValueError(
                f"BatchChecks(on_bad_batch=...): received {self.on_bad_batch!r} "
                f"(of type {type(self.on_bad_batch).__name__}); use {' or '.join(map(repr, BAD_BATCH_ACTIONS))}."
            )
        flag(self.trace_nonfinite, "BatchChecks(trace_nonfinite=...)")


def _expected(what: str, value: Any, expected: str) -> str:
    return f"{what} needs {expected}; received {value!r} (of type {type(value).__name__})."


def _with_hint(check: Callable[[Any, str], Any], value: Any, what: str, none_means: str) -> None:
    """``check(value, what)``, its error extended by what None would do instead."""
    try:
        check(value, what)
    except ValueError as exc:
        raise ValueError(f"{exc} Pass None to {none_means}.") from None
