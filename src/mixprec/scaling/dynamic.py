"""Dynamic loss scaling: back off on overflow, grow after a run of clean steps, all on device.

Per step, given ``found_inf``:

    overflow:  growth run resets; if ``hysteresis`` overflows have been absorbed, scale *= backoff_factor
               (never below ``min_scale``), else one more overflow is absorbed (DeepSpeed's hysteresis)
    clean:     after ``growth_interval`` consecutive clean steps, scale *= growth_factor (never past
               ``max_scale``, never to inf) and the hysteresis budget refills; below ``recover_below``
               (1 by default) after every clean step

Recovery: a scale that collapsed (a run of overflows took it far below 1: fp16 gradients then underflow
to zero and training silently stops) comes back by growth_factor per clean step while it is below
``recover_below``: from the floor 2**-24 to 1 in 24 clean steps, instead of 24 x 2000.

With ``hysteresis=1``, ``min_scale=None``, ``max_scale=None`` and ``recover_below=None`` every decision
and every value equals ``torch.amp.GradScaler``'s down to ``LOWEST_SCALE`` (2**-24), where GradScaler
goes on halving to 0: the products are computed in fp64 and rounded to fp32, as its kernel does. The
default ``recover_below=1`` departs from it only below scale 1, a state a run reaches after 17
consecutive overflows from 2**16, where an fp16 run under GradScaler has effectively stopped learning.

Example:
    >>> import torch
    >>> s = DynamicLossScaler(init_scale=8.0, growth_interval=2)
    >>> s.scale(torch.tensor(1.0)).item()
    8.0
    >>> s.update(torch.ones(1)); s.get_scale()
    4.0
"""

from __future__ import annotations

from typing import Any

import torch

from mixprec.checks import loss_scale, positive_number, whole_number
from mixprec.numerics.quantize import round_to
from mixprec.scaling.base import LossScaler, check_state_type

LOWEST_SCALE = 2.0**-24  # the scale never backs off below this: below ~2**-149 it would become 0 for good

__all__ = ["LOWEST_SCALE", "DynamicLossScaler"]


class DynamicLossScaler(LossScaler):
    """A loss scale that follows the gradients: halve on overflow, double after clean runs.

    Args:
        init_scale: the starting scale (2**16, as in PyTorch and Apex).
        growth_factor: multiplier after ``growth_interval`` clean steps (> 1).
        backoff_factor: multiplier on overflow (between 0 and 1).
        growth_interval: consecutive clean steps before growing.
        hysteresis: overflows absorbed before backing off (1: back off on every overflow).
        min_scale: floor; at it, overflowing steps are still skipped but the scale stays (None: only the
            hard floor 2**-24, which keeps a collapsing scale from underflowing to 0, where no growth
            could ever bring it back; GradScaler has no floor at all).
        max_scale: ceiling for growth (None: grow while finite).
        recover_below: below this scale, grow after every clean step (None: only every
            ``growth_interval``, as GradScaler).
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        hysteresis: int = 1,
        min_scale: float | None = None,
        max_scale: float | None = 2.0**24,
        recover_below: float | None = 1.0,
    ) -> None:
        name = "DynamicLossScaler"
        super().__init__(loss_scale(init_scale, f"{name}(init_scale=...)"))
        self.growth_factor = positive_number(growth_factor, f"{name}(growth_factor=...)")
        self.backoff_factor = positive_number(backoff_factor, f"{name}(backoff_factor=...)")
        if self.growth_factor <= 1.0:
            raise ValueError(f"{name}(growth_factor=...) must be > 1; received {growth_factor!r}.")
        if self.backoff_factor >= 1.0:
            raise ValueError(f"{name}(backoff_factor=...) must be < 1; received {backoff_factor!r}.")
        self.growth_interval = whole_number(growth_interval, f"{name}(growth_interval=...)")
        self.hysteresis = whole_number(hysteresis, f"{name}(hysteresis=...)")
        # the bounds within the scale's own range and in its dtype (FP32): a scale backed off to min_scale=0.7 is
        # 0.69999999, which a load then found below the floor; a floor below 2**-126, a scale no load took
        self.min_scale = None if min_scale is None else _in_fp32(loss_scale(min_scale, f"{name}(min_scale=...)"))
        self.max_scale = None if max_scale is None else _in_fp32(loss_scale(max_scale, f"{name}(max_scale=...)"))
        self.recover_below = (
            None if recover_below is None else positive_number(recover_below, f"{name}(recover_below=...)")
        )
        if self.min_scale is not None and self.min_scale > self._init_scale:
            raise ValueError(f"{name}: min_scale={min_scale!r} is above init_scale={init_scale!r}.")
        if self.max_scale is not None and self.max_scale < self._init_scale:
            raise ValueError(f"{name}: max_scale={max_scale!r} is below init_scale={init_scale!r}.")
        self._growth_tracker_init = 0
        self._hysteresis_left_init = self.hysteresis
        self._growth_tracker: torch.Tensor | None = None
        self._hysteresis_left: torch.Tensor | None = None

    def _init_state(self, device: torch.device) -> None:
        self._growth_tracker = torch.full((1,), self._growth_tracker_init, dtype=torch.int32, device=device)
        self._hysteresis_left = torch.full((1,), self._hysteresis_left_init, dtype=torch.int32, device=device)

    def update(self, found_inf: torch.Tensor) -> None:
        """Adjust the scale on device; no host sync."""
        scale = self._scale_on(self._checked(found_inf, "update(found_inf=...)").device)
        growth, hysteresis = self._growth_tracker, self._hysteresis_left
        assert growth is not None and hysteresis is not None  # created with the scale
        if self.hysteresis == 1:
            self._update_fused(scale, growth, found_inf.to(scale.device))
            return
        found = found_inf.to(scale.device) > 0
        exhausted = hysteresis <= 1
        backoff = found & exhausted

        # fp64 products rounded to fp32: bit-identical to GradScaler's update kernel.
        backed = (scale.double() * self.backoff_factor).float()
        backed = backed.clamp(min=self.min_scale if self.min_scale is not None else LOWEST_SCALE)
        grown = (scale.double() * self.growth_factor).float()
        grown = torch.where(torch.isfinite(grown), grown, scale)
        if self.max_scale is not None:
            grown = grown.clamp(max=self.max_scale)

        successful = growth + 1
        grow = ~found & (successful >= self.growth_interval)
        if self.recover_below is not None:  # a collapsed scale comes back one clean step at a time
            grow = grow | (~found & (scale < self.recover_below))
        new_scale = torch.where(backoff, backed, torch.where(grow, grown, scale))
        zero = torch.zeros_like(growth)
        new_growth = torch.where(found | grow, zero, successful)
        new_hysteresis = torch.where(
            found & ~exhausted,
            hysteresis - 1,
            torch.where(grow, torch.full_like(hysteresis, self.hysteresis), hysteresis),
        )
        scale.copy_(new_scale)
        growth.copy_(new_growth)
        hysteresis.copy_(new_hysteresis)

    def _update_fused(self, scale: torch.Tensor, growth: torch.Tensor, found_inf: torch.Tensor) -> None:
        """Without hysteresis: GradScaler's own update kernel (one op where the general update takes about 30,
        each a launch on a GPU), with the floor, the ceiling and the recovery around it: below ``recover_below``
        the growth tracker is set one short of the interval, so that a clean step grows the scale."""
        last = self.growth_interval - 1
        if self.recover_below is not None:
            growth.copy_(torch.where(scale < self.recover_below, last, growth.clamp(max=last)))
        else:
            growth.clamp_(max=last)  # a tracker loaded past the interval grows at the next clean step, as >= did
        torch._amp_update_scale_(
            scale, growth, found_inf.float(), self.growth_factor, self.backoff_factor, self.growth_interval
        )
        floor = self.min_scale if self.min_scale is not None else LOWEST_SCALE
        scale.clamp_(min=floor, max=self.max_scale)

    def is_floor(self, scale: float) -> bool:
        """At ``min_scale``, or below 1 without a floor: backing off further will not cure an overflow."""
        return scale <= self.min_scale if self.min_scale is not None else scale < 1.0

    def state_dict(self) -> dict[str, Any]:
        """Every field; reads three device scalars (host sync)."""
        return {
            "type": "dynamic",
            "scale": self.get_scale(),
            "growth_factor": self.growth_factor,
            "backoff_factor": self.backoff_factor,
            "growth_interval": self.growth_interval,
            "hysteresis": self.hysteresis,
            "min_scale": self.min_scale,
            "max_scale": self.max_scale,
            "recover_below": self.recover_below,
            "growth_tracker": _read(self._growth_tracker, self._growth_tracker_init),
            "hysteresis_left": _read(self._hysteresis_left, self._hysteresis_left_init),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if isinstance(state, dict) and "recover_below" not in state:  # saved before recovery existed: as then
            state = {**state, "recover_below": None}
        self._check_keys(
            state,
            {
                "type",
                "scale",
                "growth_factor",
                "backoff_factor",
                "growth_interval",
                "hysteresis",
                "min_scale",
                "max_scale",
                "recover_below",
                "growth_tracker",
                "hysteresis_left",
            },
        )
        check_state_type(self, state, "dynamic")
        restored = DynamicLossScaler(
            init_scale=state["scale"],
            growth_factor=state["growth_factor"],
            backoff_factor=state["backoff_factor"],
            growth_interval=state["growth_interval"],
            hysteresis=state["hysteresis"],
            min_scale=state["min_scale"],
            max_scale=state["max_scale"],
            recover_below=state["recover_below"],
        )  # validates every field
        fields = ("growth_factor", "backoff_factor", "growth_interval", "hysteresis", "min_scale", "max_scale")
        for field in (*fields, "recover_below"):
            setattr(self, field, getattr(restored, field))
        self._load_scale(state["scale"])
        self._growth_tracker_init = whole_number(state["growth_tracker"], f"{_LOAD} 'growth_tracker'", minimum=0)
        self._hysteresis_left_init = whole_number(state["hysteresis_left"], f"{_LOAD} 'hysteresis_left'", minimum=0)
        if self._growth_tracker is not None and self._hysteresis_left is not None:
            self._growth_tracker.fill_(self._growth_tracker_init)
            self._hysteresis_left.fill_(self._hysteresis_left_init)

    def __repr__(self) -> str:
        # The configuration, not the live scale: reading that would wait for the device (get_scale() does).
        return (
            f"DynamicLossScaler(init_scale={self._init_scale}, growth_factor={self.growth_factor}, "
            f"backoff_factor={self.backoff_factor}, growth_interval={self.growth_interval}, "
            f"hysteresis={self.hysteresis}, min_scale={self.min_scale}, max_scale={self.max_scale}, "
            f"recover_below={self.recover_below})"
        )


_LOAD = "DynamicLossScaler.load_state_dict: state"


def _read(tracker: torch.Tensor | None, before_first_use: int) -> int:
    return int(tracker.item()) if tracker is not None else before_first_use


def _in_fp32(value: float) -> float:
    """``value`` rounded to FP32, the dtype the scale is held in."""
    return round_to(value, torch.float32)
