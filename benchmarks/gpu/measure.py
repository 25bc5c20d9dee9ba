"""Measuring modes side by side: first call (compile) time, peak memory as if alone, interleaved timing.

Several modes live on the device at once so that they can be timed in interleaved rounds; the peak
memory of a mode is therefore taken as if it ran alone: the bytes it keeps between steps (model,
gradients, optimizer state, masters: the growth of ``memory_allocated`` over its first step) plus its
second step's peak above what was allocated before that step.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from benchmarks.gpu.common import Part, Settings, describe, free_memory, log, sync
from benchmarks.gpu.steps import Mode

from mixprec.app.bench.timing import Timing, interleaved

__all__ = ["Prepared", "add_beyond_twin", "prepare", "prepare_all", "profile_steps", "time_modes"]

_MB = 2**20


class Prepared:
    """A mode made and stepped twice: its step, its MixedPrecision (or None) and the build figures."""

    def __init__(self, mode: Mode, step: Callable[[], None], mp: object, figures: dict) -> None:
        self.mode, self.step, self.mp, self.figures = mode, step, mp, figures


def prepare(mode: Mode, device: torch.device) -> Prepared:
    """Make ``mode``, run its first step (optimizer state; compiling, if compiled) and a second, measured."""
    cuda = device.type == "cuda"
    base = torch.cuda.memory_allocated(device) if cuda else 0
    start = time.perf_counter()
    step, mp = mode.make()
    step()
    sync(device)
    figures: dict = {"first_call_s": round(time.perf_counter() - start, 3)}
    if not cuda:
        step()
        return Prepared(mode, step, mp, {**figures, "peak_memory_mb": None})
    resident = torch.cuda.memory_allocated(device) - base
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    step()
    sync(device)
    transient = torch.cuda.max_memory_allocated(device) - before
    figures["resident_mb"] = round(resident / _MB, 1)
    figures["peak_memory_mb"] = round((resident + transient) / _MB, 1)
    return Prepared(mode, step, mp, figures)


def time_modes(prepared: list[Prepared], repeats: int, warmup: int) -> tuple[dict[str, Timing], dict[str, dict]]:
    """Interleaved timing of every prepared mode (median, spread); a mode that raises is dropped, not fatal.

    Returns the timings of the modes that ran throughout, and the error of each that did not.
    """
    failed: dict[str, dict] = {}

    def guarded(name: str, step: Callable[[], None]) -> Callable[[], None]:
        def call() -> None:
            if name in failed:
                return
            try:
                step()
            except Exception as error:  # recorded against the mode; the others keep running
                failed[name] = describe(error)
                free_memory()

        return call

    steps = {p.mode.name: guarded(p.mode.name, p.step) for p in prepared}
    # every mode gets every round: a GPU's FP32 step may be 10x a compiled bf16 one and is still worth
    # its repeats, and a mode that failed (its later calls return at once) must not look fastest
    timings = interleaved(steps, repeats=repeats, warmup=warmup, slow_factor=None)
    return {name: t for name, t in timings.items() if name not in failed}, failed


def profile_steps(made: Prepared, device: torch.device, steps: int = 3) -> dict:
    """A short profile of a prepared mode: the host's CPU time per step (the thread's, the GPU left to run
    behind it: a step whose host time reaches its step time keeps the GPU waiting) and, on CUDA, the kernels
    (and copies) it launches per step, from torch.profiler."""
    sync(device)
    start = time.thread_time()
    for _ in range(steps):
        made.step()
    host_ms = (time.thread_time() - start) * 1e3 / steps
    sync(device)
    figures: dict = {"host_ms_per_step": round(host_ms, 3), "kernels_per_step": None}
    if device.type == "cuda":
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                made.step()
            sync(device)
        launched = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        figures["kernels_per_step"] = round(len(launched) / steps, 1)
        figures["kernel_counts"] = _kernel_counts(launched, steps)
        figures["top_kernels"] = _top_kernels(figures["kernel_counts"])
    return figures


def _kernel_counts(launched: list, steps: int) -> dict[str, list[float]]:
    """Every kernel a step launches, by name (cut to 80 characters): [ms, launches] per step (a kernel event's own
    span, on the device)."""
    totals: dict[str, list[float]] = {}
    for event in launched:
        total = totals.setdefault(event.name[:80], [0.0, 0])
        total[0] += event.time_range.elapsed_us() / 1e3 / steps
        total[1] += 1 / steps
    return {name: [round(ms, 4), round(n, 1)] for name, (ms, n) in totals.items()}


def add_beyond_twin(records: list[dict], twins: dict[str, str], count: int = 8) -> None:
    """Each profiled mixprec record whose hand-written twin was profiled too gets ``beyond_twin``: the kernels it
    launches more of, or spends more GPU time in, than the twin (most extra time first), each with the extra
    milliseconds and launches per step; what tells where a step slower than the loop spends the difference."""
    by_mode = {record["mode"]: record for record in records if record.get("kernel_counts")}
    for mode, twin in twins.items():
        if mode not in by_mode or twin not in by_mode:
            continue
        ours, theirs = by_mode[mode]["kernel_counts"], by_mode[twin]["kernel_counts"]
        extra = []
        for name, (ms, launches) in ours.items():
            their_ms, their_launches = theirs.get(name, (0.0, 0.0))
            if launches > their_launches or ms > their_ms * 1.05 + 0.005:  # 5 us or 5%: not noise
                extra.append(
                    {
                        "kernel": name,
                        "extra_ms": round(ms - their_ms, 3),
                        "extra_launches": round(launches - their_launches, 1),
                    }
                )
        by_mode[mode]["beyond_twin"] = sorted(extra, key=lambda k: -k["extra_ms"])[:count]


def _top_kernels(counts: dict[str, list[float]], count: int = 8) -> list[dict]:
    """Where a step's GPU time goes: of :func:`_kernel_counts`, the kernels that took the most of it, each with its
    milliseconds and launches per step."""
    ranked = sorted(counts.items(), key=lambda item: -item[1][0])[:count]
    return [{"kernel": name, "ms": round(ms, 3), "launches": launches} for name, (ms, launches) in ranked]


def prepare_all(settings: Settings, part: Part, modes: list[Mode], reserve_s: float, label: dict | None = None):
    """Make every mode and step it twice, compiling the compiled ones while the compile budget lasts and more
    than ``reserve_s`` (the timing's) is left; a mode left out is recorded with the reason, one that fails with
    its error (against ``label`` and its name)."""
    ready, compiling = [], 0.0
    for mode in modes:
        if mode.compiled and compiling > settings.compile_budget_s:
            part.leave_out(mode.name, f"compile budget of {settings.compile_budget_s:.0f} s spent ({compiling:.0f} s)")
            continue
        if mode.compiled and settings.seconds_left() < reserve_s:
            part.leave_out(mode.name, f"{settings.seconds_left():.0f} s left of the time limit: kept for the timing")
            continue
        start = time.perf_counter()
        made = part.attempt({**(label or {}), "mode": mode.name}, lambda m=mode: prepare(m, settings.device))
        compiling += time.perf_counter() - start if mode.compiled else 0.0
        if made is not None:
            log(f"  {mode.name}: ready, first call {made.figures['first_call_s']:.1f} s")
            ready.append(made)
            part.meta.setdefault("prepared", {})[mode.name] = made.figures  # saved now: kept if timing is cut
            part.progress()
    return ready
