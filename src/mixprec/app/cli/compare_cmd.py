"""``mixprec compare``: one task under several policies, same seed and data, side by side."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import TYPE_CHECKING

from mixprec.app.cli.arg_types import file_path
from mixprec.app.cli.table import render_table
from mixprec.app.cli.train_cmd import FEW_TIMED_STEPS, add_run_arguments, config_from, slug

if TYPE_CHECKING:
    from mixprec.app.run import RunOutcome

DEFAULT_POLICIES = "fp32,mixed_bf16,mixed_fp16"


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "compare",
        help="the same task under several policies: time, memory, accuracy side by side",
        description="Train one task under each policy from the same seed and data; print one table.",
    )
    add_run_arguments(parser)
    parser.add_argument(
        "--policies", default=DEFAULT_POLICIES, help=f"policies to compare (default: {DEFAULT_POLICIES})"
    )
    parser.add_argument(
        "--out", type=file_path, help="folder for the runs and the report (default: runs/compare-TASK-TIME)"
    )
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from mixprec.app.machine import machine_info
    from mixprec.app.report import plot_compare, write_compare_report  # the 'train' extra
    from mixprec.app.run import check_policies_fit, run_training
    from mixprec.persist import COMPARISON, claim_folder
    from mixprec.policy import parse_policy_list

    policies = parse_policy_list(args.policies, device=None if args.device == "auto" else args.device)
    folders = [slug(spec) for spec, _ in policies]
    twice = next((spec for (spec, _), folder in zip(policies, folders, strict=True) if folders.count(folder) > 1), None)
    if twice is not None:  # said now, not after the first run has trained
        raise ValueError(f"--policies: received {twice!r} twice ({args.policies!r}); name each policy once.")
    named: dict[str, str] = {}  # two names of one policy (fp32, float32) would compare it with itself
    for spec, policy in policies:
        first = named.setdefault(str(policy), spec)
        if first != spec:
            raise ValueError(f"--policies: {first!r} and {spec!r} are the same policy ({policy}); name it once.")
    base = config_from(args, policies[0][0])
    check_policies_fit(base, policies)  # each on the task's model, before the first run trains
    out = args.out or Path("runs") / slug(f"compare-{base.task}-{time.strftime('%Y%m%d-%H%M%S')}")
    claim_folder(out, COMPARISON, "--out")  # refused: a folder of files mixprec did not write
    if (out / "report.md").exists():  # a finished comparison: its table and plots would be written over
        raise ValueError(f"--out {out}: this folder holds a finished comparison (its report.md); name a new folder.")
    outcomes: list[RunOutcome] = []
    for spec, policy in policies:  # each parsed once, above
        if not args.quiet:
            print(f"== {spec}")
        config = base.replace(policy=spec)
        outcomes.append(run_training(config, out / slug(spec), progress=not args.quiet, policy=policy))
    headers, rows = table(outcomes)
    print()
    print(render_table(headers, rows))
    few = [o for o in outcomes if o.result.timed_steps < FEW_TIMED_STEPS]
    if few:
        steps = ", ".join(f"{o.config.policy} {o.result.timed_steps}" for o in few)
        print(f"* ms/step timed over fewer than {FEW_TIMED_STEPS} steps ({steps}): indicative only.")
    print("compute plans (how each policy's 16-bit ops run on this machine, and why):")
    for o in outcomes:
        print(f"  {o.config.policy}: {o.compute_plan.mode}: {o.compute_plan.reason}")
    notes = [f"{o.config.policy}: {o.policy}" + (f" [{o.policy.reason}]" if o.policy.reason else "") for o in outcomes]
    metric = outcomes[0].metric
    plots = plot_compare({o.config.policy: o.result.history for o in outcomes}, out, f"{base.task}", metric)
    report = write_compare_report(
        out / "report.md",
        title=f"mixprec compare: {base.task}",
        # the runs' settings, but the policy: each run's own (the first run's would read as the comparison's)
        config={"policies": args.policies, **{k: v for k, v in base.to_dict().items() if k != "policy"}},
        machine=machine_info(),
        headers=headers,
        rows=rows,
        notes=notes,
        plots=plots,
    )
    print(f"\nreport: {report}")
    return 0


def table(outcomes: list[RunOutcome]) -> tuple[list[str], list[list[str]]]:
    """One row per policy; speed and memory as ratios to the FP32 run (or the first run)."""
    from mixprec.policy import get_policy

    fp32 = str(get_policy("fp32"))  # by what the policy is, not its name: float32, o0 and 32_true are FP32 too
    reference = next((o for o in outcomes if str(o.policy) == fp32), outcomes[0])
    metric = outcomes[0].metric
    headers = [
        "policy",
        "compute",
        "ms/step",
        f"speed vs {reference.config.policy}",
        "activations MB",
        "vs ref",
        "model state MB",
        "bytes/param",
        f"eval {metric}" if metric else "eval loss",
        "eval loss",
        "skipped",
        "final scale",
    ]
    rows = []
    for o in outcomes:
        stats = o.result.stats
        state_mb = stats.bytes_per_param.total * o.parameters / 2**20
        rows.append(
            [
                o.config.policy,
                o.compute_plan.mode,
                f"{o.result.ms_per_step:.1f}" + ("*" if o.result.timed_steps < FEW_TIMED_STEPS else ""),
                f"{reference.result.ms_per_step / o.result.ms_per_step:.2f}x",
                f"{o.activation_bytes / 2**20:.2f}",
                f"{o.activation_bytes / reference.activation_bytes:.2f}x",
                f"{state_mb:.2f}",
                f"{stats.bytes_per_param.total:.1f}",
                f"{o.result.eval.get(metric, float('nan')):.4f}" if metric else f"{o.result.eval['loss']:.4f}",
                f"{o.result.eval.get('loss', float('nan')):.4f}",
                str(stats.skipped_steps),
                f"{stats.scale:g}",
            ]
        )
    return headers, rows
