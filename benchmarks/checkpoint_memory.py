"""Peak memory of an FSDP2 checkpoint on each rank: gathered to one file on rank 0 vs sharded (each rank
its own shards), side by side in one run.

    python benchmarks/checkpoint_memory.py [--ranks 2] [--width 2048] [--layers 12]

Launches ``--ranks`` CPU processes (gloo) that shard a stack of ``--layers`` Linear(width, width)
layers under mixed_bf16 with FSDP2, take one AdamW step (so that the optimizer holds its two moments),
then save the same state both ways, alternating, twice each:

    gathered   gather_state (full tensors to rank 0's CPU) + save_checkpoint (one file, rank 0 writes)
    sharded    sharded_state (this rank's DTensors) + save_sharded_checkpoint (every rank its shards)

For each save, each rank's resident-set high-water mark (VmHWM, reset through /proc/self/clear_refs
before the save) minus its resident set before it: the memory the save added at its peak. Writes
benchmarks/results/checkpoint_memory.json with the machine and the command.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import mixprec
from mixprec.app.checkpoint import save_checkpoint, save_sharded_checkpoint
from mixprec.app.machine import machine_info
from mixprec.parallel.state import gather_state, sharded_state

MIB = 2**20


def _status(field: str) -> int:
    """A /proc/self/status field in bytes (VmRSS, VmHWM)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def _measured(save) -> dict[str, float]:
    """Run ``save()``; the resident memory it added at its peak, and its time."""
    dist.barrier()
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    before, start = _status("VmRSS"), time.perf_counter()
    save()
    seconds = time.perf_counter() - start
    peak = _status("VmHWM")
    dist.barrier()
    return {"peak_added_mib": round((peak - before) / MIB, 1), "seconds": round(seconds, 3)}


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, folder: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(args.width, args.width) for _ in range(args.layers)))
    mixprec.fully_shard(model, "mixed_bf16")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    mp_ = mixprec.MixedPrecision(model, optimizer, "mixed_bf16")
    with mp_.autocast():
        loss = model(torch.randn(4, args.width)).float().pow(2).mean()
    mp_.backward(loss)
    mp_.step()

    def gathered() -> None:
        model_state, optimizer_state = gather_state(model, optimizer)
        if rank == 0:
            save_checkpoint(Path(folder) / "gathered", 1, {"model": model_state, "optimizer": optimizer_state}, keep=1)

    def sharded() -> None:
        model_state, optimizer_state = sharded_state(model, optimizer)
        state = {"model": model_state, "optimizer": optimizer_state}
        save_sharded_checkpoint(Path(folder) / "sharded", 1, state, keep=1)

    results: dict[str, list] = {"gathered": [], "sharded": []}
    for _ in range(args.repeats):
        for name, save in (("sharded", sharded), ("gathered", gathered)):
            results[name].append(_measured(save))
    Path(out, f"rank{rank}.json").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    params = args.layers * (args.width * args.width + args.width)
    folder, out = tempfile.mkdtemp(prefix="ckpt-mem-"), tempfile.mkdtemp(prefix="ckpt-mem-out-")
    try:
        port = 29500 + os.getpid() % 1000
        mp.start_processes(_worker, args=(args.ranks, port, args, folder, out), nprocs=args.ranks, start_method="spawn")
        ranks = [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(args.ranks)]
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        shutil.rmtree(out, ignore_errors=True)
    state_mib = params * 4 * 3 / MIB  # FP32 weights and AdamW's two moments
    summary = {
        name: {f"rank {r}": max(x["peak_added_mib"] for x in ranks[r][name]) for r in range(args.ranks)}
        for name in ("gathered", "sharded")
    }
    result = {
        "command": "python " + " ".join(sys.argv),
        "machine": machine_info(),
        "parameters": params,
        "training_state_mib": round(state_mib, 1),
        "ranks": args.ranks,
        "peak_added_mib": summary,
        "rank0_gathered_over_sharded": round(
            summary["gathered"]["rank 0"] / max(summary["sharded"]["rank 0"], 1e-9), 2
        ),
        "trials": ranks,
    }
    print(f"{params / 1e6:.1f}M parameters, training state {state_mib:.0f} MiB (FP32 weights + 2 AdamW moments)")
    for name, per_rank in summary.items():
        print(f"{name:9s} " + "  ".join(f"{rank}: +{mib:.0f} MiB" for rank, mib in per_rank.items()))
    print(f"rank 0 peak, gathered / sharded: {result['rank0_gathered_over_sharded']}x")
    target = Path(__file__).parent / "results" / "checkpoint_memory.json"
    target.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {target}")


if __name__ == "__main__":
    main()
