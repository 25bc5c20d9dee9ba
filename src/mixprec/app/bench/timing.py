"""Timing that can be trusted: warm-up, synchronize, interleaved repeats, median and spread.

Modes are timed in rounds (A, B, C, then B, C, A, then C, A, B, ...), so that slow drift of the machine
(frequency, other processes) hits every mode alike, and reported as the median with the min-max spread. Each
round starts one mode later, so that each mode follows every other equally often.

The process keeps the memory it frees (:func:`keep_freed_memory`). A training process alone reaches a steady
state in which a step reuses the memory the step before it freed; a benchmark holds several models in one
process, and glibc's allocator handed the memory freed at the top of its heap back to the system, to be faulted
in again by the next step, depending on which steps ran before. On the bench's MLP (this CPU: AMD EPYC, 2
threads), mixed_bf16's backward right after the bf16 + FP32-master loop took 4096 page faults and 7.9 ms of
system time more than alone; its step measured 1.2-1.3x the torch loop's in every run, with spreads of 6-7 ms
on a 16 ms step; with the memory kept, 1.02-1.08x, spreads of 2-4 ms. Each call
is also timed in CPU time (``time.process_time``, all of this process's threads): on a shared machine
another process inflates wall time but not the CPU time a step needs, so the CPU-time ratios hold.

A mode more than ``SLOW_FACTOR`` times slower than the fastest after ``SLOW_REPEATS`` rounds (PyTorch's
bf16 kernels on a CPU without bf16 units: 25x FP32 for a training step) stops there: its median is
already far outside every comparison, and its remaining repeats would be most of the benchmark's time.
Its ``repeats`` says how many it got.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = ["SLOW_FACTOR", "SLOW_REPEATS", "Timing", "interleaved", "keep_freed_memory"]

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
    keep_freed_memory()
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
        for name, step in _rotated(list(timed.items()), round_):
            start, start_cpu = time.perf_counter(), time.process_time()
            step()
            _sync()
            samples[name].append(1e3 * (time.perf_counter() - start))
            cpu[name].append(1e3 * (time.process_time() - start_cpu))
    return {
        name: Timing(statistics.median(values), min(values), max(values), len(values), statistics.median(cpu[name]))
        for name, values in samples.items()
    }


# glibc's mallopt parameters (malloc.h) and the largest mmap threshold it takes on 64-bit systems
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_MMAP_THRESHOLD_MAX = 32 * 2**20


@functools.cache
def keep_freed_memory() -> bool:
    """Keep the memory a step frees in this process for the next (glibc: never trim the heap; blocks up to 32 MB
    from the heap, not mapped and unmapped each time). Once per process, for a benchmark's process: it changes
    how the whole process allocates. Whether it applied (False where the C library has no mallopt: musl, macOS)."""
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c")).mallopt
    except (OSError, AttributeError, TypeError):
        return False
    return bool(mallopt(_M_TRIM_THRESHOLD, 2**31 - 1)) and bool(mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX))


def _rotated(items: list, by: int) -> list:
    """``items`` starting at ``by`` (modulo their number): round ``by``'s order."""
    start = by % len(items) if items else 0
    return items[start:] + items[:start]


def _without_slow(
    steps: dict[str, Callable[[], object]], samples: dict[str, list[float]], factor: float
) -> dict[str, Callable]:
    """The modes whose median so far is within ``factor`` of the fastest's."""
    fastest = min(statistics.median(samples[name]) for name in steps)
    return {name: step for name, step in steps.items() if statistics.median(samples[name]) <= factor * fastest}
