"""Accuracy of each FP8/FP4 training recipe on charlm, against bf16's own seed spread (emulated; any device).

    python benchmarks/fp8_recipes_accuracy.py [--steps 300] [--seeds 0,1,2] [--recipes current,rowwise,...,pure_bf16]
        [--recipe-seeds 0] [--out benchmarks/results/fp8_recipes]

Trains charlm (TinyGPT 4x192) under ``mixed_bf16`` for each of ``--seeds`` (its spread), then under
``fp8=hybrid(scaling=RECIPE)`` for each recipe and each of ``--recipe-seeds``, all from the same data, and
writes ``results.json`` (every run's validation loss and ms/step, with the machine) and ``report.md``: each
recipe's validation loss against bf16's mean, and whether it lies within two of bf16's seed standard
deviations. Runs already in ``results.json`` are kept (the script resumes; delete the file to start over),
so a long sweep can be split over several calls. One heavy process at a time: the ms/step are only
indicative when anything else runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from mixprec.app.config import TrainConfig
from mixprec.app.machine import machine_info
from mixprec.app.run import run_training

RECIPES = ("current", "delayed", "rowwise", "blockwise", "mxfp8", "mxfp4", "nvfp4", "pure_bf16")


def _policy(recipe: str) -> str:
    if recipe == "bf16":
        return "mixed_bf16"
    if recipe == "pure_bf16":  # FP8 layers (current scaling) on bf16 weights with the compensated AdamW
        return "base=pure_bf16,fp8=hybrid"
    return f"base=fp8,fp8=hybrid(scaling={recipe})"


def _run(recipe: str, seed: int, steps: int, scratch: Path) -> dict:
    config = TrainConfig(task="charlm", policy=_policy(recipe), steps=steps, seed=seed, log_every=50)
    started = time.perf_counter()
    outcome = run_training(config, scratch / f"{recipe}-{seed}", progress=False)
    loss = outcome.result.eval.get("loss", float("nan"))
    return {
        "recipe": recipe,
        "policy": config.policy,
        "seed": seed,
        "steps": outcome.result.steps,
        "val_loss": loss,
        "ms_per_step": round(outcome.result.ms_per_step, 1),
        "skipped_steps": outcome.result.stats.skipped_steps,
        "seconds": round(time.perf_counter() - started, 1),
    }


def _report(runs: list[dict], steps: int) -> str:
    bf16 = [r["val_loss"] for r in runs if r["recipe"] == "bf16"]
    lines = [f"# FP8/FP4 recipes on charlm: validation loss after {steps} steps", ""]
    if len(bf16) < 2:
        return "\n".join([*lines, "bf16's spread needs at least two seeds."])
    mean, sd = statistics.mean(bf16), statistics.stdev(bf16)
    lines += [
        f"bf16 over {len(bf16)} seeds: mean {mean:.4f}, standard deviation {sd:.4f}, range "
        f"{min(bf16):.4f}-{max(bf16):.4f}. Within the spread: |loss - bf16 mean| <= 2 sd = {2 * sd:.4f}.",
        "",
        "| recipe | seed | validation loss | vs bf16 mean | vs bf16, same seed | within the spread | skipped steps "
        "| ms/step (emulated) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    same_seed = {r["seed"]: r["val_loss"] for r in runs if r["recipe"] == "bf16"}
    for r in runs:
        delta = r["val_loss"] - mean
        within = "yes" if abs(delta) <= 2 * sd else "no"
        paired = same_seed.get(r["seed"])
        versus = f"{(r['val_loss'] - paired) / paired:+.2%}" if paired and r["recipe"] != "bf16" else "-"
        lines.append(
            f"| {r['recipe']} | {r['seed']} | {r['val_loss']:.4f} | {delta / mean:+.2%} | {versus} | "
            f"{within if r['recipe'] != 'bf16' else '-'} | {r['skipped_steps']} | {r['ms_per_step']} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seeds", default="0,1,2", help="bf16's seeds (its spread)")
    parser.add_argument("--recipes", default=",".join(RECIPES))
    parser.add_argument("--recipe-seeds", default="0")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/fp8_recipes"))
    args = parser.parse_args(argv)
    recipes = [r.strip() for r in args.recipes.split(",") if r.strip()]
    unknown = sorted(set(recipes) - set(RECIPES))
    if unknown:
        parser.error(f"--recipes: unknown {', '.join(unknown)}; use some of {', '.join(RECIPES)}")
    plan = [("bf16", int(s)) for s in args.seeds.split(",")]
    plan += [(r, int(s)) for r in recipes for s in args.recipe_seeds.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)
    results = args.out / "results.json"
    saved = json.loads(results.read_text()) if results.exists() else {"machine": machine_info(), "runs": []}
    if saved.get("steps", args.steps) != args.steps:
        parser.error(f"--steps {args.steps}: {results} holds {saved['steps']}-step runs; use another --out")
    saved["steps"] = args.steps
    done = {(r["recipe"], r["seed"]) for r in saved["runs"]}
    scratch = Path("runs") / f"fp8-recipes-{time.strftime('%Y%m%d-%H%M%S')}"
    for recipe, seed in plan:
        if (recipe, seed) in done:
            continue
        print(f"== {recipe}, seed {seed}", flush=True)
        saved["runs"].append(_run(recipe, seed, args.steps, scratch))
        print(json.dumps(saved["runs"][-1]), flush=True)
        results.write_text(json.dumps(saved, indent=1))  # after every run: a long sweep loses nothing
        (args.out / "report.md").write_text(_report(saved["runs"], args.steps))
    (args.out / "report.md").write_text(_report(saved["runs"], args.steps))
    print((args.out / "report.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
