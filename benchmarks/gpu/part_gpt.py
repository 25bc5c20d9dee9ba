"""Part ``gpt``: step time, tokens/s, MFU and peak memory of a GPT-2-sized model, per precision.

The model is mixprec's TinyGPT at GPT-2 small's shape (12 layers, width 768, 12 heads, context 1024;
its byte vocabulary of 256 makes it ~85M parameters, not 124M). The batch is the largest of a short
list whose FP32 step stays under 40% of the device's memory, so that every mode (each with its own
model and optimizer state) fits beside it. Every policy runs beside the hand-written loops
(``torch.autocast`` bf16, fp16 + GradScaler, FP32; fused AdamW), eager, and a subset compiled while
the compile budget lasts; all are timed in interleaved rounds, median of N.

MFU = 6 * N * tokens / step time / dense bf16 peak (N: parameters; the 6 counts the forward's 2 and
backward's 4 FLOPs per parameter and token). ``mfu_with_attention`` adds attention's 12 * L * D * T
per token (PaLM's appendix B), which 6N leaves out.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from benchmarks.gpu import models
from benchmarks.gpu.common import Part, Settings, bf16_peak_flops, free_memory, log
from benchmarks.gpu.measure import Prepared, add_beyond_twin, prepare, prepare_all, profile_steps, time_modes
from benchmarks.gpu.steps import BF16_WEIGHTS_LOOP, TORCH_LOOPS, Mode, Workload, training_mode

from mixprec.app.tasks.tiny_gpt import GPTConfig, TinyGPT

__all__ = ["Table", "run", "run_table"]

BATCHES = (64, 32, 16, 8, 4, 2, 1)
_MEMORY_SHARE = 0.40
POLICIES = ("fp32", "tf32", "mixed_bf16", "mixed_fp16", "o2_bf16", "pure_bf16", "fp8", "fp8_hybrid")
TWINS = {
    "fp32": "torch fp32",
    "mixed_bf16": "torch autocast bf16",
    "mixed_fp16": "torch autocast fp16",
    "pure_bf16": BF16_WEIGHTS_LOOP,
}
# pure_bf16's goal: no slower than o2_bf16 (and no more memory), which it replaces when memory is short
ALSO_COMPARED = {"pure_bf16": "o2_bf16"}
# compiled while the budget lasts, most telling first: the loop users write, then mixprec's counterpart
COMPILED = (
    "torch autocast bf16",
    "mixed_bf16",
    "torch autocast fp16",
    "mixed_fp16",
    "fp8",
    "o2_bf16",
    "pure_bf16",
    BF16_WEIGHTS_LOOP,
    "fp8_hybrid",
)
DRY_RUN_POLICIES = ("fp32", "mixed_bf16", "fp8")
# no compile starts with less than this left before the time limit: one more compile (13-22 s each for this
# model on an H200, forward and backward) and the interleaved timing of every mode (17 modes x 13 steps: about
# 55 s there) must fit
_TIMING_RESERVE_S = 100.0


def _mode(name: str, work: Workload, device: torch.device, backend: str | None = None) -> Mode:
    return training_mode(name, work, device, backend, TWINS)


def _largest_batch(settings: Settings, config: GPTConfig) -> tuple[int, dict]:
    """The largest batch in BATCHES whose FP32 step peaks under _MEMORY_SHARE of the device's memory."""
    total = torch.cuda.get_device_properties(settings.device).total_memory
    tried: dict[int, object] = {}
    for batch in BATCHES:
        try:
            made = prepare(_mode("torch fp32", models.tiny_gpt(config, batch), settings.device), settings.device)
            tried[batch] = made.figures["peak_memory_mb"]
            del made  # its model and optimizer state go before the next size is tried
        except torch.cuda.OutOfMemoryError:
            tried[batch] = "out of memory"
        free_memory()
        if isinstance(tried[batch], float) and tried[batch] * 2**20 <= _MEMORY_SHARE * total:
            return batch, tried
    raise RuntimeError(f"no batch in {BATCHES} fits: FP32 peak MB per batch {tried}")


def _modes(settings: Settings, work: Workload, part: Part, table: Table) -> list[Mode]:
    names = [*TORCH_LOOPS, BF16_WEIGHTS_LOOP, *(DRY_RUN_POLICIES if settings.dry_run else table.policies)]
    if settings.dry_run:
        names.remove("torch autocast fp16")
        part.leave_out("torch autocast fp16", "dry run: PyTorch's CPU fp16 kernels are 10-100x slower than FP32")
        others = [name for name in table.policies if name not in DRY_RUN_POLICIES]
        part.leave_out(", ".join(others), "dry run: a few policies show that the code runs")
    modes = [_mode(name, work, settings.device) for name in names]
    # the dry run compiles one case with the "eager" backend: dynamo traces mixprec's region (the
    # part that can break), without Inductor's tens of seconds of code generation on a CPU
    compiled = ("mixed_bf16",) if settings.dry_run else table.compiled
    backend = "eager" if settings.dry_run else "inductor"
    part.meta["compile_backend"] = backend
    return modes + [_mode(name, work, settings.device, backend) for name in compiled]


def _size(settings: Settings, part: Part) -> tuple[GPTConfig, int]:
    if settings.dry_run:
        return GPTConfig(layers=2, width=64, heads=2, context=64), 2
    config = GPTConfig(layers=12, width=768, heads=12, context=1024)
    batch, tried = _largest_batch(settings, config)
    part.meta["batch_probe_fp32_peak_mb"] = tried
    return config, batch


def _record(made: Prepared, timing, reference, twin, flops, peak: float | None, timings: dict) -> dict:
    seconds = timing.median_ms / 1e3
    record = {"mode": made.mode.name, "compiled": made.mode.compiled, **made.figures}
    record.update(median_ms=round(timing.median_ms, 2), spread_ms=round(timing.spread_ms, 2))
    record["tokens_per_s"] = round(flops["tokens"] / seconds)
    record["mfu"] = round(flops["dense"] / seconds / peak, 4) if peak else None
    record["mfu_with_attention"] = round(flops["attention"] / seconds / peak, 4) if peak else None
    record["vs_torch_fp32"] = round(timing.median_ms / reference.median_ms, 3) if reference else None
    record["twin"] = made.mode.twin
    record["vs_twin"] = round(timing.median_ms / twin.median_ms, 3) if twin else None
    compiled = ", compiled" if made.mode.compiled else ""
    for policy, other in ALSO_COMPARED.items():
        if made.mode.name == policy + compiled and (other + compiled) in timings:
            record[f"vs_{other}"] = round(timing.median_ms / timings[other + compiled].median_ms, 3)
    if made.mp is not None:
        record["compute_plan"] = made.mp.compute_plan.mode
        record["skipped_steps"] = made.mp.stats().skipped_steps  # a host read, after the timing
    return record


def run(settings: Settings, part: Part) -> None:
    config, batch = _size(settings, part)
    params = sum(p.numel() for p in TinyGPT(config).parameters())  # tied embedding counted once
    part.meta.update(model=f"TinyGPT {config}")
    work = models.tiny_gpt(config, batch)
    run_table(settings, part, work, Table(params, batch, config.context, config.layers, config.width))


@dataclass(frozen=True)
class Table:
    """What a model's table needs to turn step times into tokens/s and MFU."""

    params: int
    batch: int
    context: int
    layers: int
    width: int
    policies: tuple[str, ...] = POLICIES
    compiled: tuple[str, ...] = COMPILED


def run_table(settings: Settings, part: Part, work: Workload, table: Table, modes: list[Mode] | None = None) -> None:
    """Every mode of ``table`` on ``work`` (or ``modes``, made by the caller), eager and compiled while the budget
    lasts, timed interleaved, with a short profile of each (host time and kernels per step)."""
    _raise_recompile_limit()
    repeats, warmup = (2, 1) if settings.dry_run else (10, 3)
    tokens = table.batch * table.context
    dense = 6 * table.params * tokens
    with_attention = dense + 12 * table.layers * table.width * table.context * tokens
    flops = {"tokens": tokens, "dense": dense, "attention": with_attention}
    if settings.cuda:
        peak, peak_note = bf16_peak_flops(torch.cuda.get_device_name(settings.device))
    else:
        peak, peak_note = None, "MFU needs a GPU's bf16 peak: omitted on the CPU"
    part.meta.update(params=table.params, batch=table.batch, tokens_per_step=tokens,
                     repeats=repeats, warmup=warmup, bf16_peak_flops=peak, mfu_note=peak_note)  # fmt: skip
    modes = _modes(settings, work, part, table) if modes is None else modes
    ready = prepare_all(settings, part, modes, _TIMING_RESERVE_S)
    log(f"  timing {len(ready)} modes, {repeats} interleaved rounds after {warmup} warm-up steps")
    timings, failed = time_modes(ready, repeats, warmup)
    for made in ready:
        name = made.mode.name
        if name in failed:
            part.records.append({"mode": name, "compiled": made.mode.compiled, "error": failed[name]})
            continue
        twin = timings.get(made.mode.twin or "")
        record = _record(made, timings[name], timings.get("torch fp32"), twin, flops, peak, timings)
        record.update(
            part.attempt({"mode": name, "profile": True}, lambda m=made: profile_steps(m, settings.device)) or {}
        )
        part.records.append(record)
    add_beyond_twin(part.records, {made.mode.name: made.mode.twin for made in ready if made.mode.twin})


def _raise_recompile_limit() -> None:
    """Every compiled mode is a new model instance; dynamo must not fall back to eager after a few."""
    config = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):  # renamed across torch versions
        if hasattr(config, name):
            setattr(config, name, max(getattr(config, name), 64))
