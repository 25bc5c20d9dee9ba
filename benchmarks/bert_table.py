"""Seed 002's BERT tables on this machine: fine-tuning and serving the pretrained MiniLM encoder per precision.

    python benchmarks/bert_table.py [--seeds 0,1,2] [--policies fp32,mixed_bf16,o2_bf16,pure_bf16,mixed_fp16]
    python benchmarks/bert_table.py --dry-run          # tiny sizes, one seed, two policies: the script runs
    python benchmarks/bert_table.py --from-json FILE   # the tables again from saved results

Training: ``mixprec train minilm`` per policy and seed (the same data and head initialisation per seed),
one run at a time: sequences per second over the run, and accuracy on the held-out test split with the
model as trained (in its policy's region); mean and spread (min-max) over the seeds. Then the training
step side by side (``mixprec bench --suite step,memory --models minilm``: one batch of 16 x 128 tokens,
every policy and the hand-written torch loops interleaved in one process, wall and CPU time) and its
memory (bytes of model state per parameter, activations saved for backward, peak RSS). Inference:
``mixprec serve-bench`` on the first seed's mixed_bf16 run (the weights a user would serve), every
precision side by side in one process: latency at batch 1, throughput at batch 8 and 64, sequence
length 128, model size, test accuracy. Writes benchmarks/results/bert_table.json (with the machine)
and the Markdown tables to benchmarks/results/bert_table.md. On a GPU it runs unchanged (CUDA is used
when present).
"""

from __future__ import annotations

import argparse
import functools
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

from mixprec.app.bench.suites import MODELS, memory_suite, step_suite
from mixprec.app.config import TrainConfig
from mixprec.app.evaluate import evaluate
from mixprec.app.export import fp32_weights
from mixprec.app.machine import machine_info
from mixprec.app.run import build_trainer, run_training
from mixprec.app.serve_bench import as_records, serve_bench

RESULTS = Path(__file__).parent / "results"
POLICIES = "fp32,mixed_bf16,o2_bf16,pure_bf16,mixed_fp16"


def _test_split(run_dir: Path) -> tuple[dict[str, float], int]:
    """The run's model as trained (its policy's dtypes and region) on the task's held-out test split, and
    its training batch size."""
    trainer, parts, _ = build_trainer(TrainConfig.load(run_dir), None, progress=False)
    fp32_weights(run_dir, trainer, allow_foreign=False)  # loads the newest checkpoint into the trainer
    test = evaluate(trainer.model, parts.test_data, parts.loss_fn, parts.metric, trainer.mp.autocast, trainer.device)
    return test, getattr(parts.train_data, "batch_size", 0)


def _train(policy: str, seed: int, size: str, work: Path) -> dict:
    run_dir = work / f"{policy}-seed{seed}"
    outcome = run_training(TrainConfig(task="minilm", policy=policy, seed=seed, size=size), run_dir, progress=False)
    test, batch = _test_split(run_dir)
    print(f"{policy:11s} seed {seed}: {outcome.result.samples_per_s:7.1f} seq/s, test accuracy {test['accuracy']:.4f}")
    return {
        "policy": policy,
        "seed": seed,
        "batch": batch,
        "steps": outcome.result.steps,
        "samples_per_s": outcome.result.samples_per_s,
        "skipped_steps": outcome.result.stats.skipped_steps,
        "validation": outcome.result.eval,
        "test": test,
        "run_dir": str(run_dir),
    }


def spread(values: list[float], digits: int = 3) -> str:
    """The mean of ``values`` and, over several, their min-max: ``0.812 (0.790-0.830)``."""
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    return f"{statistics.mean(values):.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def render(payload: dict) -> str:
    """The tables in Markdown, from the JSON payload alone."""
    machine = payload["machine"]
    lines = [
        f"Machine: {machine.get('cpu', '?')} ({machine.get('isa', '?')}), "
        f"{machine.get('torch_threads', '?')} threads, torch "
        f"{machine.get('torch', '?')}; seeds {', '.join(map(str, payload['seeds']))}.",
        "",
        *_fine_tune_rows(payload["training"]),
    ]
    if payload.get("steps"):  # results written before the side-by-side step was added have none
        lines += ["", *_step_rows(payload["steps"], payload["memory"], *payload["step_shape"])]
    lines += ["", *_inference_rows(payload["inference"])]
    return "\n".join(lines) + "\n"


def _fine_tune_rows(runs: list[dict]) -> list[str]:
    policies = list(dict.fromkeys(r["policy"] for r in runs))
    speed = {p: statistics.mean(r["samples_per_s"] for r in runs if r["policy"] == p) for p in policies}
    base = speed.get("fp32", next(iter(speed.values())))
    lines = [
        "| fine-tuning precision | batch | sequences/s, mean (min-max) | vs fp32 | test accuracy, mean (min-max) "
        "| test loss, mean (min-max) | skipped steps |",
        "|---|---|---|---|---|---|---|",
    ]
    for p in policies:
        mine = [r for r in runs if r["policy"] == p]
        accuracy, loss = (spread([r["test"][key] for r in mine]) for key in ("accuracy", "loss"))
        skipped = sum(r["skipped_steps"] for r in mine)
        lines.append(
            f"| {p} | {mine[0]['batch']} | {spread([r['samples_per_s'] for r in mine], 1)} | {speed[p] / base:.2f}x "
            f"| {accuracy} | {loss} | {skipped} |"
        )
    return lines


def _step_rows(steps: list[dict], memory: list[dict], batch: int, tokens: int) -> list[str]:
    """The training step side by side, with the memory figures of each policy."""
    by_policy = {m["policy"]: m for m in memory}
    lines = [
        f"Training step side by side (batch {batch} x {tokens} tokens, interleaved in one process):",
        "",
        "| mode | ms/step | sequences/s | vs fp32 (wall / CPU) | vs hand-written twin | model state bytes/param "
        "| saved activations vs fp32 | peak RSS MB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in steps:
        m = by_policy.get(r["mode"])
        twin = f"{r['overhead_vs_torch']:.2f}x" if r["overhead_vs_torch"] else "-"
        state = f"{m['state_bytes_per_param']:.1f}" if m else "-"
        saved = f"{m['activations_vs_fp32']:.2f}x" if m else "-"
        rss = f"{m['peak_rss_bytes'] / 2**20:.0f}" if m and m["peak_rss_bytes"] else "-"
        lines.append(
            f"| {r['mode']} | {r['median_ms']:.0f} | {1e3 * batch / r['median_ms']:.1f} "
            f"| {r['vs_fp32']:.2f}x / {r['cpu_vs_fp32']:.2f}x | {twin} | {state} | {saved} | {rss} |"
        )
    return lines


def _inference_rows(serving: dict) -> list[str]:
    lines = [
        f"Inference (seq {serving['seq']}, weights of `{serving['run']}`):",
        "",
        "| precision | size MB | latency p50 / p95 ms (batch 1) | batch | sequences/s | vs fp32 | test accuracy |",
        "|---|---|---|---|---|---|---|",
    ]
    reference = serving["results"][0]
    for r in serving["results"]:
        for batch, rate in r["throughput"].items():
            speedup = rate / reference["throughput"][batch]
            latency = f"{r['latency_p50_ms']:.1f} / {r['latency_p95_ms']:.1f}"
            lines.append(
                f"| {r['mode']} | {r['size_bytes'] / 2**20:.1f} | {latency} | {batch} | {rate:.1f} | {speedup:.2f}x "
                f"| {r['evaluation']['accuracy']:.3f} |"
            )
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--policies", default=POLICIES)
    parser.add_argument("--dry-run", action="store_true", help="tiny sizes, one seed, two policies")
    parser.add_argument("--from-json", type=Path, default=None, help="render the tables from saved results")
    parser.add_argument("--out", type=Path, default=None, help="default: benchmarks/results/bert_table.json")
    args = parser.parse_args()
    if args.from_json:
        print(render(json.loads(args.from_json.read_text())), end="")
        return 0
    seeds = [0] if args.dry_run else [int(s) for s in args.seeds.split(",")]
    policies = ["fp32", "mixed_bf16"] if args.dry_run else args.policies.split(",")
    size, batches, seq = ("tiny", (1, 2), 16) if args.dry_run else ("default", (1, 8, 64), 128)
    work = Path(tempfile.mkdtemp(prefix="mixprec-bert-table-"))
    args.out = args.out or (work / "bert_table.json" if args.dry_run else RESULTS / "bert_table.json")
    runs = [_train(policy, seed, size, work) for seed in seeds for policy in policies]
    # dry run: the same model at 2 x 16 tokens, one timed repeat, no peak-RSS processes
    shape = (2, 16) if args.dry_run else (16, 128)  # MODELS' minilm: 16 x 128
    builders = {"minilm": functools.partial(MODELS["minilm"], *shape)}
    steps = step_suite(["minilm"], policies, repeats=1 if args.dry_run else 7, builders=builders)
    memory = memory_suite(["minilm"], policies, rss=not args.dry_run, builders=builders)  # RSS: MODELS' minilm
    served = work / f"{'mixed_bf16' if 'mixed_bf16' in policies else policies[0]}-seed{seeds[0]}"
    try:
        results = serve_bench(
            served, batches, seq, repeats=1 if args.dry_run else 3, latency_samples=3 if args.dry_run else 30
        )
    finally:
        for run in runs:  # each holds checkpoints of the whole model
            shutil.rmtree(run["run_dir"], ignore_errors=True)
    payload = {
        "command": "python " + " ".join(sys.argv),
        "machine": machine_info(),
        "seeds": seeds,
        "training": runs,
        "step_shape": list(shape),
        "steps": steps,
        "memory": memory,
        "inference": {"run": served.name, "seq": seq, "results": as_records(results)},
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(payload, indent=1) + "\n")
    table = render(payload)
    args.out.with_suffix(".md").write_text(table)
    print(table, end="")
    print(f"wrote {args.out} and {args.out.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
