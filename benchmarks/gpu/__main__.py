"""Entry point: ``PYTHONPATH=src python3 -m benchmarks.gpu [--dry-run] [--out DIR] [--parts a,b]`` from the
repository root (``bash scripts/gpu_check.sh`` does exactly that). Exit status 1 if a part failed, 2 on
a usage error."""

from __future__ import annotations

import argparse
import datetime
import gc
import sys
import tempfile
import time
from pathlib import Path

import torch
from benchmarks.gpu import part_bert, part_fp8, part_gpt, part_syncs, part_tests
from benchmarks.gpu.common import Part, Settings, describe, device_slug, free_memory, log
from benchmarks.gpu.report import load, save

from mixprec.app.machine import machine_info

PARTS = {
    "tests": part_tests.run,
    "syncs": part_syncs.run,
    "gpt": part_gpt.run,
    "fp8": part_fp8.run,
    "bert": part_bert.run,
}
REPO = Path(__file__).resolve().parents[2]


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="gpu_check", description="Check every GPU claim of mixprec (docs/gpu.md).")
    parser.add_argument("--dry-run", action="store_true", help="every part on the CPU at tiny sizes (what CI runs)")
    parser.add_argument("--out", type=Path, help="results root (default: benchmarks/results/gpu; dry run: a temp dir)")
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, from {', '.join(PARTS)}")
    parser.add_argument("--compile-budget", type=float, default=240.0, help="seconds the gpt part may spend compiling")
    parser.add_argument("--tests-timeout", type=float, default=480.0, help="seconds the tests part may run")
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


def run_part(name: str, settings: Settings) -> Part:
    """One part, its failure caught and recorded, so that the next part runs."""
    part = Part(name)
    log(f"part {name}: start")
    start = time.perf_counter()
    try:
        PARTS[name](settings, part)
        part.settle()
    except Exception as error:  # recorded; the command goes on with the next part
        part.status, part.error = "failed", describe(error)
        part.reason = f"{type(error).__name__}: {str(error)[:200]}"
    finally:
        part.seconds = time.perf_counter() - start
        gc.collect()
        free_memory()
    log(f"part {name}: {part.status} in {part.seconds:.1f} s" + (f" ({part.reason})" if part.reason else ""))
    return part


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
    settings = Settings(device, args.dry_run, root, REPO, args.compile_budget, args.tests_timeout)
    folder = root / device_slug(settings)
    results = load(folder / "gpu_check.json")
    results.update(device="CPU (dry run)" if args.dry_run else torch.cuda.get_device_name(device),
                   dry_run=args.dry_run, machine=_machine(settings))  # fmt: skip
    log(f"device {results['device']}, torch {torch.__version__}; parts {', '.join(args.parts)}; results in {folder}")
    statuses = {}
    for name in args.parts:
        part = run_part(name, settings)
        statuses[name] = part.status
        stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        results["parts"][name] = {**part.to_json(), "ran_at": stamp, "torch": torch.__version__}
        results["parts"] = {n: results["parts"][n] for n in PARTS if n in results["parts"]}  # fixed order
        save(folder, results)
    log("done: " + ", ".join(f"{n} {s}" for n, s in statuses.items()) + f"; see {folder / 'summary.md'}")
    return 1 if "failed" in statuses.values() else 0


if __name__ == "__main__":
    sys.exit(main())
