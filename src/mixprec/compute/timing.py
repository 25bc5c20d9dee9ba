"""Timing a training pass on a device, several ways taking turns: what the FP8 shape decision and the tune's cost
model both measure.

    runs = {"fp8": pass_timer(step_a, device), "ref": pass_timer(step_b, device)}
    warm_up(runs)                                   # one call each: kernels, caches, state
    counts = {mode: repeats_for(run(1)) for ...}    # calls per sample: about TARGET_MS each
    interleaved_medians(runs, counts, samples=3)    # the modes take turns; the median of each

Host-device syncs: on CUDA each sample synchronizes the device before and after (the timing needs it).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
from torch.utils._python_dispatch import is_in_torch_dispatch_mode

__all__ = ["TARGET_MS", "interleaved_medians", "measuring_blocked", "pass_timer", "repeats_for", "warm_up"]

TARGET_MS = 5.0  # each timed sample repeats the pass until it takes about this long


def measuring_blocked(device: torch.device) -> bool:
    """True where nothing may be timed on ``device`` nor read back to the host now: a CUDA graph being captured
    (no sync), a dispatch mode active (fake tensors have no values and no speed; a user's op counter would count
    the measurement), a meta device. What is measured once (the FP8 shape speeds, the cast's probe) waits for a
    plain eager call."""
    capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    return capturing or device.type == "meta" or is_in_torch_dispatch_mode()


def pass_timer(step: Callable[[], object], device: torch.device) -> Callable[[int], float]:
    """A function timing ``count`` calls of ``step`` (one training pass): milliseconds, the device synchronized."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def run(count: int) -> float:
        sync()
        start = time.perf_counter()
        for _ in range(count):
            step()
        sync()
        return (time.perf_counter() - start) * 1e3

    return run


def warm_up(runs: dict[str, Callable[[int], float]]) -> None:
    """One call of each: the first builds kernels, caches and state, and is not timed."""
    for run in runs.values():
        run(1)


def repeats_for(once_ms: float) -> int:
    """Calls per timed sample for a pass that took ``once_ms``: enough for about ``TARGET_MS`` (tiny layers take
    microseconds), at most 1000."""
    return max(1, min(1000, round(TARGET_MS / max(once_ms, 1e-3))))


def interleaved_medians(
    runs: dict[str, Callable[[int], float]], counts: dict[str, int], samples: int
) -> dict[str, float]:
    """Per mode, the median milliseconds of one pass over ``samples`` samples of ``counts[mode]`` passes, the modes
    taking turns (a machine's drift reaches them all alike)."""
    timed: dict[str, list[float]] = {mode: [] for mode in runs}
    for _ in range(samples):
        for mode, run in runs.items():
            timed[mode].append(run(counts[mode]) / counts[mode])
    return {mode: statistics.median(values) for mode, values in timed.items()}
