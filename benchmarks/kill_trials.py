"""SIGKILL at random moments of `mixprec train`, checkpoint writes included; then resume and compare.

    python benchmarks/kill_trials.py [--trials 30] [--steps 30] [--task digits] [--policy mixed_fp16]

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

from mixprec.app.checkpoint import list_checkpoints, load_checkpoint
from mixprec.app.machine import machine_info
from mixprec.app.serialize import flatten

MIXPREC = str(Path(sys.executable).with_name("mixprec"))


def _train(out: Path, args: argparse.Namespace, resume: bool = False) -> list[str]:
    if resume:
        return [MIXPREC, "train", "--out", str(out), "--resume", "--steps", str(args.steps), "--quiet"]
    return [
        MIXPREC, "train", args.task, "--size", "tiny", "--policy", args.policy, "--steps", str(args.steps),
        "--checkpoint-every", "1", "--keep", "2", "--seed", "3", "--out", str(out), "--quiet",
    ]  # fmt: skip


def _writing(directory: Path) -> bool:
    try:
        return any(".tmp-" in entry.name for entry in os.scandir(directory))
    except FileNotFoundError:
        return False


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
        if _writing(directory):
            seen += 1
            if seen >= writes:
                return
            while process.poll() is None and _writing(directory):
                pass  # not this write: wait for it to finish
        time.sleep(0.0002)


def _final_state(out: Path) -> dict[str, torch.Tensor]:
    state = load_checkpoint(list_checkpoints(out / "checkpoints")[-1])
    tensors, skeleton = flatten(state)
    tensors["skeleton"] = torch.tensor(list(json.dumps(skeleton, sort_keys=True).encode()), dtype=torch.uint8)
    return tensors


def _identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    """Names of the tensors that differ (empty: bit-identical)."""
    if a.keys() != b.keys():
        return sorted(set(a) ^ set(b))
    return [name for name in a if a[name].dtype != b[name].dtype or not torch.equal(a[name], b[name])]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=30)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--task", default="digits")
    parser.add_argument("--policy", default="mixed_fp16")
    parser.add_argument("--seed", type=int, default=0, help="seeds the kill delays")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/kill_trials.json"))
    args = parser.parse_args()
    rng = random.Random(args.seed)
    work = Path(tempfile.mkdtemp(prefix="mixprec-kill-"))
    try:
        start = time.perf_counter()
        subprocess.run(_train(work / "reference", args), check=True, capture_output=True)
        duration = time.perf_counter() - start
        reference = _final_state(work / "reference")
        print(f"reference run: {args.steps} steps in {duration:.1f} s (startup included)")
        trials = []
        for trial in range(args.trials):
            out = work / f"trial-{trial}"
            directory = out / "checkpoints"
            began = time.perf_counter()
            process = subprocess.Popen(_train(out, args), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            writes = rng.randrange(1, args.steps)
            if trial % 2 == 0:
                _wait_for_checkpoints(process, directory, writes)
                time.sleep(rng.uniform(0.0, 0.05))
            else:
                _wait_for_write(process, directory, writes)
            delay = time.perf_counter() - began
            finished = process.poll() is not None
            process.send_signal(signal.SIGKILL)
            process.wait()
            in_write = bool(list(directory.glob(".step-*.tmp-*"))) if directory.is_dir() else False
            survivors = [p.name for p in list_checkpoints(directory)]
            resumable = bool(survivors)
            command = _train(out, args, resume=True) if resumable else _train(out, args)
            if not resumable:
                shutil.rmtree(out, ignore_errors=True)  # nothing to resume: start again, as a user would
            resumed = subprocess.run(command, capture_output=True, text=True, check=False)
            differing = _identical(reference, _final_state(out)) if resumed.returncode == 0 else ["<resume failed>"]
            leftovers = [p.name for p in directory.glob(".step-*.tmp-*")] if directory.is_dir() else []
            record = {
                "trial": trial, "kill_after_s": round(delay, 3), "finished_before_kill": finished,
                "killed_in_checkpoint_write": in_write, "checkpoints_after_kill": survivors, "resumed": resumable,
                "resume_exit": resumed.returncode, "differing_tensors": differing, "temporary_files_left": leftovers,
                "error": resumed.stderr.strip().splitlines()[-1] if resumed.returncode else None,
            }  # fmt: skip
            trials.append(record)
            state = "identical" if not differing else f"DIFFERS in {differing[:3]}"
            where = "in a checkpoint write" if in_write else ("after the end" if finished else "in training")
            print(f"trial {trial:2d}: killed at {delay:5.2f} s {where:22s} "
                  f"{len(survivors)} checkpoints left, resumed={resumable}: {state}")  # fmt: skip
    finally:
        shutil.rmtree(work, ignore_errors=True)
    summary = {
        "trials": len(trials),
        "killed_in_checkpoint_write": sum(t["killed_in_checkpoint_write"] for t in trials),
        "killed_before_first_checkpoint": sum(not t["resumed"] for t in trials),
        "finished_before_kill": sum(t["finished_before_kill"] for t in trials),
        "failed_resumes": sum(bool(t["differing_tensors"]) for t in trials),
        "temporary_files_left": sum(bool(t["temporary_files_left"]) for t in trials),
    }
    print(json.dumps(summary))
    command = " ".join(["python", *sys.argv])
    payload = {"machine": {**machine_info(), "command": command}, "summary": summary, "trials": trials}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(payload, indent=1))
    print(f"wrote {args.out}")
    return 1 if summary["failed_resumes"] else 0


if __name__ == "__main__":
    sys.exit(main())
