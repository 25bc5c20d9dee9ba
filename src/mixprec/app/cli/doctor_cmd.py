"""``mixprec doctor``: FP32 steps with the range hooks on; what fp16, bf16 and FP8 would do, and advice."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from mixprec.app.cli.arg_types import file_path, fraction, seed, whole_number
from mixprec.app.cli.table import render_table
from mixprec.app.cli.train_cmd import task_spec
from mixprec.app.config import SIZES


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "doctor",
        help="where values would underflow or overflow in fp16/bf16/FP8; the loss scale and policy to use",
        description=(
            "Run a task (or your model) for a few FP32 steps with range hooks on every module, then report per "
            "format the share of gradients lost without loss scaling, the loss scale that keeps them, the modules "
            "whose activations overflow, and a recommended policy with reasons."
        ),
    )
    parser.add_argument("task", nargs="?", help="a built-in task (digits, charlm, hf)")
    parser.add_argument("--model", metavar="MODULE:FACTORY", help="your own task: a factory returning TaskParts")
    parser.add_argument("--steps", type=whole_number(), default=20, help="batches to analyse (default 20)")
    parser.add_argument("--keep", type=fraction, default=0.999, help="share of gradients the scale must keep (0.999)")
    parser.add_argument("--formats", default="fp16,bf16,fp8_e4m3,fp8_e5m2", help="formats to analyse")
    parser.add_argument("--batch-size", type=whole_number(), help="samples per batch (default: the task's)")
    parser.add_argument("--seed", type=seed, default=0, help="seed for weights and data order (default 0)")
    parser.add_argument("--size", choices=SIZES, default="default", help="model and data size")
    parser.add_argument("--device", default="auto", help="cpu, cuda, cuda:1, or auto (default)")
    parser.add_argument(
        "--out", type=file_path, help="folder for report.json and histograms.png (default runs/doctor-TASK)"
    )
    parser.add_argument(
        "--fp8-recipes",
        action="store_true",
        help="also measure each GEMM layer's output error under each FP8 recipe (tensorwise, rowwise, blockwise, "
        "MXFP8, MXFP4, NVFP4) and say which layers to keep out of FP8 (writes fp8_recipes.json)",
    )
    parser.add_argument(
        "--apply",
        nargs="?",
        const=Path("mixprec-policy.json"),
        type=file_path,
        metavar="FILE",
        help="write the advice to FILE (default mixprec-policy.json) for `mixprec train --policy FILE`",
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    spec = task_spec(args)  # the flags first: a mistake is said before torch loads
    if args.steps < 1:
        raise ValueError(f"--steps: received {args.steps}; use a positive number of batches.")

    import torch

    from mixprec.app.evaluate import to_device
    from mixprec.app.histograms import plot_histograms
    from mixprec.app.run import resolve_device
    from mixprec.app.task import TaskConfig, build_task
    from mixprec.compute import device_caps, device_type_of
    from mixprec.doctor import check_policy_target, diagnose
    from mixprec.persist import DOCTOR_REPORT, check_folder, claim_folder

    device = resolve_device(args.device)
    # where the results go, before the diagnosis's minutes: a folder or file mixprec did not write is refused
    if args.apply is not None:
        check_policy_target(args.apply)
    out = args.out or Path("runs") / f"doctor-{spec.replace(':', '-').replace('.', '-')}"
    check_folder(out, DOCTOR_REPORT, "--out")  # claimed once the diagnosis is done: a failed one leaves nothing
    torch.manual_seed(args.seed)
    parts = build_task(spec, TaskConfig(args.batch_size, args.seed, device, args.size))
    batches = ((to_device(x, device), to_device(y, device)) for x, y in parts.train_data)
    formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    diagnosis = diagnose(
        parts.model,
        batches,
        parts.loss_fn,
        steps=args.steps,
        formats=formats,
        keep=args.keep,
        bf16_supported=device_caps(device_type_of(device)).supports_bf16,
    )
    claim_folder(out, DOCTOR_REPORT, "--out")
    (out / "report.json").write_text(diagnosis.to_json(), encoding="utf-8")
    plot = plot_histograms(diagnosis.report, out / "histograms.png")
    print(_table(diagnosis))
    if diagnosis.report.steps < args.steps:
        print(f"analysed {diagnosis.report.steps} batches, all the training data holds (--steps {args.steps})")
    print()
    for name, advice in diagnosis.formats.items():
        if advice.activations_overflow:
            starts = ", ".join(advice.overflow_starts_in) or "-"
            print(f"{name}: activations overflow in {len(advice.activations_overflow)} module(s); starts in {starts}")
    scale = "" if diagnosis.loss_scale is None else f", loss scale 2^{round(math.log2(diagnosis.loss_scale))}"
    print(f"recommended: {diagnosis.policy}{scale}")
    for reason in diagnosis.reasons:
        print(f"  - {reason}")
    print(f"wrote {out / 'report.json'} and {plot}")
    if args.fp8_recipes:
        _fp8_recipes(parts, device, min(args.steps, 4), out)
    if diagnosis.fp32_nonfinite:  # a finding, not advice: no policy file, and a status scripts can test
        print(f"mixprec doctor: {spec} makes inf or NaN in FP32; no policy written", file=sys.stderr)
        return 1
    if args.apply is not None:
        _apply(diagnosis, spec, args)
    return 0


def _apply(diagnosis, spec: str, args: argparse.Namespace) -> None:
    """The advice written to ``--apply``'s file, and the command that trains with it."""
    from mixprec.doctor import write_policy_file

    same = _same_run_flags(args)  # the scale found at a batch size and seed is the scale for those
    source = " ".join(["mixprec doctor", spec, "--steps", str(args.steps), *same])
    path = write_policy_file(diagnosis, args.apply, source=source)
    print(f"wrote {path}: train with mixprec train {' '.join([spec, *same])} --policy {path}")


def _same_run_flags(args: argparse.Namespace) -> list[str]:
    """The flags of the diagnosed run that a training run should share: size, batch size and seed where given."""
    flags = ["--size", args.size] if args.size != "default" else []
    flags += ["--batch-size", str(args.batch_size)] if args.batch_size is not None else []
    return flags + (["--seed", str(args.seed)] if args.seed else [])


def _table(diagnosis) -> str:
    headers = [
        "format",
        "grads lost unscaled",
        "act. grads",
        "weight grads",
        "grad amax",
        "scale",
        "kept",
        "act. overflow",
    ]
    rows = []
    for name, a in diagnosis.formats.items():
        rows.append(
            [
                name,
                f"{100 * a.lost_without_scaling:.3f}%",
                f"{100 * a.activation_grads_lost:.3f}%",
                f"{100 * a.weight_grads_lost:.3f}%",
                f"{a.gradient_amax:.3g}",
                f"2^{round(math.log2(a.recommended_scale))}" + ("" if a.reaches_keep else " (max)"),
                f"{100 * a.kept_with_scale:.3f}%",
                str(len(a.activations_overflow)),
            ]
        )
    return render_table(headers, rows)


def _fp8_recipes(parts, device, steps: int, out: Path) -> None:
    """Each GEMM layer's output error per FP8 recipe on a few training batches, the advice, fp8_recipes.json."""
    from mixprec.app.evaluate import to_device
    from mixprec.doctor import fp8_recipe_report

    batches = (to_device(x, device) for x, _ in parts.train_data)
    report = fp8_recipe_report(parts.model, batches, lambda model, x: model(x), steps=steps)
    if not report.fits:
        print("fp8 recipes: the model has no GEMM layer mixprec computes in FP8")
        return
    recipes = report.recipes
    rows = [[layer, *(f"{100 * report.fit(layer, r).error:.2f}%" for r in recipes)] for layer in report.layers]
    print()
    print(f"FP8 recipes: each GEMM layer's output error against bf16 (mean over rows, {steps} batches)")
    print(render_table(["layer", *recipes], rows))
    for recipe in recipes:
        if report.keep[recipe]:
            print(f"{recipe}: keep {', '.join(report.keep[recipe])} out of FP8 (error past {report.outlier:g}x "
                  "the typical layer's)")  # fmt: skip
    print(f"lowest median error: {report.best()}")
    (out / "fp8_recipes.json").write_text(json.dumps(report.to_dict(), indent=1) + "\n", encoding="utf-8")
    print(f"wrote {out / 'fp8_recipes.json'}")
