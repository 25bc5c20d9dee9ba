"""Bookkeeping of applied and skipped steps: counts, recent overflows, inf or NaN, log lines, the floor diagnosis.

MixedPrecision hands over what a step found (:class:`FoundInf`), the gradients it unscaled (to tell inf from
NaN) and the scales around their update; everything here exists for ``stats()`` and the log. Records may
arrive as device tensors; they are read on the host when flushed (every step on CPU, where reading is free;
in batches on accelerators, so that training never waits on them).
"""

from __future__ import annotations

import functools
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from mixprec.checks import whole_number
from mixprec.distributed.ranks import agree_max, world
from mixprec.numerics.finite import kinds_of, max_magnitudes, nonfinite_kinds
from mixprec.scaling.dynamic import DynamicLossScaler

__all__ = ["FoundInf", "OverflowLog", "StepRecord"]

logger = logging.getLogger("mixprec")

_FIRST_MESSAGES = 10  # overflow lines logged in full before rate limiting starts
_MIN_SECONDS_BETWEEN = 30.0
_FLUSH_EVERY = 64  # steps between host reads of the records on accelerators


@dataclass(frozen=True)
class FoundInf:
    """One update's found-inf flags: per loss on the device (agreed over ranks), and their one host read."""

    per_loss: list[torch.Tensor]
    host: list[bool] | None  # None: not read, because a fused optimizer skips on the device

    @functools.cached_property
    def found(self) -> bool | torch.Tensor:
        """Whether any loss overflowed: a bool once read, else a device flag."""
        if self.host is not None:
            return any(self.host)
        return self.per_loss[0] if len(self.per_loss) == 1 else torch.stack(self.per_loss).amax(0)


@dataclass
class StepRecord:
    """One update step; tensor fields may still live on the device."""

    step: int
    found: bool | torch.Tensor
    has_inf: bool | torch.Tensor | None
    has_nan: bool | torch.Tensor | None
    scales_before: list[torch.Tensor | float]
    scales_after: list[torch.Tensor | float]
    found_per_loss: list[bool | torch.Tensor]
    underflow: bool | torch.Tensor = False  # every gradient zero at a collapsed scale, the loss finite and non-zero


def _host(value: Any) -> Any:
    return value.item() if isinstance(value, torch.Tensor) else value  # host sync when on a device


class OverflowLog:
    """The statistics of the steps so far, and the inf-or-NaN kinds of the update window in progress.

    Args:
        scalers: the loss scalers, one per loss (their scales are snapshot around each update).
        history: how many recent overflow steps to keep.
        device: the training device; on the CPU every value is read at once (a memory load).
    """

    def __init__(self, scalers: list, history: int = 32, device: torch.device | None = None) -> None:
        self._scalers = scalers
        self._device = device if device is not None else torch.device("cpu")
        self._reads_free = self._device.type == "cpu"
        self._flush_every = 1 if self._reads_free else _FLUSH_EVERY
        self.steps = 0
        self.skipped_steps = 0
        self.inf_steps = 0
        self.nan_steps = 0
        self.underflow_steps = 0
        self._collapsed = False  # a dynamic scale below 1 as of the last accounted step: watch for underflow
        self._underflow: torch.Tensor | None = None  # this update's underflow flag, while it is watched
        self.recent_overflow_steps: deque[int] = deque(maxlen=history)
        self._floor: tuple[float, bool] | None = None  # (scale, dynamic) when the scale first could not cure
        self._saved_diagnosis: str | None = None  # the text of a state saved before _floor was kept
        self._kinds: tuple[torch.Tensor, torch.Tensor] | None = None  # (has_inf, has_nan) of this window
        self._pending: list[StepRecord] = []
        self._logged = 0
        self._suppressed = 0
        self._last_log = float("-inf")

    # -- the window in progress ---------------------------------------------------------------
    def classify(
        self,
        grads: Sequence[torch.Tensor],
        found: torch.Tensor,
        host: bool | None = None,
        magnitudes: torch.Tensor | None = None,
    ) -> None:
        """Tell inf from NaN in just-unscaled ``grads`` (``found``: their flag), before clipping or summing
        can turn one into the other.

        Only flagged gradients need the pass: clean ones cost nothing where the flag is known (``host``,
        read already) or free to read (the CPU); elsewhere it runs on the device every time, so that
        nothing waits, unless the check read the gradients' ``magnitudes`` already (no pass at all then).
        """
        if host is None and self._reads_free:
            host = bool(found.item())  # a memory load on the CPU
        if host is not None and not host:
            return
        has_inf, has_nan = nonfinite_kinds(grads, self._device) if magnitudes is None else kinds_of(magnitudes)
        if self._kinds is not None:
            has_inf, has_nan = has_inf | self._kinds[0], has_nan | self._kinds[1]
        self._kinds = (has_inf, has_nan)

    def agree_kinds(self) -> None:
        """Every rank's kinds become their union (one all-reduce of two numbers; nothing in one process);
        called for sharded models, whose ranks each check a different part of every gradient.

        Under FSDP2 each rank checks its own shard of every gradient, so a NaN in one rank's shard
        skips the update on every rank while the others saw only finite values: without this, they
        would count that skip as inf (a flagged step without a NaN of its own), and rank 0's report is
        the one printed.
        """
        if not world().distributed:
            return
        none = torch.zeros((), dtype=torch.bool, device=self._device)
        has_inf, has_nan = self._kinds or (none, none)
        flags = [torch.as_tensor(has_inf, device=self._device), torch.as_tensor(has_nan, device=self._device)]
        has_inf, has_nan = agree_max(flags)
        self._kinds = (has_inf.bool(), has_nan.bool())

    def watch_underflow(self, gradients: Callable[[], Sequence[torch.Tensor]], loss: torch.Tensor | None) -> None:
        """After a collapse (a dynamic scale below 1), flag an update whose unscaled gradients are all zero
        although the loss is finite and non-zero: fp16 underflow, which would otherwise count as a normal
        step. One max-magnitude pass over the gradients, only while the scale is collapsed (``gradients`` is
        called only then: listing them is per-parameter Python)."""
        if not self._collapsed or loss is None:
            return
        grads = gradients()
        if not grads:
            return
        amax = max_magnitudes(grads, self._device)
        loss = loss.float().to(self._device)
        self._underflow = (amax.max() == 0) & torch.isfinite(loss) & (loss != 0)

    def forget_window(self) -> None:
        """The window's gradients were dropped without a step (``MixedPrecision.zero_grad()``)."""
        self._kinds = None

    def scales(self) -> list[torch.Tensor | float]:
        """Every scaler's scale now: read on the CPU (a memory load), a device copy elsewhere; a scale that never
        changes (no scaling) as it is, with neither."""
        snapshots: list[torch.Tensor | float] = []
        for scaler in self._scalers:
            tensor, fixed = scaler.scale_tensor, scaler.fixed_scale
            if fixed is not None:
                snapshots.append(fixed)
            elif tensor is None:
                snapshots.append(scaler.get_scale())
            else:
                snapshots.append(float(tensor.item()) if self._reads_free else tensor.clone())
        return snapshots

    def record(self, flags: FoundInf, scales_before: list[torch.Tensor | float]) -> None:
        """Account for the update step just finished: its flags, this window's kinds, the scales around it."""
        kinds, self._kinds = self._kinds or (False, False), None
        underflow, self._underflow = self._underflow, None
        per_loss = list(flags.host) if flags.host is not None else [f.clone() for f in flags.per_loss]
        self.add(
            StepRecord(
                step=self.next_step,
                found=flags.found,
                has_inf=kinds[0],
                has_nan=kinds[1],
                scales_before=scales_before,
                scales_after=self.scales(),
                found_per_loss=per_loss,
                underflow=False if underflow is None else underflow,
            )
        )

    # -- the steps so far ---------------------------------------------------------------------
    @property
    def next_step(self) -> int:
        """The index the next record will have (records still on the device included)."""
        return self.steps + len(self._pending)

    def add(self, record: StepRecord) -> None:
        self._pending.append(record)
        if len(self._pending) >= self._flush_every:
            self.flush()

    def counts(self) -> dict[str, Any]:
        """The step counters of :class:`~mixprec.engine.stats.Stats`, by field name (reads pending records)."""
        self.flush()
        return {
            "steps": self.steps,
            "applied_steps": self.steps - self.skipped_steps,
            "skipped_steps": self.skipped_steps,
            "inf_steps": self.inf_steps,
            "nan_steps": self.nan_steps,
            "underflow_steps": self.underflow_steps,
            "recent_overflow_steps": tuple(self.recent_overflow_steps),
            "diagnosis": self.diagnosis,
        }

    def flush(self) -> None:
        """Read pending records on the host (a sync on accelerators) and account for them."""
        pending, self._pending = self._pending, []
        for record in pending:
            self._account(record)

    def _account(self, record: StepRecord) -> None:
        self.steps += 1
        self._collapsed = any(
            isinstance(scaler, DynamicLossScaler) and float(_host(after)) < 1.0
            for scaler, after in zip(self._scalers, record.scales_after, strict=True)
        )
        if not _host(record.found):
            if _host(record.underflow):
                self.underflow_steps += 1
                scale = float(_host(record.scales_before[0]))
                message = (
                    f"Gradient underflow at step {record.step}: every gradient is zero at loss scale {scale:g} "
                    "although the loss is not; the scale collapsed after overflows and is growing back (x2 per "
                    "clean step while below 1)"
                )
                if self.underflow_steps == 1:
                    logger.warning(message)  # the first one always, whatever the overflow lines used up
                else:
                    self._log(message)
            return
        self.skipped_steps += 1
        has_nan = bool(_host(record.has_nan))
        has_inf = bool(_host(record.has_inf)) or not has_nan  # a flagged step without NaN holds inf
        self.inf_steps += has_inf
        self.nan_steps += has_nan
        self.recent_overflow_steps.append(record.step)
        kind = " and ".join(k for k, present in (("inf", has_inf), ("NaN", has_nan)) if present)
        for loss_id, (found, before, after) in enumerate(
            zip(record.found_per_loss, record.scales_before, record.scales_after, strict=True)
        ):
            if not _host(found):
                continue
            before, after = float(_host(before)), float(_host(after))
            change = f"reducing loss scale to {after}" if after < before else f"keeping loss scale {after}"
            self._log(
                f"Gradient overflow ({kind}) at step {record.step}. Skipping step, loss scaler {loss_id} {change}"
            )
            if self.diagnosis is None and self._scalers[loss_id].is_floor(before):
                self._floor = (before, isinstance(self._scalers[loss_id], DynamicLossScaler))
                logger.warning(self.diagnosis)

    def _log(self, message: str) -> None:
        now = time.monotonic()
        if self._logged < _FIRST_MESSAGES or now - self._last_log >= _MIN_SECONDS_BETWEEN:
            if self._suppressed:
                message += f" ({self._suppressed} more overflow messages suppressed)"
            logger.info(message)
            self._logged += 1
            self._suppressed = 0
            self._last_log = now
        else:
            self._suppressed += 1

    @property
    def diagnosis(self) -> str | None:
        """Why overflows persist where the scale cannot cure them, with the counts as of now; None until then."""
        return self._diagnose(*self._floor) if self._floor is not None else self._saved_diagnosis

    def _diagnose(self, scale: float, dynamic: bool) -> str:
        counts = f"{self.nan_steps} of {self.skipped_steps} skipped steps so far had NaN, {self.inf_steps} had inf"
        causes = (
            "Likely causes: NaN or inf in the inputs or produced by the forward pass (log, sqrt or division of "
            "bad values, exploding activations)"
        )
        doctor = "run `mixprec doctor` to find the first layer that produces a non-finite value."
        if not dynamic:  # a fixed scale (1 under bf16 policies): nothing was scaled that backing off could cure
            return (
                f"Gradients overflow at the fixed loss scale {scale}, so the overflow does not come from loss "
                f"scaling ({counts}). {causes}. Training continues safely with these steps skipped. Remedy: {doctor}"
            )
        return (
            f"Gradients still overflow at loss scale {scale}, where backing off further cannot cure them: the "
            f"overflow does not come from loss scaling ({counts}). {causes}; weights trained in bf16 that exceed "
            "fp16's range (max 65504). Training continues safely with these steps skipped. Remedies: use a bf16 "
            f"policy (mixed_bf16), or {doctor}"
        )

    def state_dict(self) -> dict[str, Any]:
        self.flush()
        return {
            "steps": self.steps,
            "skipped_steps": self.skipped_steps,
            "inf_steps": self.inf_steps,
            "nan_steps": self.nan_steps,
            "underflow_steps": self.underflow_steps,
            "recent_overflow_steps": list(self.recent_overflow_steps),
            "diagnosis": self.diagnosis,
            "diagnosis_floor": list(self._floor) if self._floor is not None else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        state = {"underflow_steps": 0, **state}  # saved before underflow was counted
        missing = {"steps", "skipped_steps", "inf_steps", "nan_steps", "recent_overflow_steps"} - state.keys()
        if missing:
            raise ValueError(
                f"MixedPrecision state: the counters lack {', '.join(sorted(missing))}; pass what "
                "MixedPrecision.state_dict() returned."
            )
        self._pending = []
        for key in ("steps", "skipped_steps", "inf_steps", "nan_steps", "underflow_steps"):
            value = state[key]
            setattr(self, key, whole_number(value, f"MixedPrecision state: counter {key!r}", minimum=0))
        self.recent_overflow_steps.clear()
        self.recent_overflow_steps.extend(int(s) for s in state["recent_overflow_steps"])
        floor = state.get("diagnosis_floor")  # absent from states saved before it was kept: their text stays
        self._floor = (float(floor[0]), bool(floor[1])) if floor else None
        self._saved_diagnosis = None if floor else state.get("diagnosis")
