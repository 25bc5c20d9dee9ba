"""Part ``bert``: BERT-base training samples/s and inference sequences/s per precision (seed 002's table).

The model is ``transformers.BertForSequenceClassification`` built from ``BertConfig()`` (BERT-base:
12 layers, width 768, 110M parameters) with random weights, nothing downloaded; sequences of 128
random tokens, two labels. Per batch size (1, 8, 64) the modes are timed in interleaved rounds:
    training    mixprec.MixedPrecision under fp32, tf32, mixed_fp16 (dynamic loss scale), mixed_bf16;
                fused AdamW; forward, backward, step
    inference   the FP32 model under fp32 and tf32 policies, and the model cast to fp16 / bf16
                (``cast_module`` with ``p=<dtype>,c=<dtype>,o=f32``, as ``mixprec export`` does), forward
                only, under ``torch.inference_mode``
with the speed-up of each against fp32 at the same batch.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from benchmarks.gpu.common import Part, Settings, free_memory, log
from benchmarks.gpu.measure import prepare, time_modes
from benchmarks.gpu.steps import Mode, Workload, mixprec_step, torch_step

import mixprec

__all__ = ["run"]

TRAIN_POLICIES = {"fp32": "fp32", "tf32": "tf32", "fp16": "mixed_fp16", "bf16": "mixed_bf16"}
# the hand-written loops (torch.autocast, GradScaler for fp16, fused AdamW) beside mixprec's: its overhead
TORCH_LOOPS = {"torch fp32": None, "torch autocast fp16": torch.float16, "torch autocast bf16": torch.bfloat16}
TORCH_TWINS = {"fp32": "torch fp32", "fp16": "torch autocast fp16", "bf16": "torch autocast bf16"}
INFERENCE_POLICIES = {"fp32": "fp32", "tf32": "tf32", "fp16": "p=f16,c=f16,o=f32", "bf16": "p=bf16,c=bf16,o=f32"}


def _size(dry_run: bool):
    from transformers import BertConfig

    if dry_run:
        tiny = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 64}
        return BertConfig(vocab_size=512, max_position_embeddings=64, **tiny), 16, (1, 2)
    return BertConfig(), 128, (1, 8, 64)


def _workload(config, seq: int, batch: int) -> Workload:
    from transformers import BertForSequenceClassification

    def data(device: torch.device):
        gen = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, config.vocab_size, (batch, seq), generator=gen)
        return tokens.to(device), torch.randint(0, 2, (batch,), generator=gen).to(device)

    def loss(output, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(output.logits.float(), labels)

    return Workload(lambda: BertForSequenceClassification(config), data, loss)


def _inference(work: Workload, device: torch.device, policy: str) -> tuple[Callable[[], None], None]:
    torch.manual_seed(0)
    model = work.build().to(device).eval()
    if "c=" in policy:  # the model stored in 16 bits, as exported
        mixprec.cast_module(model, mixprec.get_policy(policy))
    tokens, _ = work.batch(device)

    def forward() -> None:
        with torch.inference_mode(), mixprec.autocast(policy, model):
            model(tokens)

    return forward, None


def _modes(work: Workload, device: torch.device, phase: str) -> list[Mode]:
    if phase == "training":
        mixprecs = [
            Mode(name, lambda p=policy: mixprec_step(work, device, p, "fused"), twin=TORCH_TWINS.get(name))
            for name, policy in TRAIN_POLICIES.items()
        ]
        loops = [Mode(name, lambda d=dtype: torch_step(work, device, d)) for name, dtype in TORCH_LOOPS.items()]
        return mixprecs + loops
    return [Mode(name, lambda p=policy: _inference(work, device, p)) for name, policy in INFERENCE_POLICIES.items()]


def _phase(settings: Settings, part: Part, work: Workload, phase: str, batch: int, rounds: tuple[int, int]) -> None:
    label = {"phase": phase, "batch": batch}
    ready = []
    for mode in _modes(work, settings.device, phase):
        made = part.attempt({**label, "mode": mode.name}, lambda m=mode: prepare(m, settings.device))
        ready += [made] if made is not None else []
    timings, failed = time_modes(ready, *rounds)
    fp32 = timings.get("fp32")
    for made in ready:
        name = made.mode.name
        if name in failed:
            part.records.append({**label, "mode": name, "error": failed[name]})
            continue
        timing = timings[name]
        part.records.append({**label, "mode": name, "median_ms": round(timing.median_ms, 3),
                             "spread_ms": round(timing.spread_ms, 3),
                             "samples_per_s": round(batch / (timing.median_ms / 1e3), 1),
                             "speedup_vs_fp32": round(fp32.median_ms / timing.median_ms, 2) if fp32 else None,
                             "vs_torch_loop": _ratio(timing, timings.get(made.mode.twin or "")),
                             "peak_memory_mb": made.figures["peak_memory_mb"]})  # fmt: skip
    log(f"  {phase} batch {batch}: " + ", ".join(f"{n} {t.median_ms:.1f} ms" for n, t in timings.items()))
    del ready
    free_memory()


def _ratio(timing, twin) -> float | None:
    """Step time over the hand-written loop's (above 1: mixprec is slower)."""
    return round(timing.median_ms / twin.median_ms, 3) if twin else None


def run(settings: Settings, part: Part) -> None:
    config, seq, batches = _size(settings.dry_run)
    rounds = (2, 1) if settings.dry_run else (10, 3)  # (repeats, warm-up steps)
    part.meta.update(hidden=config.hidden_size, layers=config.num_hidden_layers, seq=seq, batches=list(batches))
    part.meta.update(repeats=rounds[0], warmup=rounds[1], weights="random (BertConfig, nothing downloaded)")
    for batch in batches:
        work = _workload(config, seq, batch)
        for phase in ("training", "inference"):
            _phase(settings, part, work, phase, batch, rounds)
