"""``mixprec tune``: the fastest per-layer precision that keeps the accuracy (docs/tune.md)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mixprec.app.cli.arg_types import file_path, positive_number, seed, tolerance, whole_number
from mixprec.app.cli.train_cmd import slug, task_spec
from mixprec.app.config import SIZES

BASES = ("mixed_bf16", "mixed_fp16", "auto")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "tune",
        help="search per-layer formats (FP32, 16 bits, FP8) for the fastest policy within a loss tolerance",
        description=(
            "Find the fastest per-layer policy that keeps the validation loss within a tolerance of the uniform "
            "16-bit base: each GEMM layer's allowed formats from the doctor's statistics, its cost per format "
            "measured here (or read from a device profile), short emulated trial runs in a sensitivity-ordered "
            "greedy search, then the chosen policy verified against the base and FP32 over seeds. Writes "
            "tune.json, policy.json, front.png and report.md to --out."
        ),
    )
    parser.add_argument("task", nargs="?", help="a built-in task (digits, charlm, hf, minilm, vision)")
    parser.add_argument("--model", metavar="MODULE:FACTORY", help="your own task: a factory returning TaskParts")
    parser.add_argument(
        "--base",
        choices=BASES,
        default="mixed_bf16",
        help="the uniform 16-bit policy to beat; auto: a trial of each, fp16 where faster and the loss holds",
    )
    parser.add_argument("--tolerance", type=tolerance, default=0.005,
                        help="validation-loss change allowed against the base: 0.5%% (default) or 0.005")  # fmt: skip
    parser.add_argument("--budget-minutes", type=positive_number, help="stop trying layers past this (then verify)")
    parser.add_argument("--device-profile", type=file_path, help="predict speed from this device profile (JSON)")
    parser.add_argument("--save-profile", type=file_path, help="also write the timings measured here as a profile")
    parser.add_argument("--trial-steps", type=whole_number(), default=60, help="updates per trial run (60)")
    parser.add_argument("--verify-steps", type=whole_number(), default=180, help="updates per verification run (180)")
    parser.add_argument("--seeds", type=whole_number(), default=3, help="verification seeds (3)")
    parser.add_argument("--batch-size", type=whole_number(), help="samples per batch (default: the task's)")
    parser.add_argument("--seed", type=seed, default=0, help="the first seed (default 0)")
    parser.add_argument("--size", choices=SIZES, default="default", help="model and data size")
    parser.add_argument("--device", default="auto", help="cpu, cuda, cuda:1, or auto (default)")
    parser.add_argument("--out", type=file_path, help="folder for the results (default runs/tune-TASK)")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    spec = task_spec(args)  # the flags first: a mistake is said before torch loads
    from mixprec.app.tune.cost import KIND
    from mixprec.app.tune.run import tune
    from mixprec.app.tune.search import NoFiniteReference
    from mixprec.persist import check_overwrite

    if args.save_profile is not None:  # before the minutes of tuning
        if args.device_profile is not None:
            raise ValueError("--save-profile writes the timings measured here: with --device-profile none are.")
        check_overwrite(args.save_profile, "--save-profile", KIND)
    out = args.out or Path("runs") / slug(f"tune-{spec}")
    try:
        result = tune(
            spec,
            out=out,
            base=args.base,
            tolerance=args.tolerance,
            trial_steps=args.trial_steps,
            verify_steps=args.verify_steps,
            seeds=args.seeds,
            budget_minutes=args.budget_minutes,
            device_profile=args.device_profile,
            seed=args.seed,
            size=args.size,
            device=args.device,
            batch_size=args.batch_size,
        )
    except NoFiniteReference as finding:  # a finding about the model, not a usage error: exit 1, as the doctor's
        print(f"mixprec tune: {spec}: {finding}", file=sys.stderr)
        return 1
    if args.save_profile is not None:
        from mixprec.app.tune.run import measured_profile

        measured_profile(result).save(args.save_profile)
    chosen, verdict = result["chosen"], result["verification"]["verdict"]
    predicted = chosen["prediction"]
    print(f"chosen: {chosen['policy']}")
    print(
        f"predicted {predicted['speedup']:.3f}x {result['base']} ({predicted['scope']}), activation memory "
        f"{predicted['activation_ratio']:.2f}x; verified loss change {100 * verdict['loss_change']:+.3f}% over "
        f"{args.seeds} seeds (tolerance {100 * args.tolerance:.2f}%)"
    )
    print(f"wrote {out / 'tune.json'}, {out / 'policy.json'}, {out / 'front.png'}, {out / 'report.md'}")
    print(f"train with: mixprec train {spec} --policy {out / 'policy.json'}")
    return 0
