"""SIGKILL at random moments of `mixprec train`, checkpoint writes included; then resume and compare.

    python benchmarks/kill_trials.py [--trials 30] [--steps 30] [--task digits] [--policy mixed_fp16]
    python benchmarks/kill_trials.py --sharded [--trials 72] [--task charlm] [--policy o2_bf16]

``--sharded``: the run is two ranks under torchrun with FSDP2 (``--parallel fsdp``), writing sharded
checkpoints (every rank its own shards), and the trials cycle through three kills: the whole job during
training, the whole job inside a sharded checkpoint write (its staging folder exists), and one rank of
the two (torchrun then stops the other). Results go to benchmarks/results/kill_trials_sharded.json.

One uninterrupted reference run checkpoints after every update. Each trial starts the same run and kills
it (SIGKILL: no handler runs) after a random number of checkpoints: even trials during training, a
random 0-50 ms after that checkpoint appeared; odd trials inside the next checkpoint write, the moment
its temporary file appears. Progress, not a clock, picks the moment, so a slow machine does not move
the kills past the end of the run. Then it resumes it with
`--resume` from whatever the kill left, and compares the final checkpoint with the reference's: model,
optimizer, scaler, master weights, random state and position must be bit-identical. A kill that left a
temporary checkpoint file behind was inside a checkpoint write. Kills before the first checkpoint leave
nothing to resume; those runs are started again from scratch, as a user would.

Writes benchmarks/results/kill_trials.json with the machine and the command.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors import safe_open

from mixprec.app.checkpoint import list_checkpoints, load_checkpoint
from mixprec.app.machine import machine_info
from mixprec.persist.serialize import flatten

MIXPREC = str(Path(sys.executable).with_name("mixprec"))
TORCHRUN = [str(Path(sys.executable).with_name("torchrun")), "--standalone", "--nproc-per-node", "2", "-m", "mixprec"]
KILLS = ("job in training", "job in a sharded write", "one rank of two")  # --sharded: trial i does KILLS[i % 3]


def _train(out: Path, args: argparse.Namespace, resume: bool = False) -> list[str]:
    launch = [*TORCHRUN, "train"] if args.sharded else [MIXPREC, "train"]
    if resume:
        return [*launch, "--out", str(out), "--resume", "--steps", str(args.steps), "--quiet"]
    return [
        *launch, args.task, "--size", "tiny", "--policy", args.policy, "--steps", str(args.steps),
        "--checkpoint-every", "1", "--keep", "2", "--seed", "3", "--out", str(out), "--quiet",
        *(["--parallel", "fsdp"] if args.sharded else []),
    ]  # fmt: skip


def _in_write(directory: Path) -> bool:
    """A checkpoint write is under way (or was killed): a temporary file or a staging folder exists."""
    try:
        return any(entry.name.startswith(".step-") and ".tmp" in entry.name for entry in os.scandir(directory))
    except FileNotFoundError:
        return False


def _ranks(process: subprocess.Popen) -> list[int]:
    """The worker processes torchrun started (its children)."""
    try:
        children = Path(f"/proc/{process.pid}/task/{process.pid}/children").read_text().split()
    except FileNotFoundError:
        return []
    return [int(pid) for pid in children]


def _kill(process: subprocess.Popen, trial: int, args: argparse.Namespace) -> str:
    """SIGKILL the run as the trial says; returns what was killed."""
    if args.sharded and KILLS[trial % 3] == "one rank of two":
        ranks = _ranks(process)
        if ranks:
            os.kill(ranks[-1], signal.SIGKILL)  # torchrun sees the rank die and stops the other
            process.wait()
            return "one rank of two"
    os.killpg(process.pid, signal.SIGKILL)  # the whole job: torchrun and its ranks
    process.wait()
    return "the job" if args.sharded else "the process"


def _wait_for_checkpoints(process: subprocess.Popen, directory: Path, count: int) -> None:
    """Return once ``count`` checkpoints have been written (or the run has ended)."""
    while process.poll() is None:
        written = list_checkpoints(directory)
        if written and int(written[-1].stem.split("-")[1]) >= count:
            return
        time.sleep(0.001)


def _wait_for_write(process: subprocess.Popen, directory: Path, writes: int) -> None:
    """Return while the ``writes``-th checkpoint write is under way (or when the run has ended)."""
    seen = 0
    while process.poll() is None:
        if _in_write(directory):
            seen += 1
            if seen >= writes:
                return
            while process.poll() is None and _in_write(directory):
                pass  # not this write: wait for it to finish
        time.sleep(0.0002)


def _final_state(out: Path) -> dict[str, torch.Tensor]:
    newest = list_checkpoints(out / "checkpoints")[-1]
    state = load_checkpoint(newest)
    if "shards" in state:  # a sharded checkpoint (verified): every tensor in its shard files, and the rest
        state.pop("shards")  # (not the files' bytes: safetensors writes the header's metadata in any order)
        for shard in sorted((newest / "shards").iterdir()):
            with safe_open(str(shard), framework="pt") as reader:
                state.update({f"{shard.name}: {name}": reader.get_tensor(name) for name in reader.keys()})  # noqa: SIM118
    tensors, skeleton = flatten(state)
    tensors["skeleton"] = torch.tensor(list(json.dumps(skeleton, sort_keys=True).encode()), dtype=torch.uint8)
    return tensors


def _identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """Names of the tensors that differ (empty: bit-identical)."""
    if a.keys() != b.keys():
        return sorted(set(a) ^ set(b))
    return [name for name in a if a[name].dtype != b[name].dtype or not torch.equal(a[name], b[name])]


def _trial(trial: int, out: Path, args: argparse.Namespace, rng: random.Random, reference: dict) -> dict:
    """Start the run, kill it at the trial's moment, resume it, compare with the reference."""
    directory = out / "checkpoints"
    began = time.perf_counter()
    process = subprocess.Popen(
        _train(out, args), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    writes = rng.randrange(1, args.steps)
    in_training = trial % 2 == 0 if not args.sharded else trial % 3 == 0 or (trial % 3 == 2 and trial // 3 % 2 == 0)
    if in_training:
        _wait_for_checkpoints(process, directory, writes)
        time.sleep(rng.uniform(0.0, 0.05))
    else:
        _wait_for_write(process, directory, writes)
    delay = time.perf_counter() - began
    finished = process.poll() is not None
    killed = _kill(process, trial, args)
    in_write = _in_write(directory)
    survivors = [p.name for p in list_checkpoints(directory)]
    resumable = bool(survivors)
    command = _train(out, args, resume=True) if resumable else _train(out, args)
    if not resumable:
        shutil.rmtree(out, ignore_errors=True)  # nothing to resume: start again, as a user would
    resumed = subprocess.run(command, capture_output=True, text=True, check=False)
    differing = _identical(reference, _final_state(out)) if resumed.returncode == 0 else ["<resume failed>"]
    leftovers = [p.name for p in directory.iterdir() if p.name.startswith(".step-")] if directory.is_dir() else []
    state = "identical" if not differing else f"DIFFERS in {differing[:3]}"
    where = "in a checkpoint write" if in_write else ("after the end" if finished else "in training")
    print(f"trial {trial:3d}: killed {killed} at {delay:5.2f} s {where:22s} "
          f"{len(survivors)} checkpoints left, resumed={resumable}: {state}", flush=True)  # fmt: skip
    return {
        "trial": trial, "killed": killed, "kill_after_s": round(delay, 3), "finished_before_kill": finished,
        "killed_in_checkpoint_write": in_write, "checkpoints_after_kill": survivors, "resumed": resumable,
        "resume_exit": resumed.returncode, "differing_tensors": differing, "temporary_files_left": leftovers,
        "error": resumed.stderr.strip().splitlines()[-1] if resumed.returncode else None,
    }  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sharded", action="store_true", help="two FSDP2 ranks under torchrun, sharded checkpoints")
    parser.add_argument("--trials", type=int, default=None, help="default: 30; --sharded: 72")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--task", default=None, help="default: digits; --sharded: charlm")
    parser.add_argument("--policy", default=None, help="default: mixed_fp16; --sharded: o2_bf16")
    parser.add_argument("--seed", type=int, default=0, help="seeds the kill delays")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    defaults = (
        (72, "charlm", "o2_bf16", "kill_trials_sharded.json")
        if args.sharded
        else (30, "digits", "mixed_fp16", "kill_trials.json")
    )
    args.trials = args.trials if args.trials is not None else defaults[0]
    args.task, args.policy = args.task or defaults[1], args.policy or defaults[2]
    args.out = args.out or Path("benchmarks/results") / defaults[3]
    rng = random.Random(args.seed)
    work = Path(tempfile.mkdtemp(prefix="mixprec-kill-"))
    try:
        start = time.perf_counter()
        subprocess.run(_train(work / "reference", args), check=True, capture_output=True)
        duration = time.perf_counter() - start
        reference = _final_state(work / "reference")
        print(f"reference run: {args.steps} steps in {duration:.1f} s (startup included)")
        trials = [_trial(trial, work / f"trial-{trial}", args, rng, reference) for trial in range(args.trials)]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    summary = {
        "trials": len(trials),
        **(
            {f"killed {kind}": sum(t["killed"] == kind for t in trials) for kind in ("the job", "one rank of two")}
            if args.sharded
            else {}
        ),
        "killed_in_checkpoint_write": sum(t["killed_in_checkpoint_write"] for t in trials),
        "killed_before_first_checkpoint": sum(not t["resumed"] for t in trials),
        "finished_before_kill": sum(t["finished_before_kill"] for t in trials),
        "failed_resumes": sum(bool(t["differing_tensors"]) for t in trials),
        "temporary_files_left": sum(bool(t["temporary_files_left"]) for t in trials),
    }
    print(json.dumps(summary))
    command = " ".join(["python", *sys.argv])
    total = round(time.perf_counter() - start, 1)
    payload = {
        "machine": {**machine_info(), "command": command},
        "seconds": total,
        "summary": summary,
        "trials": trials,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(payload, indent=1))
    print(f"wrote {args.out}")
    return 1 if summary["failed_resumes"] else 0


if __name__ == "__main__":
    sys.exit(main())
