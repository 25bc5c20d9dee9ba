"""``mixprec bench``: the benchmark suite; tables on screen, JSON (with the machine) on disk."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from mixprec.app.cli.arg_types import file_path, whole_number
from mixprec.app.cli.table import render_table

SUITES = ("step", "memory", "accuracy", "gemm")
DEFAULT_POLICIES = "fp32,mixed_bf16,mixed_fp16,o2_bf16,pure_bf16"


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "bench",
        help="the benchmark suite: speed, memory, accuracy, GEMM throughput per policy",
        description="Measure every policy side by side against FP32 and hand-written torch loops.",
    )
    parser.add_argument("--suite", default=",".join(SUITES), help=f"suites to run (default: {','.join(SUITES)})")
    parser.add_argument("--models", default="mlp,cnn,gpt", help="models for step/memory: mlp, cnn, gpt, hf, minilm")
    parser.add_argument("--policies", default=DEFAULT_POLICIES, help=f"policies (default: {DEFAULT_POLICIES})")
    parser.add_argument("--seeds", default="0,1,2", help="seeds for the accuracy suite (default 0,1,2)")
    parser.add_argument("--repeats", type=whole_number(), default=7, help="timed repeats per mode (default 7)")
    parser.add_argument("--quick", action="store_true", help="small models, one seed, 3 repeats, no RSS: a smoke run")
    parser.add_argument(
        "--out",
        type=file_path,
        default=Path("benchmarks/results"),
        help="folder for the JSON results (default benchmarks/results; with --quick, benchmarks/results/quick)",
    )
    parser.set_defaults(run=run)


def _list(text: str, name: str, valid: tuple[str, ...] | None = None) -> list[str]:
    items = [t.strip() for t in text.split(",") if t.strip()]
    bad = [t for t in items if valid is not None and t not in valid]
    if not items or bad:
        raise ValueError(f"--{name}: received {text!r}; choose from {', '.join(valid or ())}.")
    return items


def _seeds(text: str) -> list[int]:
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items or not all(t.isdigit() for t in items):
        raise ValueError(f"--seeds: received {text!r}; give whole numbers from 0, separated by commas: 0,1,2.")
    return [int(t) for t in items]


KIND = "bench results"


def run(args: argparse.Namespace) -> int:
    from mixprec.app.bench import suites  # imports the tasks' models
    from mixprec.app.machine import machine_info
    from mixprec.persist import check_overwrite, stamped, write_atomically
    from mixprec.policy import parse_policy_list

    chosen = _list(args.suite, "suite", SUITES)
    models = _list(args.models, "models", tuple(suites.MODELS))
    policies = [spec for spec, _ in parse_policy_list(args.policies)]
    seeds = _seeds(args.seeds)
    repeats = 3 if args.quick else args.repeats
    if repeats < 1:
        raise ValueError(f"--repeats must be >= 1; received {repeats}.")
    if args.quick:
        models, seeds = [m for m in models if m in ("mlp", "cnn")] or ["mlp"], seeds[:1]
        if "out" not in getattr(args, "given", ()):  # a smoke run's figures never replace a full run's
            args.out = args.out / "quick"
    if args.out.exists() and not args.out.is_dir():
        raise ValueError(f"--out {args.out}: is a file; name a folder for the results.")
    for suite in chosen:  # before the first bench's minutes: a result file mixprec did not write is refused
        check_overwrite(args.out / f"bench_{suite}.json", "--out", KIND, frozenset({"machine", "quick", "records"}))
    args.out.mkdir(parents=True, exist_ok=True)
    machine = machine_info()
    print(f"{machine['cpu']}, {machine['torch_threads']} threads, ISA: {machine['isa']}; torch {machine['torch']}")
    for suite in chosen:
        print(f"== {suite}", flush=True)
        if suite == "step":
            records = suites.step_suite(models, policies, repeats)
            print(_step_table(records))
        elif suite == "memory":
            records = suites.memory_suite(models, policies, rss=not args.quick)
            print(_memory_table(records))
        elif suite == "accuracy":
            raw = suites.accuracy_suite(policies, seeds, charlm_steps=50 if args.quick else 300)
            records = suites.summarize_accuracy(raw)
            print(_accuracy_table(records))
            records = {"summary": records, "runs": raw}
        else:
            records = suites.gemm_suite((256, 512) if args.quick else (512, 1024, 2048), repeats)
            print(_gemm_table(records))
        path = args.out / f"bench_{suite}.json"
        payload = stamped({"machine": machine, "quick": args.quick, "records": records}, KIND)
        write_atomically(path, json.dumps(payload, indent=2).encode())
        print(f"wrote {path}\n", flush=True)
    return 0


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def step_rows(records: list[dict]) -> tuple[list[str], list[list[str]]]:
    headers = ["model", "mode", "ms/step", "spread", "CPU ms", "time vs fp32", "CPU vs fp32", "vs torch loop",
               "CPU vs torch loop"]  # fmt: skip
    most = max((r.get("repeats", 0) for r in records), default=0)
    rows = [
        [r["model"], r["mode"], f"{r['median_ms']:.1f}", _spread(r, most), _ms(r.get("cpu_ms")),
         _ratio(r["vs_fp32"]), _ratio(r.get("cpu_vs_fp32")), _ratio(r["overhead_vs_torch"]),
         _ratio(r.get("cpu_vs_torch"))]
        for r in records
    ]  # fmt: skip
    return headers, rows


def _spread(record: dict, most: int) -> str:
    """The min-max spread; with the count of repeats for a mode cut short as too slow to time in full."""
    spread = f"{record['spread_ms']:.1f}"
    repeats = record.get("repeats", most)  # results written before repeats were recorded: all in full
    return spread if repeats == most else f"{spread} ({repeats} runs)"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def memory_rows(records: list[dict]) -> tuple[list[str], list[list[str]]]:
    headers = ["model", "policy", "state B/param", "activations MB", "vs fp32", "peak RSS MB", "vs fp32"]
    rows = [
        [r["model"], r["policy"], f"{r['state_bytes_per_param']:.1f}", f"{r['saved_activation_bytes'] / 2**20:.1f}",
         _ratio(r["activations_vs_fp32"]), "-" if r["peak_rss_bytes"] is None else f"{r['peak_rss_bytes'] / 2**20:.0f}",
         _ratio(r["rss_vs_fp32"])]
        for r in records
    ]  # fmt: skip
    return headers, rows


# what the accuracy suite measures per task: a positive "vs fp32" is better on one, worse on the other
_ACCURACY_METRIC = {"digits": "accuracy (higher is better)", "charlm": "val loss (lower is better)"}


def accuracy_rows(records: list[dict]) -> tuple[list[str], list[list[str]]]:
    headers = ["task", "metric", "policy", "mean", "seed spread", "seeds", "vs fp32", "vs fp32 %"]
    rows = [
        [r["task"], _ACCURACY_METRIC.get(r["task"], "eval metric"), r["policy"], f"{r['mean']:.4f}",
         f"{r['spread']:.4f}", str(r["seeds"]),
         f"{r.get('vs_fp32', float('nan')):+.4f}", f"{100 * r.get('vs_fp32_relative', float('nan')):+.2f}%"]
        for r in records
    ]  # fmt: skip
    return headers, rows


def gemm_rows(records: list[dict]) -> tuple[list[str], list[list[str]]]:
    headers = ["n", "dtype", "GFLOP/s", "vs fp32", "of best measured"]
    rows = [
        [str(r["n"]), r["dtype"], f"{r['gflops']:.0f}", _ratio(r["vs_fp32"]), f"{100 * r['of_best_measured']:.0f}%"]
        for r in records
    ]
    return headers, rows


def _step_table(records: list[dict]) -> str:
    return render_table(*step_rows(records), "llrrrrrrr")


def _memory_table(records: list[dict]) -> str:
    return render_table(*memory_rows(records), "llrrrrr")


def _accuracy_table(records: list[dict]) -> str:
    return render_table(*accuracy_rows(records), "lllrrrrr")


def _gemm_table(records: list[dict]) -> str:
    return render_table(*gemm_rows(records), "rlrrr")
