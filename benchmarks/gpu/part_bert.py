"""Part ``bert``: BERT-base training samples/s and inference sequences/s per precision (seed 002's table).

The model is ``transformers.BertForSequenceClassification`` built from ``BertConfig()`` (BERT-base:
12 layers, width 768, 110M parameters) with random weights, nothing downloaded; sequences of 128
random tokens, two labels. Per batch size (1, 8, 64) the modes are timed in interleaved rounds:
    training    mixprec.MixedPrecision under fp32, tf32, mixed_fp16 (dynamic loss scale), mixed_bf16,
                o2_bf16 and pure_bf16 (mixprec.AdamW); fused AdamW; forward, backward, step; beside the
                hand-written loops (torch.autocast fp32/fp16 + GradScaler/bf16, and the model in bf16 with
                AdamW(fused=True), pure_bf16's twin), each with a short profile (host time and kernels per
                step); at the largest batch also compiled, while the compile budget lasts
    inference   the FP32 model under fp32 and tf32 policies, and the model cast to fp16 / bf16
                (``cast_module`` with ``p=<dtype>,c=<dtype>,o=f32``, as ``mixprec export`` does), forward
                only, under ``torch.inference_mode``; on CUDA each again replayed from a CUDA graph
                (``mixprec serve-bench --cuda-graphs``)
with the speed-up of each against fp32 eager at the same batch.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from benchmarks.gpu import models
from benchmarks.gpu.common import Part, Settings, free_memory, log
from benchmarks.gpu.measure import add_beyond_twin, prepare_all, profile_steps, time_modes
from benchmarks.gpu.steps import BF16_WEIGHTS_LOOP, TORCH_LOOPS, Mode, Workload, training_mode

import mixprec
from mixprec.app.cuda_graphs import GraphedForward

__all__ = ["run"]

TRAIN_POLICIES = {
    "fp32": "fp32",
    "tf32": "tf32",
    "fp16": "mixed_fp16",
    "bf16": "mixed_bf16",
    "o2_bf16": "o2_bf16",
    "pure_bf16": "pure_bf16",
}
# the hand-written loops (steps.TORCH_LOOPS, and the bf16-weights loop) beside mixprec's: its overhead
TORCH_TWINS = {
    "fp32": "torch fp32",
    "fp16": "torch autocast fp16",
    "bf16": "torch autocast bf16",
    "o2_bf16": "torch autocast bf16",
    "pure_bf16": BF16_WEIGHTS_LOOP,
}
# compiled at the largest batch while the compile budget lasts, the loop users write before mixprec's twin
COMPILED = ("torch autocast bf16", "bf16", "torch autocast fp16", "fp16", "o2_bf16", "pure_bf16", BF16_WEIGHTS_LOOP)
INFERENCE_POLICIES = {"fp32": "fp32", "tf32": "tf32", "fp16": "p=f16,c=f16,o=f32", "bf16": "p=bf16,c=bf16,o=f32"}
GRAPHED = ", CUDA graph"
_TIMING_RESERVE_S = 60.0  # no compile starts with less left: the timing of the compiled modes must fit


def _inference(work: Workload, device: torch.device, policy: str, graphed: bool) -> tuple[Callable[[], None], None]:
    torch.manual_seed(0)
    model = work.build().to(device).eval()
    if "c=" in policy:  # the model stored in 16 bits, as exported
        mixprec.cast_module(model, mixprec.get_policy(policy))
    tokens, _ = work.batch(device)
    region = lambda: mixprec.autocast(policy, model)  # noqa: E731
    if graphed:  # the region is captured with the forward
        replay = GraphedForward(model, region)
        return lambda: replay(tokens), None

    def forward() -> None:
        with torch.inference_mode(), region():
            model(tokens)

    return forward, None


def _train_mode(name: str, work: Workload, device: torch.device, backend: str | None = None) -> Mode:
    return training_mode(name, work, device, backend, TORCH_TWINS, TRAIN_POLICIES)


def _modes(settings: Settings, part: Part, work: Workload, phase: str, largest: bool) -> list[Mode]:
    device = settings.device
    if phase == "training":
        names = [*TRAIN_POLICIES, *TORCH_LOOPS, BF16_WEIGHTS_LOOP]
        modes = [_train_mode(name, work, device) for name in names]
        if largest:  # the dry run compiles one with the "eager" backend: dynamo traces the region, no codegen
            compiled, backend = (("bf16",), "eager") if settings.dry_run else (COMPILED, "inductor")
            modes += [_train_mode(name, work, device, backend) for name in compiled]
        return modes
    modes = [
        Mode(name, lambda p=policy: _inference(work, device, p, False)) for name, policy in INFERENCE_POLICIES.items()
    ]
    if settings.cuda:
        for name, policy in INFERENCE_POLICIES.items():
            modes.append(Mode(name + GRAPHED, lambda p=policy: _inference(work, device, p, True)))
    elif largest:
        part.leave_out("inference" + GRAPHED, "CUDA graphs need a CUDA device")
    return modes


def _phase(settings: Settings, part: Part, work: Workload, phase: str, batch: int, largest: bool, rounds) -> None:
    label = {"phase": phase, "batch": batch}
    ready = prepare_all(settings, part, _modes(settings, part, work, phase, largest), _TIMING_RESERVE_S, label)
    timings, failed = time_modes(ready, *rounds)
    fp32 = timings.get("fp32")
    for made in ready:
        name = made.mode.name
        if name in failed:
            part.records.append({**label, "mode": name, "error": failed[name]})
            continue
        timing = timings[name]
        record = {**label, "mode": name, "median_ms": round(timing.median_ms, 3),
                  "spread_ms": round(timing.spread_ms, 3),
                  "samples_per_s": round(batch / (timing.median_ms / 1e3), 1),
                  "speedup_vs_fp32": round(fp32.median_ms / timing.median_ms, 2) if fp32 else None,
                  "vs_torch_loop": _ratio(timing, timings.get(made.mode.twin or "")),
                  "peak_memory_mb": made.figures["peak_memory_mb"]}  # fmt: skip
        if phase == "training":
            profile = part.attempt({**record, "profile": True}, lambda m=made: profile_steps(m, settings.device))
            record.update(profile or {})
        part.records.append(record)
    here = [r for r in part.records if r.get("phase") == phase and r.get("batch") == batch]
    add_beyond_twin(here, {made.mode.name: made.mode.twin for made in ready if made.mode.twin})
    log(f"  {phase} batch {batch}: " + ", ".join(f"{n} {t.median_ms:.1f} ms" for n, t in timings.items()))
    del ready
    free_memory()


def _ratio(timing, twin) -> float | None:
    """Step time over the hand-written loop's (above 1: mixprec is slower)."""
    return round(timing.median_ms / twin.median_ms, 3) if twin else None


def run(settings: Settings, part: Part) -> None:
    config = models.bert_config(settings.dry_run)
    seq, batches = (16, (1, 2)) if settings.dry_run else (128, (1, 8, 64))
    rounds = (2, 1) if settings.dry_run else (10, 3)  # (repeats, warm-up steps)
    part.meta.update(hidden=config.hidden_size, layers=config.num_hidden_layers, seq=seq, batches=list(batches))
    part.meta.update(repeats=rounds[0], warmup=rounds[1], weights="random (BertConfig, nothing downloaded)")
    part.meta["compiled_at_batch"] = batches[-1]
    for batch in batches:
        work = models.bert(config, seq, batch)
        for phase in ("training", "inference"):
            _phase(settings, part, work, phase, batch, batch == batches[-1], rounds)
