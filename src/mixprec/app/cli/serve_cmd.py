"""``mixprec serve-bench``: a trained run served in fp32, bf16 and fp16, beside plain torch; one table."""

from __future__ import annotations

import argparse
import json
import sys

from mixprec.app.cli.arg_types import file_path, whole_number
from mixprec.app.cli.table import render_table


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "serve-bench",
        help="inference latency and throughput of a run per precision, with accuracy and model size",
        description=(
            "Measure a trained run's model as a server would use it: mixprec fp32/bf16/fp16 and plain torch "
            "fp32/bf16, interleaved in one process; latency at batch 1 (p50/p95), throughput at larger "
            "batches, the task's metric on its held-out test split (else its validation split), the weights' size."
        ),
    )
    parser.add_argument("run_dir", type=file_path, metavar="RUN", help="a run folder written by mixprec train")
    parser.add_argument("--batches", default="1,8,64", help="batch sizes; 1 measures latency (default 1,8,64)")
    parser.add_argument(
        "--seq",
        type=whole_number(),
        default=None,
        help="tokens per sequence for token inputs (default: as many as the task's longest held-out sequence)",
    )
    parser.add_argument("--repeats", type=whole_number(), default=3, help="timed passes per larger batch (default 3)")
    parser.add_argument(
        "--latency-samples", type=whole_number(), default=30, help="timed batch-1 forwards (default 30)"
    )
    parser.add_argument(
        "--cuda-graphs",
        action="store_true",
        help="also time mixprec's modes replayed from CUDA graphs (CUDA only): no launch cost at small batches",
    )
    parser.add_argument(
        "--json", type=file_path, default=None, help="also write the results here (default RUN/serve_bench.json)"
    )
    parser.set_defaults(run=run)


def _batches(text: str) -> tuple[int, ...]:
    try:
        batches = tuple(int(part) for part in text.split(","))
    except ValueError:
        batches = ()
    if not batches or min(batches) < 1:
        raise ValueError(f"--batches: received {text!r}; give batch sizes >= 1 separated by commas, e.g. 1,8,64.")
    return batches


KIND = "serve-bench results"
EARLIER_KEYS = frozenset({"machine", "run", "seq", "results"})  # what serve-bench wrote before the stamp


def run(args: argparse.Namespace) -> int:
    batches = _batches(args.batches)
    for name in ("seq", "repeats", "latency_samples"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1; received {getattr(args, name)}.")
    if args.cuda_graphs:  # refused before the run is loaded
        import torch

        from mixprec.app.cuda_graphs import require_cuda

        require_cuda(torch.device("cuda" if torch.cuda.is_available() else "cpu"), "--cuda-graphs")
    from mixprec.app.machine import machine_info
    from mixprec.app.serve_bench import as_records, serve_bench  # the 'train' extra
    from mixprec.persist import check_overwrite, stamped, write_atomically

    # before the measurements: a --json file mixprec did not write is refused (the run folder's own name is its)
    target = check_overwrite(args.json or args.run_dir / "serve_bench.json", "--json", KIND, EARLIER_KEYS)
    results = serve_bench(
        args.run_dir,
        batches,
        args.seq,
        args.repeats,
        args.latency_samples,
        progress=lambda message: print(message, file=sys.stderr, flush=True),
        cuda_graphs=args.cuda_graphs,
    )
    metric = next((k for k in results[0].evaluation if k != "loss"), None)
    larger = [b for b in batches if b > 1]
    base = results[0]
    headers = ["mode", "size MB", *([metric] if metric else []), "loss"]
    headers += ["latency p50 ms", "p95 ms"] if 1 in batches else []
    unit = base.unit
    headers += [f"batch {b} {unit}s/s" for b in larger] + [f"vs fp32 @{b}" for b in larger]
    rows = []
    for r in results:
        row = [r.mode, f"{r.size_bytes / 2**20:.1f}", *([f"{r.evaluation[metric]:.4f}"] if metric else [])]
        row += [f"{r.evaluation['loss']:.4f}"]
        row += [f"{r.latency_p50_ms:.2f}", f"{r.latency_p95_ms:.2f}"] if 1 in batches else []
        row += [f"{r.throughput[b]:,.1f}" for b in larger]
        row += [f"{r.throughput[b] / base.throughput[b]:.2f}x" for b in larger]
        rows.append(row)
    tokens = f" of {base.seq} tokens" if base.seq else ""
    print(f"{metric or 'loss'} on the {base.split} split; latency of one {unit}{tokens}, throughput in {unit}s/s")
    print(render_table(headers, rows))
    payload = stamped(
        {"machine": machine_info(), "run": str(args.run_dir), "seq": base.seq, "results": as_records(results)}, KIND
    )
    target.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(target, (json.dumps(payload, indent=1) + "\n").encode())
    print(f"wrote {target}")
    return 0
