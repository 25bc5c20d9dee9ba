"""Entry point: ``PYTHONPATH=src python3 -m benchmarks.gpu [--dry-run] [--out DIR] [--parts a,b]`` from the
repository root (``bash scripts/gpu_check.sh`` does exactly that). Exit status 1 if a part failed or did
not run for lack of time, 2 on a usage error.

A GPU machine stops each command at 10 minutes, so the command keeps to ``--time-limit`` (560 s on a GPU):
a part that would not fit in what is left is not started (and says so), the tests part's pytest and the
gpt part's compiling stop in time, results are saved after every case, and a SIGTERM ends the run with
what it has saved.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import signal
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import torch
from benchmarks.gpu import (
    part_bert,
    part_fp8,
    part_fp8_gpt,
    part_gpt,
    part_gpt2,
    part_profile,
    part_syncs,
    part_tests,
    part_tuned,
)
from benchmarks.gpu.common import Part, Settings, Stopped, describe, device_slug, free_memory, log
from benchmarks.gpu.report import load, save

from mixprec.app.machine import machine_info

PARTS = {
    "tests": part_tests.run,
    "syncs": part_syncs.run,
    "gpt": part_gpt.run,
    "fp8": part_fp8.run,
    "fp8gpt": part_fp8_gpt.run,
    "bert": part_bert.run,
    "gpt2": part_gpt2.run,
    "profile": part_profile.run,
    "tuned": part_tuned.run,
}
# what each part needs, about twice what it took on an H200 (2026-11-26: tests 25 s, fp8 1; docs/gpu.md), or
# estimated from it where the part has grown since (syncs: 36 cases over 3 models; bert, gpt and gpt2: eager
# modes plus compiled ones within a 100 s compile budget each); a part is not started with less than this left
NEEDS_S = {
    "tests": 60,
    "syncs": 120,
    "gpt": 200,
    "fp8": 15,
    "bert": 200,
    "gpt2": 220,
    "profile": 60,
    "fp8gpt": 150,
    "tuned": 60,
}
GPU_TIME_LIMIT_S = 560.0  # the GPU machine stops a command at 600 s; 40 s for start-up and the last save
REPO = Path(__file__).resolve().parents[2]


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="gpu_check", description="Check every GPU claim of mixprec (docs/gpu.md).")
    parser.add_argument("--dry-run", action="store_true", help="every part on the CPU at tiny sizes (what CI runs)")
    parser.add_argument("--out", type=Path, help="results root (default: benchmarks/results/gpu; dry run: a temp dir)")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, from {', '.join(PARTS)}")
    parser.add_argument(
        "--compile-budget",
        type=float,
        default=100.0,
        help="seconds each of the bert, gpt and gpt2 parts may spend compiling",
    )
    parser.add_argument("--tests-timeout", type=float, default=480.0, help="seconds the tests part may run")
    parser.add_argument("--time-limit", type=float, default=None,
                        help=f"seconds the whole command may run (default on a GPU: {GPU_TIME_LIMIT_S:.0f}; "
                        "dry run: none)")  # fmt: skip
    args = parser.parse_args(argv)
    args.parts = [name.strip() for name in args.parts.split(",") if name.strip()]
    unknown = [name for name in args.parts if name not in PARTS]
    if unknown or not args.parts:
        parser.error(f"--parts: received {unknown or args.parts}; use names from {', '.join(PARTS)}")
    if not args.dry_run and not torch.cuda.is_available():
        parser.error("no CUDA device here: this command checks GPU claims; on a CPU run it with --dry-run")
    return args


def _machine(settings: Settings) -> dict:
    info = machine_info()
    info["cuda_runtime"] = torch.version.cuda
    if settings.cuda:
        props = torch.cuda.get_device_properties(settings.device)
        info.update(device_name=props.name, capability=f"{props.major}.{props.minor}",
                    memory_gb=round(props.total_memory / 2**30, 1))  # fmt: skip
    return info


def run_part(name: str, settings: Settings, store) -> Part:
    """One part, its failure caught and recorded, so that the next part runs; ``store(part)`` saves it
    after each case and at the end. A SIGTERM (``Stopped``) is recorded, then passed on."""
    part = Part(name)
    log(f"part {name}: start")
    start = time.perf_counter()

    def progress(current: Part) -> None:
        current.seconds = time.perf_counter() - start
        store(current, running=True)

    part.on_progress = progress
    try:
        PARTS[name](settings, part)
        part.settle()
    except Stopped as stop:
        part.status, part.reason = "failed", f"stopped by {stop} after {time.perf_counter() - start:.0f} s; " \
            "the cases recorded are those that finished"  # fmt: skip
        raise
    except Exception as error:  # recorded; the command goes on with the next part
        part.status, part.error = "failed", describe(error)
        part.reason = f"{type(error).__name__}: {str(error)[:200]}"
    finally:
        part.seconds = time.perf_counter() - start
        store(part, running=False)
        gc.collect()
        free_memory()
        log(f"part {name}: {part.status} in {part.seconds:.1f} s" + (f" ({part.reason})" if part.reason else ""))
    return part


def _too_late(name: str, settings: Settings) -> Part | None:
    """The part, skipped, when what is left before the time limit is less than it needs."""
    left, needs = settings.seconds_left(), NEEDS_S[name]
    if left >= needs:
        return None
    part = Part(name, status="skipped")
    part.reason = (f"not started: {max(left, 0):.0f} s left of the time limit and it needs about {needs} s; "
                   f"run it in a command of its own (--parts {name})")  # fmt: skip
    log(f"part {name}: {part.reason}")
    return part


@contextlib.contextmanager
def _stop_on_sigterm() -> Iterator[None]:
    """SIGTERM raises Stopped in the main thread (the previous handler is restored on the way out)."""

    def handler(signum: int, frame: object) -> None:
        raise Stopped(signal.Signals(signum).name)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _earlier_results(folder: Path, slug: str, dry_run: bool) -> dict:
    """The folder's results; a folder with none (a GPU machine's empty $OUT) starts from the results the
    repository holds for this device, so that parts run in separate commands add up to one record."""
    if (folder / "gpu_check.json").exists() or dry_run:
        return load(folder / "gpu_check.json")
    committed = REPO / "benchmarks/results/gpu" / slug / "gpu_check.json"
    if committed.exists() and committed.parent != folder:
        log(f"starting from the repository's earlier results, {committed.relative_to(REPO)}")
        return load(committed)
    return load(folder / "gpu_check.json")


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    root = args.out or (
        Path(tempfile.mkdtemp(prefix="mixprec-gpu-")) if args.dry_run else REPO / "benchmarks/results/gpu"
    )
    device = torch.device("cpu" if args.dry_run else "cuda")
    if args.dry_run:
        # one thread: on a busy shared CPU (CI) two threads' barrier waits turn millisecond steps into
        # hundreds; the dry run measures nothing, it only has to run
        torch.set_num_threads(1)
    limit = args.time_limit if args.time_limit is not None else (None if args.dry_run else GPU_TIME_LIMIT_S)
    deadline = time.monotonic() + limit if limit is not None else None
    settings = Settings(device, args.dry_run, root, REPO, args.compile_budget, args.tests_timeout, deadline)
    slug = device_slug(settings)
    folder = root / slug
    results = _earlier_results(folder, slug, args.dry_run)
    results.update(device="CPU (dry run)" if args.dry_run else torch.cuda.get_device_name(device),
                   dry_run=args.dry_run, machine=_machine(settings))  # fmt: skip
    log(f"device {results['device']}, torch {torch.__version__}; parts {', '.join(args.parts)}; results in {folder}"
        + (f"; time limit {limit:.0f} s" if limit is not None else ""))  # fmt: skip

    def store(part: Part, running: bool) -> None:
        record = {**part.to_json(), "ran_at": _stamp(), "torch": torch.__version__}
        if running:
            record["status"] = "unfinished"
            record["reason"] = "the command ended while this part ran; the cases recorded are those that finished"
        results["parts"][part.name] = record
        results["parts"] = {n: results["parts"][n] for n in PARTS if n in results["parts"]}  # fixed order
        save(folder, results)

    statuses = {}
    with _stop_on_sigterm():
        try:
            for name in args.parts:
                late = _too_late(name, settings)
                if late is not None:
                    store(late, running=False)
                    statuses[name] = "not started"
                    continue
                statuses[name] = run_part(name, settings, store).status
        except Stopped as stop:
            statuses["(stopped)"] = "failed"
            log(f"stopped by {stop}; results so far are in {folder}")
    log("done: " + ", ".join(f"{n} {s}" for n, s in statuses.items()) + f"; see {folder / 'summary.md'}")
    return 1 if {"failed", "not started"} & set(statuses.values()) else 0


def _stamp() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


if __name__ == "__main__":
    sys.exit(main())
