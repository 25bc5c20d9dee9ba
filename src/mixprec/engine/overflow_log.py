"""Bookkeeping of applied and skipped steps: counts, recent overflows, log lines and the floor diagnosis.

Records may arrive as device tensors; they are read on the host when flushed (every step on CPU,
where reading is free; in batches on accelerators, so that training never waits on them).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch

from mixprec.checks import whole_number

__all__ = ["OverflowLog", "StepRecord"]

logger = logging.getLogger("mixprec")

_FIRST_MESSAGES = 10  # overflow lines logged in full before rate limiting starts
_MIN_SECONDS_BETWEEN = 30.0


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


def _host(value: Any) -> Any:
    return value.item() if isinstance(value, torch.Tensor) else value  # host sync when on a device


class OverflowLog:
    def __init__(self, scalers: list, history: int = 32, flush_every: int = 1) -> None:
        self._scalers = scalers
        self._flush_every = flush_every
        self.steps = 0
        self.skipped_steps = 0
        self.inf_steps = 0
        self.nan_steps = 0
        self.recent_overflow_steps: deque[int] = deque(maxlen=history)
        self.diagnosis: str | None = None
        self._pending: list[StepRecord] = []
        self._logged = 0
        self._suppressed = 0
        self._last_log = float("-inf")

    @property
    def next_step(self) -> int:
        """The index the next record will have (records still on the device included)."""
        return self.steps + len(self._pending)

    def add(self, record: StepRecord) -> None:
        self._pending.append(record)
        if len(self._pending) >= self._flush_every:
            self.flush()

    def flush(self) -> None:
        """Read pending records on the host (a sync on accelerators) and account for them."""
        pending, self._pending = self._pending, []
        for record in pending:
            self._account(record)

    def _account(self, record: StepRecord) -> None:
        self.steps += 1
        if not _host(record.found):
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
                self.diagnosis = self._diagnose(before)
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

    def _diagnose(self, scale: float) -> str:
        return (
            f"Gradients still overflow at loss scale {scale}, where backing off further cannot cure them: the "
            f"overflow does not come from loss scaling ({self.nan_steps} of {self.skipped_steps} skipped steps "
            f"so far had NaN, {self.inf_steps} had inf). Likely causes: NaN or inf in the inputs or produced by "
            "the forward pass (log, sqrt or division of bad values, exploding activations); weights trained in "
            "bf16 that exceed fp16's range (max 65504). Training continues safely with these steps skipped. "
            "Remedies: use a bf16 policy (mixed_bf16), or run `mixprec doctor` to find the first layer that "
            "produces a non-finite value."
        )

    def state_dict(self) -> dict[str, Any]:
        self.flush()
        return {
            "steps": self.steps,
            "skipped_steps": self.skipped_steps,
            "inf_steps": self.inf_steps,
            "nan_steps": self.nan_steps,
            "recent_overflow_steps": list(self.recent_overflow_steps),
            "diagnosis": self.diagnosis,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._pending = []
        for key in ("steps", "skipped_steps", "inf_steps", "nan_steps"):
            value = state[key]
            setattr(self, key, whole_number(value, f"MixedPrecision state: counter {key!r}", minimum=0))
        self.recent_overflow_steps.clear()
        self.recent_overflow_steps.extend(int(s) for s in state["recent_overflow_steps"])
        self.diagnosis = state["diagnosis"]
