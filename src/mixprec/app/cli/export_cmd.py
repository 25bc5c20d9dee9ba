"""``mixprec export``: a run's weights in half precision, evaluated and timed against FP32."""

from __future__ import annotations

import argparse

from mixprec.app.cli.arg_types import file_path, whole_number
from mixprec.app.cli.table import render_table

EXPORT_DTYPES = ("fp16", "bf16")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "export",
        help="save a run's weights in fp16/bf16 and compare them with FP32 on the test set (else validation)",
        description="Export a trained run's weights as safetensors in half precision; evaluate and time both.",
    )
    parser.add_argument("run_dir", type=file_path, metavar="RUN", help="a run folder written by mixprec train")
    parser.add_argument("--dtype", choices=list(EXPORT_DTYPES), default="bf16", help="export dtype (default bf16)")
    parser.add_argument("--repeats", type=whole_number(), default=5, help="timed passes over the test set (default 5)")
    parser.add_argument(
        "--allow-foreign-checkpoint", action="store_true", help="export a checkpoint of another run (warns)"
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1; received {args.repeats}.")
    from mixprec.app.config import TrainConfig

    TrainConfig.load(args.run_dir)  # not a run folder: said before torch loads
    from mixprec.app.export import export_run  # the 'train' extra

    result = export_run(args.run_dir, args.dtype, args.repeats, allow_foreign_checkpoint=args.allow_foreign_checkpoint)
    metric = result.metric
    headers = [
        "weights",
        "file",
        "size MB",
        "size vs fp32",
        *([metric] if metric else []),
        "loss",
        "samples/s",
        "speed vs fp32",
    ]
    rows = []
    for name, path, size, evaluation, speed in (
        ("fp32", result.fp32_path, result.fp32_bytes, result.fp32_eval, result.fp32_samples_per_s),
        (result.dtype, result.half_path, result.half_bytes, result.half_eval, result.half_samples_per_s),
    ):
        rows.append(
            [
                name,
                path.name,
                f"{size / 2**20:.3f}",
                f"{size / result.fp32_bytes:.2f}x",
                *([f"{evaluation[metric]:.4f}"] if metric else []),
                f"{evaluation['loss']:.4f}",
                f"{speed:,.0f}",
                f"{speed / result.fp32_samples_per_s:.2f}x",
            ]
        )
    print(render_table(headers, rows))
    delta = {k: result.half_eval[k] - result.fp32_eval[k] for k in result.fp32_eval}
    changes = ", ".join(f"{k} change {v:+.4f}" for k, v in delta.items())
    print(f"\n{changes} in {result.dtype} (on the {result.split} data)")
    print(f"written: {result.half_path} and {result.fp32_path}")
    return 0
