"""``mixprec policy``: what a preset or policy string means, and what it does on this device."""

from __future__ import annotations

import argparse
import json

from mixprec.app.cli.table import render_table
from mixprec.app.config import SIZES


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "policy",
        help="explain a policy: preset name or string such as 'p=f32,c=bf16,o=f32'",
        description="Explain a precision policy; without SPEC, list the presets.",
    )
    parser.add_argument(
        "spec",
        nargs="?",
        help="a preset name (mixed_bf16, auto, ...), a policy string, or a policy file (FILE.json, written by "
        "mixprec doctor --apply or mixprec tune)",
    )
    parser.add_argument(
        "--device", help="device to resolve 'auto' and check support for (default: cuda if present, else cpu)"
    )
    parser.add_argument(
        "--task",
        help="with an FP8 policy, also say which of this task's GEMM layers run FP8 and why each other is kept "
        "(a built-in task: digits, charlm, hf, minilm, vision; or MODULE:FACTORY)",
    )
    parser.add_argument("--size", choices=SIZES, default="default", help="the task's size for --task")
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")
    parser.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from mixprec.compute import device_caps, device_type_of
    from mixprec.policy import DTYPE_NAMES, PRESET_ALIASES, PRESETS, get_policy
    from mixprec.regions import prepare

    device_type = device_type_of(args.device)
    if args.spec is None:
        rows = [[name, str(policy), policy.reason] for name, policy in PRESETS.items()]
        auto = get_policy("auto", device=device_type)
        rows.append(["auto", str(auto), auto.reason])
        print(render_table(["preset", "policy", "meaning"], rows, align="lll"))
        aliases = ", ".join(f"{alias} = {name}" for alias, name in PRESET_ALIASES.items())
        print(f"\nalso accepted (Keras, Apex opt levels, Lightning; '-' reads as '_'): {aliases}")
        return 0
    from mixprec.doctor import policy_and_scale

    args.spec, loss_scale = policy_and_scale(args.spec, "SPEC")  # a policy file: its policy and recommended loss scale
    prepared = prepare(None, args.spec, device=device_type)  # parsed and checked once, with its compute plan
    policy, plan = prepared.policy, prepared.plan
    record = {
        "policy": str(policy),
        "params": DTYPE_NAMES[policy.param_dtype],
        "compute": "tf32" if policy.allow_tf32 else DTYPE_NAMES[policy.compute_dtype],
        "output": DTYPE_NAMES[policy.output_dtype],
        "master": DTYPE_NAMES[policy.master_dtype],
        "fp32_masters": policy.keeps_fp32_masters,
        "fp32_modules": list(policy.fp32_modules),
        "fp32_names": list(policy.fp32_names),
        "bf16_names": list(policy.bf16_names),
        "fp32_ops": list(policy.fp32_ops),
        "reason": policy.reason,
        "device": device_caps(device_type).description,
        "compute_plan": f"{plan.mode}: {plan.reason}",
    }
    if loss_scale is not None:
        record["loss_scale"] = f"{loss_scale:g} (the policy file's)"
    if args.task is not None:
        record["task"] = args.task
        record["fp8_layers"] = _fp8_layers(args, device_type)
    if args.json:
        print(json.dumps(record, indent=2))
    else:
        width = max(map(len, record))
        for key, value in record.items():
            shown = ", ".join(value) if isinstance(value, list) else value
            print(f"{key.ljust(width)}  {shown if shown not in ('', None) else '-'}")
    return 0


def _fp8_layers(args: argparse.Namespace, device_type: str) -> str:
    """Which of ``--task``'s GEMM layers the policy computes in FP8 and why each other is kept (its model is
    built on the CPU, as the task builds it; nothing is trained)."""
    from mixprec.app.task import TaskConfig, build_task  # the 'train' extra
    from mixprec.regions import prepare
    from mixprec.regions.fp8 import gemm_selection

    model = build_task(args.task, TaskConfig(size=args.size)).model
    prepared = prepare(model, args.spec, device=device_type)
    if prepared.policy.fp8 is None:
        return "none: the policy has no FP8 recipe"
    fp32, bf16 = [name for name, _ in prepared.fp32_modules], [name for name, _ in prepared.bf16_modules]
    return gemm_selection(model, prepared.policy.fp8, fp32, bf16).describe()
