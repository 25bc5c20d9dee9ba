"""Seed 002's BERT tables on this machine: fine-tuning and serving the pretrained MiniLM encoder per precision.

    python benchmarks/bert_table.py [--seeds 0,1,2] [--policies fp32,mixed_bf16,o2_bf16,pure_bf16,mixed_fp16]
    python benchmarks/bert_table.py --dry-run          # tiny sizes, one seed, two policies: the script runs
    python benchmarks/bert_table.py --from-json FILE   # the tables again from saved results

Training: ``mixprec train minilm`` per policy and seed (the same data and head initialisation per seed),
one run at a time: sequences per second over the run, and accuracy on the held-out test split with the
model as trained (in its policy's region); mean and spread (min-max) over the seeds. Inference:
``mixprec serve-bench`` on the first seed's mixed_bf16 run (the weights a user would serve), every
precision side by side in one process: latency at batch 1, throughput at batch 8 and 64, sequence
length 128, model size, test accuracy. Writes benchmarks/results/bert_table.json (with the machine)
and the Markdown tables to benchmarks/results/bert_table.md. On a GPU it runs unchanged (CUDA is used
when present).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

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


def _spread(values: list[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:.3f}"
    return f"{statistics.mean(values):.3f} ({min(values):.3f}-{max(values):.3f})"


def render(payload: dict) -> str:
    """Both tables in Markdown, from the JSON payload alone."""
    runs, serving = payload["training"], payload["inference"]
    policies = list(dict.fromkeys(r["policy"] for r in runs))
    speed = {p: statistics.mean(r["samples_per_s"] for r in runs if r["policy"] == p) for p in policies}
    base = speed.get("fp32", next(iter(speed.values())))
    lines = [
        f"Machine: {payload['machine'].get('cpu', '?')}, torch {payload['machine'].get('torch', '?')}; "
        f"seeds {', '.join(map(str, payload['seeds']))}.",
        "",
        "| training precision | batch | sequences/s | speed-up vs fp32 | test accuracy, mean (min-max) | skipped |",
        "|---|---|---|---|---|---|",
    ]
    for p in policies:
        mine = [r for r in runs if r["policy"] == p]
        accuracy = _spread([r["test"]["accuracy"] for r in mine])
        skipped = sum(r["skipped_steps"] for r in mine)
        lines.append(f"| {p} | {mine[0]['batch']} | {speed[p]:.1f} | {speed[p] / base:.2f}x | {accuracy} | {skipped} |")
    lines += [
        "",
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
    return "\n".join(lines) + "\n"


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
