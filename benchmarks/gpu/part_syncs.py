"""Part ``syncs``: host syncs per steady-state training step, per model, policy and optimizer.

A host sync (``.item()``, a device-to-host copy, a pageable host-to-device copy, ``synchronize``) stalls
the CPU until the GPU catches up, so the CPU cannot queue the next kernels while the GPU works. Each step
runs under ``torch.cuda.set_sync_debug_mode("warn")``, which warns at every synchronizing CUDA call; the
warnings are counted per step after warm-up, with the source line of each (where to fix it).

Models: every model the GPU check times (a small TinyGPT; transformers' BERT-base and GPT-2 small at 2
layers: their code and width, whose syncs do not depend on depth), each under every policy family.

Goals (docs/training-step.md, issue 17): 0 with an optimizer that takes ``found_inf`` itself (fused AdamW,
mixprec.AdamW); at most 1 (the documented read of the found-inf flags) with torch's default AdamW. The
hand-written torch loops (fused AdamW, GradScaler for fp16) are measured beside them as the reference.
The same steps then run under torch.profiler, whose count of blocking CUDA runtime calls
(``cudaStreamSynchronize`` ...) corroborates the warnings' count; it is recorded, not held to the goal
(the profiler's own start and stop may add calls).
On a CPU the steps run (the code path is exercised) but nothing is counted: the mode is CUDA's.
"""

from __future__ import annotations

import warnings
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import torch
from benchmarks.gpu import models
from benchmarks.gpu.common import Part, Settings, sync
from benchmarks.gpu.steps import Workload, mixprec_step, torch_step

from mixprec.app.tasks.tiny_gpt import GPTConfig

__all__ = ["run"]

_SYNC_WARNING = "called a synchronizing CUDA operation"
CASES = (  # (policy, optimizer): torch loops are named by their autocast dtype
    ("fp32", "fused"),
    ("mixed_bf16", "fused"),
    ("mixed_bf16", "default"),
    ("mixed_fp16", "fused"),
    ("mixed_fp16", "default"),
    ("o2_bf16", "fused"),
    ("o2_bf16", "default"),
    ("o2_fp16", "fused"),
    ("pure_bf16", "mixprec"),
    ("fp8", "fused"),
    ("torch autocast bf16", "fused"),
    ("torch autocast fp16 + GradScaler", "fused"),
)
GOALS = {"fused": 0, "mixprec": 0, "default": 1}


def _workloads(settings: Settings) -> dict[str, Workload]:
    """The models, small where size does not change what syncs (warm-up and counted steps: ``_steps``)."""
    if settings.dry_run:
        tiny, seq, batch = GPTConfig(layers=1, width=32, heads=2, context=16), 16, 2
    else:
        tiny, seq, batch = GPTConfig(layers=2, width=256, heads=4, context=128), 128, 8
    layers = None if settings.dry_run else 2
    return {
        "TinyGPT": models.tiny_gpt(tiny, batch),
        "BERT-base, 2 layers": models.bert(models.bert_config(settings.dry_run, layers), seq, batch),
        "GPT-2, 2 layers": models.gpt2(models.gpt2_config(settings.dry_run, layers), seq, batch),
    }


def _steps(settings: Settings) -> tuple[int, int]:
    """Warm-up steps, then counted steps."""
    return (1, 2) if settings.dry_run else (3, 5)


def count_syncs(step: Callable[[], None], steps: int, repo: Path) -> Counter:
    """Host syncs while ``step`` runs ``steps`` times, by source line (``set_sync_debug_mode("warn")``)."""
    sites: Counter = Counter()
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(steps):
                step()
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    for warning in caught:
        if _SYNC_WARNING in str(warning.message):
            path = Path(warning.filename)
            where = path.relative_to(repo) if path.is_relative_to(repo) else path.name
            sites[f"{where}:{warning.lineno}"] += 1
    return sites


# CUDA runtime calls that block the host, as the profiler names them: a second count that does not rely
# on the warnings (sync debug mode reports syncs that go through c10's synchronizing helpers)
_BLOCKING_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


def profiled_syncs(step: Callable[[], None], steps: int) -> dict[str, int]:
    """Blocking CUDA runtime calls while ``step`` runs ``steps`` times, by name (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
    return dict(Counter(e.name for e in prof.events() if e.name in _BLOCKING_CALLS))


def _count(settings: Settings, step: Callable[[], None], counted: int, goal: int) -> dict:
    sites = count_syncs(step, counted, settings.repo)
    sync(settings.device)
    per_step = sum(sites.values()) / counted
    figures = {"syncs_per_step": per_step, "meets_goal": per_step <= goal}
    figures["sites"] = [f"{site} x{n}" for site, n in sites.most_common()]
    try:
        calls = profiled_syncs(step, counted)
        figures["profiled_blocking_calls_per_step"] = sum(calls.values()) / counted
        figures["profiled_calls"] = calls
    except Exception as error:  # the corroborating count is optional; say why it is missing
        figures["profiled_calls"] = f"profiler failed: {type(error).__name__}: {error}"
    return figures


def _measure(settings: Settings, work: Workload, policy: str, optimizer: str) -> dict:
    warmup, counted = _steps(settings)
    device = settings.device
    if policy.startswith("torch"):
        step, mp = torch_step(work, device, torch.float16 if "fp16" in policy else torch.bfloat16)
    else:
        step, mp = mixprec_step(work, device, policy, optimizer)
    for _ in range(warmup):
        step()
    sync(device)
    figures: dict = {"goal": GOALS[optimizer], "steps_counted": counted}
    if settings.cuda:
        figures.update(_count(settings, step, counted, GOALS[optimizer]))
    else:
        for _ in range(counted):
            step()
        figures.update(syncs_per_step=None, meets_goal=None)
    if mp is not None:
        figures["skipped_steps"] = mp.stats().skipped_steps  # reads device values: after the counted steps
    return figures


def run(settings: Settings, part: Part) -> None:
    if not settings.cuda:
        part.meta["note"] = "sync counting needs CUDA (torch.cuda.set_sync_debug_mode); the steps ran uncounted"
    for model, work in _workloads(settings).items():
        for policy, optimizer in CASES:
            label = {"model": model, "policy": policy, "optimizer": optimizer}
            part.case(label, lambda w=work, p=policy, o=optimizer: _measure(settings, w, p, o))
