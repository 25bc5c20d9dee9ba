"""Timing that can be trusted: warm-up, synchronize, interleaved repeats, median and spread.

Modes are timed in rounds (A, B, C, A, B, C, ...), so that slow drift of the machine (frequency,
other processes) hits every mode alike, and reported as the median with the min-max spread. Each call
is also timed in CPU time (``time.process_time``, all of this process's threads): on a shared machine
another process inflates wall time but not the CPU time a step needs, so the CPU-time ratios hold.

A mode more than ``SLOW_FACTOR`` times slower than the fastest after ``SLOW_REPEATS`` rounds (PyTorch's
bf16 kernels on a CPU without bf16 units: 25x FP32 for a training step) stops there: its median is
already far outside every comparison, and its remaining repeats would be most of the benchmark's time.
Its ``repeats`` says how many it got.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = ["SLOW_FACTOR", "SLOW_REPEATS", "Timing", "interleaved"]

SLOW_FACTOR = 10.0
SLOW_REPEATS = 3


@dataclass(frozen=True)
class Timing:
    median_ms: float
    min_ms: float
    max_ms: float
    repeats: int
    cpu_median_ms: float = float("nan")  # CPU time of this process (all threads) per call

    @property
    def spread_ms(self) -> float:
        return self.max_ms - self.min_ms


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()  # host sync: a timing must include the queued device work


def interleaved(
    steps: dict[str, Callable[[], object]], repeats: int = 7, warmup: int = 2, slow_factor: float | None = SLOW_FACTOR
) -> dict[str, Timing]:
    """Time each callable ``repeats`` times, interleaved, after ``warmup`` untimed calls each; a mode
    ``slow_factor`` times slower than the fastest, ``SLOW_REPEATS`` times (None: every mode ``repeats``
    times)."""
    for step in steps.values():
        for _ in range(warmup):
            step()
    _sync()
    samples: dict[str, list[float]] = {name: [] for name in steps}
    cpu: dict[str, list[float]] = {name: [] for name in steps}
    timed = dict(steps)
    for round_ in range(repeats):
        if round_ == SLOW_REPEATS and slow_factor is not None:
            timed = _without_slow(timed, samples, slow_factor)
        for name, step in timed.items():
            start, start_cpu = time.perf_counter(), time.process_time()
            step()
            _sync()
            samples[name].append(1e3 * (time.perf_counter() - start))
            cpu[name].append(1e3 * (time.process_time() - start_cpu))
    return {
        name: Timing(statistics.median(values), min(values), max(values), len(values), statistics.median(cpu[name]))
        for name, values in samples.items()
    }


def _without_slow(
    steps: dict[str, Callable[[], object]], samples: dict[str, list[float]], factor: float
) -> dict[str, Callable]:
    """The modes whose median so far is within ``factor`` of the fastest's."""
    fastest = min(statistics.median(samples[name]) for name in steps)
    return {name: step for name, step in steps.items() if statistics.median(samples[name]) <= factor * fastest}
