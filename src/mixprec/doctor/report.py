"""The doctor's typed results: per module and phase, where values fall against each format's range.

Phases:
    forward      the module's outputs (activations)
    backward     gradients with respect to the module's outputs (activation gradients)
    weight_grad  gradients of the module's own parameters

Everything is plain data (``to_dict`` / ``to_json``); nothing is printed from here.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field

__all__ = ["PHASES", "DoctorReport", "FormatRange", "Histogram", "ModuleStats"]

PHASES = ("forward", "backward", "weight_grad")


@dataclass(frozen=True)
class FormatRange:
    """Fractions of all recorded values that would underflow to zero, become subnormal, or overflow."""

    format: str
    underflow: float
    subnormal: float
    overflow: float


@dataclass(frozen=True)
class Histogram:
    """Counts of finite non-zero magnitudes per binade: ``counts[i]`` holds 2**(low+i) <= |x| < 2**(low+i+1)."""

    low: int
    counts: tuple[int, ...]

    @property
    def total(self) -> int:
        return sum(self.counts)

    def binades(self) -> list[tuple[int, int]]:
        """(exponent, count) for the non-empty binades."""
        return [(self.low + i, c) for i, c in enumerate(self.counts) if c]

    def fraction_at_least(self, exponent: int) -> float:
        """Fraction of the counted values with magnitude >= 2**exponent."""
        if not self.total:
            return 1.0
        start = max(exponent - self.low, 0)
        return sum(self.counts[start:]) / self.total

    def __add__(self, other: Histogram) -> Histogram:
        if self.low != other.low or len(self.counts) != len(other.counts):
            raise ValueError("histograms with different bins cannot be added")
        return Histogram(self.low, tuple(a + b for a, b in zip(self.counts, other.counts, strict=True)))


@dataclass(frozen=True)
class ModuleStats:
    """What one module's tensors of one phase held, summed over every call and step recorded.

    ``order`` is the position of the module's first record within its phase (execution order for
    ``forward``, the order the backward pass reached it otherwise); ``input_amax`` (forward only) is
    the largest finite magnitude among the module's floating-point inputs; ``origin_calls`` (forward
    only), per format, how many calls overflowed it although that call's inputs fit.
    """

    module: str
    phase: str
    order: int
    calls: int
    values: int
    zeros: int
    nonfinite: int
    amax: float
    input_amax: float | None
    formats: dict[str, FormatRange]
    histogram: Histogram
    origin_calls: dict[str, int] = field(default_factory=dict)

    def overflows(self, fmt: str) -> bool:
        return self.formats[fmt].overflow > 0


@dataclass(frozen=True)
class DoctorReport:
    """Statistics per (module, phase) over ``steps`` recorded steps, for ``formats``."""

    formats: tuple[str, ...]
    steps: int
    stats: tuple[ModuleStats, ...] = field(default_factory=tuple)

    def get(self, module: str, phase: str) -> ModuleStats:
        for stat in self.stats:
            if stat.module == module and stat.phase == phase:
                return stat
        raise KeyError(f"no statistics for module {module!r} in phase {phase!r}")

    def phase(self, phase: str) -> list[ModuleStats]:
        """The phase's records in the order they were first seen."""
        return sorted((s for s in self.stats if s.phase == phase), key=lambda s: s.order)

    def overflowing(self, fmt: str, phase: str) -> list[ModuleStats]:
        """Modules whose ``phase`` tensors overflow ``fmt``, in the order they were reached."""
        return [s for s in self.phase(phase) if s.overflows(fmt)]

    def overflow_origins(self, fmt: str) -> list[str]:
        """Modules whose forward outputs overflow ``fmt`` although their inputs fit, in one call at least: where it
        starts (a module called twice, once from a fitting input, counts: its largest input over all calls
        need not fit).

        A container whose child already is such a module is left out, so the deepest module is named.
        """
        threshold = _overflow_threshold(fmt)
        starts = [
            s.module
            for s in self.overflowing(fmt, "forward")
            if (s.origin_calls[fmt] > 0 if fmt in s.origin_calls else s.input_amax is None or s.input_amax < threshold)
        ]
        return [m for m in starts if not any(_is_descendant(o, m) for o in starts)]

    def nonfinite_outputs(self) -> list[str]:
        """Modules whose forward outputs held inf or NaN in the recorded (FP32) run, in the order their outputs
        were made: the first is where the non-finite values start."""
        return [s.module for s in self.phase("forward") if s.nonfinite]

    def nonfinite_gradients(self) -> list[str]:
        """Modules the gradient of whose output (in the order the backward pass reached them), then whose weight
        gradient, held inf or NaN in the recorded (FP32) run. The first output gradient was made non-finite where
        that output is used: by the next module's backward, or by code between modules."""
        records = [s for phase in ("backward", "weight_grad") for s in self.phase(phase) if s.nonfinite]
        return list(dict.fromkeys(s.module for s in records))

    def overflow_reach(self, fmt: str) -> list[str]:
        """The outermost modules whose forward inputs or outputs overflow ``fmt``: all the overflow reaches,
        its consumers included ("" when the model's own input or output does). In FP32, no value of theirs
        is cast to ``fmt``; an origin alone in FP32 would hand its too-large output to the next 16-bit op."""
        threshold = _overflow_threshold(fmt)
        reached = [
            s.module
            for s in self.phase("forward")
            if s.overflows(fmt) or (s.input_amax is not None and s.input_amax >= threshold)
        ]
        return [m for m in reached if not any(_is_descendant(m, o) for o in reached)]

    def totals(self, phase: str, leaves_only: bool = True, modules: set[str] | None = None) -> ModuleStats | None:
        """One phase summed over modules (by default only modules without recorded children, so no
        value is counted twice; ``modules`` restricts the sum to those names)."""
        records = [s for s in self.phase(phase) if modules is None or s.module in modules]
        if leaves_only:
            names = [s.module for s in records]
            records = [s for s in records if not any(_is_descendant(n, s.module) for n in names)]
        if not records:
            return None
        values = sum(s.values for s in records)
        formats = {
            fmt: FormatRange(
                fmt,
                *(
                    sum(getattr(s.formats[fmt], key) * s.values for s in records) / max(values, 1)
                    for key in ("underflow", "subnormal", "overflow")
                ),
            )
            for fmt in self.formats
        }
        histogram = records[0].histogram
        for s in records[1:]:
            histogram = histogram + s.histogram
        return ModuleStats(
            module="*",
            phase=phase,
            order=0,
            calls=sum(s.calls for s in records),
            values=values,
            zeros=sum(s.zeros for s in records),
            nonfinite=sum(s.nonfinite for s in records),
            amax=max(s.amax for s in records),
            input_amax=None,
            formats=formats,
            histogram=histogram,
        )

    def to_dict(self) -> dict:
        return {"formats": list(self.formats), "steps": self.steps, "stats": [asdict(s) for s in self.stats]}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, default=_finite_or_none)


def _is_descendant(name: str, ancestor: str) -> bool:
    """Whether module ``name`` lies inside module ``ancestor`` ("" is the model itself)."""
    return name != ancestor and (ancestor == "" or name.startswith(f"{ancestor}."))


def _overflow_threshold(fmt: str) -> float:
    from mixprec.numerics.formats import get_format

    return get_format(fmt).overflow_threshold


def _finite_or_none(value: object) -> object:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value
