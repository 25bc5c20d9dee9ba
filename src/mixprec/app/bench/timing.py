"""Timing that can be trusted: warm-up, synchronize, interleaved repeats, median and spread.

Modes are timed in rounds (A, B, C, A, B, C, ...), so that slow drift of the machine (frequency,
other processes) hits every mode alike, and reported as the median with the min-max spread. Each call
is also timed in CPU time (``time.process_time``, all of this process's threads): on a shared machine
another process inflates wall time but not the CPU time a step needs, so the CPU-time ratios hold.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = ["Timing", "interleaved"]


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


def interleaved(steps: dict[str, Callable[[], object]], repeats: int = 7, warmup: int = 2) -> dict[str, Timing]:
    """Time each callable ``repeats`` times, interleaved, after ``warmup`` untimed calls each."""
    for step in steps.values():
        for _ in range(warmup):
            step()
    _sync()
    samples: dict[str, list[float]] = {name: [] for name in steps}
    cpu: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(repeats):
        for name, step in steps.items():
            start, start_cpu = time.perf_counter(), time.process_time()
            step()
            _sync()
            samples[name].append(1e3 * (time.perf_counter() - start))
            cpu[name].append(1e3 * (time.process_time() - start_cpu))
    return {
        name: Timing(statistics.median(values), min(values), max(values), len(values), statistics.median(cpu[name]))
        for name, values in samples.items()
    }
