"""The benchmark suites: step time, memory, accuracy and GEMM throughput, each policy beside FP32.

Every suite returns plain records (dicts) for JSON and tables; nothing is printed from here.

    step      one training step (forward, backward, AdamW) per policy, against hand-written torch loops
              of the same model (FP32, torch.autocast bf16, bf16 model + FP32 masters + fused AdamW):
              wall and CPU time vs FP32 and against the matching hand-written loop
    memory    model-state bytes per parameter, saved-activation bytes and peak RSS, as ratios to FP32
    accuracy  final eval metric per policy over several seeds (digits), and charlm validation loss
    gemm      GEMM GFLOP/s per dtype, as a ratio to FP32 and to the best rate measured
"""

from __future__ import annotations

import functools
import multiprocessing
import resource
import statistics
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from mixprec.app.bench.timing import interleaved
from mixprec.app.optimizer import adamw_for
from mixprec.compute import EmulatedAutocast
from mixprec.engine import MixedPrecision, saved_activation_bytes
from mixprec.policy import get_policy

__all__ = ["MODELS", "accuracy_suite", "gemm_suite", "memory_suite", "mixprec_step", "step_suite", "torch_step"]

_LIMIT = "torch bf16 + fp32 masters"  # the hand-written loop o2_bf16 and pure_bf16 are held to


@dataclass(frozen=True)
class BenchModel:
    """A model and one batch; ``loss(model, batch)`` computes the training loss."""

    build: Callable[[], nn.Module]
    batch: Callable[[], tuple[torch.Tensor, torch.Tensor]]
    loss: Callable[[object, torch.Tensor], torch.Tensor]


def _mlp() -> BenchModel:
    def build():
        return nn.Sequential(nn.Linear(1024, 2048), nn.GELU(), nn.Linear(2048, 2048), nn.GELU(), nn.Linear(2048, 10))

    return BenchModel(build, lambda: (torch.randn(256, 1024), torch.randint(0, 10, (256,))), F.cross_entropy)


def _cnn() -> BenchModel:
    from mixprec.app.tasks.digits import DigitsCNN

    return BenchModel(
        lambda: DigitsCNN(width=64),
        lambda: (torch.randn(256, 1, 8, 8), torch.randint(0, 10, (256,))),
        F.cross_entropy,
    )


def _gpt() -> BenchModel:
    from mixprec.app.tasks.byte_corpus import lm_loss
    from mixprec.app.tasks.tiny_gpt import GPTConfig, TinyGPT

    config = GPTConfig(layers=6, width=384, heads=6, context=256)
    return BenchModel(
        lambda: TinyGPT(config),
        lambda: (torch.randint(0, 256, (8, 256)), torch.randint(0, 256, (8, 256))),
        lm_loss,
    )


def _hf() -> BenchModel:
    from transformers import GPT2Config, GPT2LMHeadModel

    from mixprec.app.tasks.byte_corpus import lm_loss

    config = GPT2Config(
        vocab_size=256,
        n_positions=256,
        n_embd=384,
        n_layer=6,
        n_head=6,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=None,
        eos_token_id=None,
        attn_implementation="sdpa",
    )
    return BenchModel(
        lambda: GPT2LMHeadModel(config),
        lambda: (torch.randint(0, 256, (8, 256)), torch.randint(0, 256, (8, 256))),
        lm_loss,
    )


def _minilm(batch: int = 16, tokens: int = 128) -> BenchModel:
    """The pretrained all-MiniLM-L6-v2 classifier of the minilm task (extra: nlp), loaded once, one batch
    of ``tokens`` unpadded tokens: the task's training step at its longest (its batches pad to their own
    length, at most 128). Token values do not change the work, so they are drawn at random."""
    import copy

    from mixprec.app.task import classification_loss
    from mixprec.app.tasks.docstrings import LABELS
    from mixprec.app.tasks.minilm import MiniLMClassifier, load_encoder, model_folder

    torch.manual_seed(0)
    pretrained = MiniLMClassifier(load_encoder(model_folder())[0], len(LABELS))
    vocab = pretrained.encoder.config.vocab_size
    return BenchModel(
        lambda: copy.deepcopy(pretrained),
        lambda: (torch.randint(1000, vocab, (batch, tokens)), torch.randint(0, len(LABELS), (batch,))),
        classification_loss,
    )


MODELS: dict[str, Callable[[], BenchModel]] = {"mlp": _mlp, "cnn": _cnn, "gpt": _gpt, "hf": _hf, "minilm": _minilm}


def _optimizer(model: nn.Module, policy: str | None) -> torch.optim.Optimizer:
    device = next(model.parameters()).device
    return adamw_for(get_policy(policy or "fp32"), model.parameters(), device, lr=1e-4)


def _fresh(bench: BenchModel) -> nn.Module:
    torch.manual_seed(0)
    return bench.build()


def torch_step(bench: BenchModel, dtype: torch.dtype | None, compiled: bool = False) -> Callable[[], None]:
    """The hand-written loop: torch.autocast (or nothing), backward, AdamW, zero_grad (``compiled``: the
    model through torch.compile)."""
    model, (x, y) = _fresh(bench), bench.batch()
    optimizer = _optimizer(model, None)
    forward = torch.compile(model) if compiled else model

    def step() -> None:
        with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            loss = bench.loss(forward(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def _master_limit_step(bench: BenchModel) -> Callable[[], None]:
    """The hand-written limit of o2/pure_bf16: a bf16 model under torch.autocast, FP32 master copies
    stepped by fused AdamW, the result copied back in one foreach pass; nothing else."""
    model, (x, y) = _fresh(bench), bench.batch()
    model.to(torch.bfloat16)
    params = [p for p in model.parameters() if p.requires_grad]
    masters = [p.detach().float() for p in params]
    optimizer = torch.optim.AdamW(masters, lr=1e-4, fused=True)

    def step() -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = bench.loss(model(x), y)
        loss.backward()
        for master, param in zip(masters, params, strict=True):
            master.grad = param.grad.float()
        optimizer.step()
        with torch.no_grad():
            torch._foreach_copy_(params, masters)
        model.zero_grad(set_to_none=True)
        optimizer.zero_grad(set_to_none=True)  # the masters' gradients too: nothing held between steps

    return step


def mixprec_step(
    bench: BenchModel,
    policy: str,
    optimizer: Callable[[nn.Module], torch.optim.Optimizer] | None = None,
    compiled: bool = False,
) -> tuple[Callable[[], None], MixedPrecision]:
    """One MixedPrecision training step of ``bench`` under ``policy`` (AdamW, or ``optimizer(model)``;
    ``compiled``: the model through torch.compile, inside mixprec's region)."""
    model, (x, y) = _fresh(bench), bench.batch()
    mp = MixedPrecision(model, optimizer(model) if optimizer else _optimizer(model, policy), policy)
    forward = torch.compile(model) if compiled else model

    def step() -> None:
        with mp.autocast():
            loss = bench.loss(forward(x), y)
        mp.backward(loss)
        mp.step()

    return step, mp


def step_suite(
    models: list[str], policies: list[str], repeats: int = 7, builders: Mapping[str, Callable[[], BenchModel]] = MODELS
) -> list[dict]:
    """Median step time per mode; ratios to the hand-written FP32 loop and to the matching torch loop.
    ``builders`` maps the model names to their BenchModel (default :data:`MODELS`)."""
    records = []
    for name in models:
        bench = builders[name]()
        steps: dict[str, Callable[[], None]] = {
            "torch fp32": torch_step(bench, None),
            "torch autocast bf16": torch_step(bench, torch.bfloat16),
            _LIMIT: _master_limit_step(bench),
        }
        plans = {}
        for policy in policies:
            steps[policy], mp = mixprec_step(bench, policy)
            plans[policy] = f"{mp.compute_plan.mode}: {mp.compute_plan.reason}"
        timings = interleaved(steps, repeats=repeats)
        reference = timings["torch fp32"]
        matching = {"fp32": "torch fp32", "mixed_bf16": "torch autocast bf16", "o2_bf16": _LIMIT, "pure_bf16": _LIMIT}
        for mode, timing in timings.items():
            twin = timings.get(matching.get(mode, ""))
            records.append(
                {
                    "model": name,
                    "mode": mode,
                    "median_ms": timing.median_ms,
                    "spread_ms": timing.spread_ms,
                    "repeats": timing.repeats,
                    "cpu_ms": timing.cpu_median_ms,
                    "vs_fp32": timing.median_ms / reference.median_ms,
                    "cpu_vs_fp32": timing.cpu_median_ms / reference.cpu_median_ms,
                    "overhead_vs_torch": timing.median_ms / twin.median_ms if twin else None,
                    "cpu_vs_torch": timing.cpu_median_ms / twin.cpu_median_ms if twin else None,
                    "compute": plans.get(mode, "torch"),
                }
            )
    return records


def _peak_rss_child(model: str, policy: str, queue) -> None:
    bench = MODELS[model]()
    step, _ = mixprec_step(bench, policy)
    for _ in range(2):
        step()
    queue.put(_high_water_rss())


def _high_water_rss() -> int:
    """This process's peak resident set in bytes. VmHWM belongs to this address space; ru_maxrss would
    also carry the parent's peak across the exec that starts a spawned process."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux, bytes on macOS


def _peak_rss(model: str, policy: str) -> int:
    """Peak resident memory of a fresh process that builds the model and trains two steps."""
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    process = context.Process(target=_peak_rss_child, args=(model, policy, queue))
    process.start()
    value = queue.get(timeout=600)
    process.join()
    return value


def memory_suite(
    models: list[str], policies: list[str], rss: bool = True, builders: Mapping[str, Callable[[], BenchModel]] = MODELS
) -> list[dict]:
    """Bytes of model state per parameter, saved activations and peak RSS (of :data:`MODELS`' model, in a
    fresh process), with ratios to FP32."""
    records = []
    for name in models:
        bench = builders[name]()
        x, _ = bench.batch()
        rows = {}
        for policy in ["fp32", *[p for p in policies if p != "fp32"]]:
            step, mp = mixprec_step(bench, policy)
            step()
            with mp.autocast():
                activations = saved_activation_bytes(lambda: mp.model(x), mp.model)  # noqa: B023 (runs now)
            rows[policy] = {
                "model": name,
                "policy": policy,
                "state_bytes_per_param": mp.stats().bytes_per_param.total,
                "saved_activation_bytes": activations,
                "peak_rss_bytes": _peak_rss(name, policy) if rss else None,
            }
        base = rows["fp32"]
        for row in rows.values():
            row["activations_vs_fp32"] = row["saved_activation_bytes"] / base["saved_activation_bytes"]
            row["rss_vs_fp32"] = row["peak_rss_bytes"] / base["peak_rss_bytes"] if rss else None
            records.append(row)
    return records


def accuracy_suite(policies: list[str], seeds: list[int], charlm_steps: int = 300) -> list[dict]:
    """digits test accuracy and charlm (2x128 GPT) validation loss, per policy and seed."""
    from mixprec.app.config import TrainConfig
    from mixprec.app.run import build_trainer

    records = []
    for policy in policies:
        for seed in seeds:
            trainer, _, _ = build_trainer(TrainConfig(task="digits", policy=policy, seed=seed), None, progress=False)
            result = trainer.fit(epochs=15)
            records.append({"task": "digits", "policy": policy, "seed": seed, "metric": result.eval["accuracy"]})
        for seed in seeds:
            trainer, _, _ = build_trainer(
                TrainConfig(task="charlm", policy=policy, seed=seed, steps=charlm_steps), None, progress=False
            )
            result = trainer.fit(steps=charlm_steps)
            records.append({"task": "charlm", "policy": policy, "seed": seed, "metric": result.eval["loss"]})
    return records


def gemm_suite(sizes: tuple[int, ...] = (512, 1024, 2048), repeats: int = 7) -> list[dict]:
    """GFLOP/s of an n x n x n matmul per dtype: FP32, bf16, fp16 (PyTorch's kernels), fp16 emulated."""
    records = []
    for n in sizes:
        a, b = torch.randn(n, n), torch.randn(n, n)
        modes = {
            "fp32": functools.partial(torch.matmul, a, b),
            "bf16": functools.partial(torch.matmul, a.bfloat16(), b.bfloat16()),
            "fp16 (torch)": functools.partial(torch.matmul, a.half(), b.half()),
            "fp16 (emulated)": functools.partial(_emulated_matmul, a.half(), b.half()),
        }
        timings = interleaved(modes, repeats=repeats if n <= 1024 else max(3, repeats // 2), warmup=1)
        flops = 2 * n**3
        for mode, timing in timings.items():
            records.append({"n": n, "dtype": mode, "gflops": flops / timing.median_ms / 1e6})
    best = {r["dtype"]: max(x["gflops"] for x in records if x["dtype"] == r["dtype"]) for r in records}
    peak = max(best.values())
    for record in records:
        fp32 = next(x["gflops"] for x in records if x["n"] == record["n"] and x["dtype"] == "fp32")
        record["vs_fp32"] = record["gflops"] / fp32
        record["of_best_measured"] = record["gflops"] / peak
    return records


def _emulated_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    with EmulatedAutocast(torch.float16):
        return a @ b


def summarize_accuracy(records: list[dict]) -> list[dict]:
    """Mean and seed spread per (task, policy), and the difference to FP32's mean."""
    out = []
    for task in sorted({r["task"] for r in records}):
        means = {}
        for policy in dict.fromkeys(r["policy"] for r in records if r["task"] == task):
            values = [r["metric"] for r in records if r["task"] == task and r["policy"] == policy]
            means[policy] = statistics.mean(values)
            out.append(
                {
                    "task": task,
                    "policy": policy,
                    "mean": means[policy],
                    "spread": max(values) - min(values),
                    "seeds": len(values),
                }
            )
        for row in out:
            if row["task"] == task and "fp32" in means:
                row["vs_fp32"] = row["mean"] - means["fp32"]
                row["vs_fp32_relative"] = row["vs_fp32"] / means["fp32"]
    return out
