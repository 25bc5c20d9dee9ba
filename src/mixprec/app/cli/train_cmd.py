"""``mixprec train``: train a built-in task or your own model under a policy, into a run folder."""

from __future__ import annotations

import argparse
import os
import re
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from mixprec.app.cli.arg_types import (
    file_path,
    loss_scale,
    non_negative_number,
    positive_number,
    seed,
    stop_signals,
    whole_number,
)
from mixprec.app.config import PARALLEL_MODES, SIZES

if TYPE_CHECKING:
    from mixprec.app.config import TrainConfig
    from mixprec.app.run import RunOutcome

# The built-in tasks' names, for --help without importing torch (mixprec.app.task.BUILTIN_TASKS; a
# test holds the two equal).
TASK_NAMES = ("digits", "charlm", "hf", "minilm", "vision")


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags shared by train and compare; each maps to a TrainConfig field."""
    parser.add_argument("task", nargs="?", help=f"a built-in task ({', '.join(TASK_NAMES)})")
    parser.add_argument("--model", metavar="MODULE:FACTORY", help="your own task: a factory returning TaskParts")
    length = parser.add_mutually_exclusive_group()
    length.add_argument("--epochs", type=whole_number(), help="passes over the training data (default: the task's)")
    length.add_argument("--steps", type=whole_number(), help="optimizer updates instead of epochs")
    parser.add_argument("--batch-size", type=whole_number(), help="samples per micro-batch (default: the task's)")
    parser.add_argument(
        "--lr",
        type=non_negative_number,
        help="peak learning rate of AdamW (cosine decay to 10%%; minilm: warm-up, linear decay)",
    )
    parser.add_argument("--weight-decay", type=non_negative_number, help="AdamW weight decay (default: the task's)")
    parser.add_argument("--max-grad-norm", type=positive_number, help="clip the true gradient norm to this")
    parser.add_argument(
        "--frozen-epochs",
        type=whole_number(minimum=0),
        help="fine-tuning (vision): epochs that train the new head alone, the pretrained body frozen (default 1)",
    )
    parser.add_argument(
        "--accumulation-steps", type=whole_number(), default=1, help="micro-batches per update (default 1)"
    )
    parser.add_argument("--seed", type=seed, default=0, help="seed for weights and data order (default 0)")
    parser.add_argument("--size", choices=SIZES, default="default", help="model and data size")
    parser.add_argument("--device", default="auto", help="cpu, cuda, cuda:1, or auto (default)")
    parser.add_argument("--eval-every", type=whole_number(), help="evaluate every N updates (default: at the end)")
    parser.add_argument("--log-every", type=whole_number(), default=10, help="log metrics every N updates (default 10)")
    parser.add_argument(
        "--checkpoint-every", type=whole_number(), help="checkpoint every N updates (default: at the end)"
    )
    parser.add_argument(
        "--checkpoint-every-minutes", type=positive_number, help="also checkpoint after this much wall-clock time"
    )
    parser.add_argument(
        "--keep", type=whole_number(), default=3, dest="keep_checkpoints", help="checkpoints kept (default 3)"
    )
    parser.add_argument(
        "--stop-signals",
        type=stop_signals,
        default="SIGINT,SIGTERM,SIGUSR1",
        help="signals that stop after the current update with a checkpoint, or none (default SIGINT,SIGTERM,SIGUSR1)",
    )
    parser.add_argument("--skip-bad-batches", action="store_true", help="drop batches with NaN/inf inputs or loss")
    parser.add_argument("--quiet", action="store_true", help="no progress bar; only the summary")
    parser.add_argument("--loss-scale", type=loss_scale, help="initial dynamic loss scale (default 65536 for fp16)")
    parser.add_argument(
        "--trace-nonfinite",
        action="store_true",
        help="name the module where each skipped step's first inf/NaN appeared",
    )
    parser.add_argument(
        "--compile", action="store_true", help="run the training forward through torch.compile (first steps compile)"
    )
    _add_distributed_arguments(parser)


def _add_distributed_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags that matter under torchrun."""
    parser.add_argument(
        "--parallel",
        choices=PARALLEL_MODES,
        default="ddp",
        help="under torchrun: replicate the model (DDP, default) or shard it (FSDP2)",
    )
    parser.add_argument("--reduce-fp32", action="store_true", help="under torchrun: reduce gradients in FP32")
    parser.add_argument(
        "--collective-timeout",
        type=float,
        metavar="SECONDS",
        help="under torchrun: how long a rank waits for a hung peer before the run stops with a resume line "
        "(default: torch's, 30 minutes with gloo, 10 with NCCL); longer than the longest checkpoint or evaluation",
    )


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "train",
        help="train a built-in task with progress, metrics, checkpoints, plots",
        description="Train a task under a precision policy; writes metrics, checkpoints, plots and a report.",
    )
    add_run_arguments(parser)
    parser.add_argument(
        "--policy",
        default="auto",
        help="preset, policy string, or a FILE.json from `mixprec doctor --apply` (default: auto)",
    )
    parser.add_argument("--out", type=file_path, help="run folder (default: runs/TASK-POLICY-TIME)")
    parser.add_argument("--resume", action="store_true", help="continue the run in --out from its last checkpoint")
    parser.add_argument(
        "--allow-foreign-checkpoint",
        action="store_true",
        help="with --resume: accept a checkpoint of another run (other seed, policy, model, optimizer settings)",
    )
    parser.set_defaults(run=run)


def task_spec(args: argparse.Namespace) -> str:
    if args.task and args.model:
        raise ValueError(f"give a task ({args.task!r}) or --model ({args.model!r}), not both.")
    if args.model:
        return args.model  # imported from the current folder too (cli.main puts it on sys.path)
    if not args.task:
        raise ValueError(f"name a task ({', '.join(TASK_NAMES)}) or pass --model MODULE:FACTORY.")
    return args.task


def config_from(args: argparse.Namespace, policy: str) -> TrainConfig:
    from mixprec.app.config import TrainConfig
    from mixprec.doctor import policy_and_scale

    policy, advised_scale = policy_and_scale(policy)  # a policy file: its policy and recommended loss scale
    loss_scale = args.loss_scale if args.loss_scale is not None else advised_scale
    return TrainConfig(
        task=task_spec(args),
        policy=policy,
        epochs=args.epochs,
        steps=args.steps,
        batch_size=args.batch_size,
        lr=args.lr,
        weight_decay=args.weight_decay,
        max_grad_norm=args.max_grad_norm,
        frozen_epochs=args.frozen_epochs,
        seed=args.seed,
        size=args.size,
        accumulation_steps=args.accumulation_steps,
        eval_every=args.eval_every,
        log_every=args.log_every,
        checkpoint_every=args.checkpoint_every,
        keep_checkpoints=args.keep_checkpoints,
        checkpoint_every_minutes=args.checkpoint_every_minutes,
        stop_signals=args.stop_signals,
        skip_bad_batches=args.skip_bad_batches,
        device=args.device,
        loss_scale=loss_scale,
        trace_nonfinite=args.trace_nonfinite,
        parallel=args.parallel,
        reduce_fp32=args.reduce_fp32,
        collective_timeout=args.collective_timeout,
        compile=args.compile,
    )


# on --resume, flags that change how the run goes on, not what it computes: applied (and kept in config.json)
RESUME_MAY_CHANGE = (
    "steps", "epochs", "collective_timeout", "log_every", "eval_every", "checkpoint_every",
    "checkpoint_every_minutes", "keep_checkpoints", "stop_signals",
)  # fmt: skip


def resumed_config(saved: TrainConfig, args: argparse.Namespace) -> TrainConfig:
    """The run's config with the flags given on --resume: those of RESUME_MAY_CHANGE applied; any other
    that differs from the run's (its task, policy, learning rate, seed, ...) refused, since the checkpoint
    continues the run config.json describes and a silently ignored flag would train something else."""
    defaults = argparse.ArgumentParser()
    add_run_arguments(defaults)
    # args.given: the flags on the command line (app/cli/main.py), a default's value given too
    run_flags = {*vars(defaults.parse_args([])), "policy"}
    given = {k: v for k, v in vars(args).items() if k in run_flags and k in args.given}
    if given.get("model"):
        given["task"] = given.pop("model")
    if "policy" in given:
        given["policy"] = _policy_as_saved(given["policy"], saved.policy)
    changes = {k: v for k, v in given.items() if k in RESUME_MAY_CHANGE}
    if "steps" in changes or "epochs" in changes:  # one or the other: the new length replaces the old
        changes = {"steps": None, "epochs": None, **changes}
    conflicts = [(k, v) for k, v in given.items() if k not in RESUME_MAY_CHANGE and getattr(saved, k, v) != v]
    if conflicts:
        flags = {a.dest: a.option_strings[-1] for a in defaults._actions if a.option_strings}
        flags.update(task="the task", policy="--policy")
        name, value = conflicts[0]
        has = "the task's default" if getattr(saved, name) is None else repr(getattr(saved, name))
        raise ValueError(
            f"--resume continues the run in its folder as its config.json describes it; received {flags[name]} "
            f"{value!r}, but the run has {has}. Drop the flag to continue it, or start a new "
            f"run in another --out (only {', '.join(flags[k] for k in RESUME_MAY_CHANGE)} may change)."
        )
    return saved.replace(**changes) if changes else saved


def _policy_as_saved(spec: str, saved: str) -> str:
    """A ``--policy`` given with --resume as the run's config.json keeps it: a policy file's policy string; a spec
    with ``auto`` (decided by the machine when the run started, and saved as decided) the run's own: the same
    command line with --resume added (a Slurm requeue) continues the run, as the run trained."""
    from mixprec.app.config import decided_by_the_machine

    if spec.endswith(".json"):
        from mixprec.doctor import policy_and_scale

        spec = policy_and_scale(spec)[0]
    return saved if decided_by_the_machine(spec) else spec


def run_stamp() -> str:
    """The run folder's suffix: the time, or under torchrun its run id (the same on every rank)."""
    return os.environ.get("TORCHELASTIC_RUN_ID") or time.strftime("%Y%m%d-%H%M%S")


def default_run_folder(task: str, policy: str) -> tuple[Path, bool]:
    """``runs/TASK-POLICY-TIME`` and whether it was claimed here by creating it: a run started in the same second
    gets ``-2``, ``-3`` (two runs there used to share it, and the second was refused). Under torchrun the run id
    names it, the same folder on every rank, which may hold a run already: not claimed."""
    base = Path("runs") / slug(f"{task}-{policy}-{run_stamp()}")
    if os.environ.get("TORCHELASTIC_RUN_ID"):
        return base, False
    base.parent.mkdir(parents=True, exist_ok=True)
    folder, number = base, 1
    while True:
        try:
            folder.mkdir()
            return folder, True
        except FileExistsError:
            number += 1
            folder = base.with_name(f"{base.name}-{number}")


def slug(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "-" for c in text)[:60]


def run(args: argparse.Namespace) -> int:
    try:
        code = _train(args)
    except BaseException:
        _leave_group()  # the error is said by the command's caller, in one line
        raise
    if _leave_group():  # under torchrun: end without the interpreter's teardown, where gloo can abort
        from mixprec.app.torchrun import exit_now

        exit_now(code)
    return code


def _leave_group() -> bool:
    """torchrun's leave_group(), without importing torch before a run needs it (a flag's error is said
    before torch loads): no process group exists without torch."""
    if "torch" not in sys.modules:
        return False
    from mixprec.app.torchrun import leave_group

    return leave_group()


def _train(args: argparse.Namespace) -> int:
    from mixprec.app.config import TrainConfig

    # the flags are checked first: a mistake is said in a fraction of a second, before torch loads
    if args.resume:
        if args.out is None:
            raise ValueError("--resume needs --out RUN_FOLDER: the run to continue.")
        config = resumed_config(TrainConfig.load(args.out), args)
        out, claimed = args.out, False
    else:
        config = config_from(args, args.policy)
        out, claimed = (args.out, False) if args.out else default_run_folder(config.task, config.policy)
    from mixprec.app.run import run_training  # needs the 'train' extra (plots)
    from mixprec.app.stop_signals import held
    from mixprec.app.trainer import TrainingInterrupted
    from mixprec.distributed import world

    try:
        outcome = run_training(
            config,
            out,
            resume=args.resume,
            progress=not args.quiet,
            allow_foreign_checkpoint=args.allow_foreign_checkpoint,
            claimed=claimed,
        )
    except TrainingInterrupted as stop:
        with held(config.stop_signal_names, "saying how to resume"):
            if world().is_main:  # rank 0 saved the checkpoint: one line, from it
                print(f"mixprec train: {stop}. Resume with: mixprec train --out {out} --resume", file=sys.stderr)
            return 128 + signal.Signals[stop.signal].value  # the shell's convention: 130 Ctrl-C, 143 SIGTERM
    except RuntimeError as error:  # under torchrun: a peer died or became unreachable (gloo, NCCL errors)
        if not world().distributed:
            raise
        print(peer_failure_line(error, out), file=sys.stderr)
        return PEER_FAILED
    with held(config.stop_signal_names, "printing the summary"):
        if world().is_main:  # under torchrun, one summary
            print(summary(outcome))
        return 0


PEER_FAILED = 1


def peer_failure_line(error: RuntimeError, out: Path) -> str:
    """One line for a distributed run that lost a process: what the backend said, and how to resume."""
    from mixprec.app.checkpoint import list_checkpoints

    said = re.sub(r"^\[[^\]]*\]\s*", "", str(error).strip().splitlines()[0])[:200]  # gloo's source location off
    newest = list_checkpoints(out / "checkpoints")
    stands = f"the last complete checkpoint is {newest[-1].name}" if newest else "no checkpoint was written yet"
    return (
        f"mixprec train: error: a process of this distributed run failed or became unreachable ({said}); "
        f"{stands}. Resume on every node with: mixprec train --out {out} --resume"
    )


FEW_TIMED_STEPS = 30  # below this, a step time is mostly warm-up and noise


def few_steps_note(result) -> str:
    """A warning to print beside a timing measured over too few steps to mean much ('' otherwise)."""
    if result.timed_steps >= FEW_TIMED_STEPS:
        return ""
    return f" (timed over {result.timed_steps} steps only: indicative; train longer for a figure to rely on)"


def summary(outcome: RunOutcome) -> str:
    """The one-screen summary printed at the end of a run."""
    result, stats = outcome.result, outcome.result.stats
    lines = [
        ("task", f"{outcome.config.task}: {outcome.description}"),
        ("policy", f"{outcome.policy}" + (f"  [{outcome.policy.reason}]" if outcome.policy.reason else "")),
        ("compute", f"{outcome.compute_plan.mode}: {outcome.compute_plan.reason}"),
        ("trained", f"{result.steps} steps, {result.epochs} epochs in {result.seconds:.1f} s"),
        *(
            [("resumed", f"from step {result.resumed_from}; --steps/--epochs count the whole run, not what is added")]
            if result.resumed_from is not None
            else []
        ),
        *(
            [("processes", f"{outcome.world_size}, data parallel ({outcome.parallel})")]
            if outcome.world_size > 1
            else []
        ),
        ("speed", f"{result.ms_per_step:.1f} ms/step, {result.samples_per_s:,.0f} samples/s{few_steps_note(result)}"),
        ("final train loss", f"{result.train_loss:.4f}"),
        *((f"eval {k}", f"{v:.4f}") for k, v in result.eval.items()),
        (
            "loss scale",
            f"{stats.scale:g} ({stats.skipped_steps} steps skipped: {stats.inf_steps} inf, {stats.nan_steps} NaN)",
        ),
        *(
            [
                (
                    "non-finite",
                    f"{len(outcome.nonfinite)} traced; first: {outcome.nonfinite[0]}"
                    if outcome.nonfinite
                    else "none traced",
                )
            ]
            if outcome.nonfinite is not None
            else []
        ),
        ("model state", f"{stats.bytes_per_param.total:.1f} bytes/param x {outcome.parameters:,} params"),
        ("activations", f"{outcome.activation_bytes / 2**20:.2f} MB saved for backward per eval batch"),
        ("run folder", str(outcome.run_dir)),
        ("report", str(outcome.report)),
    ]
    if stats.diagnosis:
        lines.append(("diagnosis", stats.diagnosis))
    width = max(len(k) for k, _ in lines)
    return "\n".join(f"{k.ljust(width)}  {v}" for k, v in lines)
