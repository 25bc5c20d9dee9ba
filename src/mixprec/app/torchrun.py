"""Data-parallel runs under ``torchrun``: the process group from the environment, and batch shards.

``torchrun --nproc-per-node N -m mixprec train TASK ...`` sets RANK, WORLD_SIZE, LOCAL_RANK and the
rendezvous address; :func:`init_from_env` joins the group (gloo on CPUs, nccl on GPUs, one GPU per
local rank). The Trainer then wraps the model in DistributedDataParallel, gives each rank its slice of
every global batch, and writes logs, checkpoints and reports from rank 0 only; MixedPrecision makes the
ranks agree on every skipped step.
"""

from __future__ import annotations

import datetime
import gc
import os
import sys
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from mixprec.compute import map_tensors

__all__ = ["exit_now", "init_from_env", "leave_group", "shard"]


def init_from_env(device: str, *, sharded: bool = False, timeout: float | None = None) -> str:
    """Join the process group torchrun describes (if WORLD_SIZE > 1); returns the device to use.

    ``sharded`` (FSDP2) in one process: a group of one, so that the model is sharded as under
    torchrun and reads (and writes) sharded checkpoints, whatever world size wrote them.
    ``timeout``: seconds a collective waits for the other ranks before it raises (None: torch's
    default). A dead peer's closed connection is seen at once; a hung one only at this timeout.

    Raises:
        ValueError: a distributed launch without the rendezvous variables torchrun sets.
    """
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if dist.is_available() and dist.is_initialized():
        return device
    if size <= 1:
        if sharded:
            dist.init_process_group(_backend(device), store=dist.HashStore(), rank=0, world_size=1)
        return device
    missing = [v for v in ("RANK", "MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
    if missing:
        raise ValueError(f"WORLD_SIZE={size} but {', '.join(missing)} are not set; launch with torchrun.")
    cuda = device.startswith("cuda")
    if cuda:
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
        torch.cuda.set_device(device)
    waits = {} if timeout is None else {"timeout": datetime.timedelta(seconds=timeout)}
    dist.init_process_group(_backend(device), **waits)
    return device


def _backend(device: str) -> str:
    return "nccl" if device.startswith("cuda") else "gloo"


def leave_group() -> bool:
    """Destroy the process group, if one was joined; returns whether one was.

    DDP and FSDP2 objects caught in reference cycles are collected first, while the group they hold
    is alive. Even so, a gloo group's threads can abort the interpreter's teardown ("terminate called
    without an active exception", pytorch/pytorch#190489): a command that left a group ends with
    :func:`exit_now`.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return False
    gc.collect()
    dist.destroy_process_group()
    return True


def exit_now(code: int) -> NoReturn:
    """Flush the output and end the process with ``code``, skipping the interpreter's teardown."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def shard(batch: Any, rank: int, size: int, kept: int) -> Any:
    """This rank's slice (along the first dimension) of every tensor in a batch, of its first ``kept`` samples (a
    multiple of the world size: :func:`even_samples`): the ranks get equal shares, and the mean loss over ranks,
    which DDP's gradient averaging computes, is the kept global batch's mean."""
    return map_tensors(batch, lambda tensor: tensor[:kept].tensor_split(size)[rank])


def even_samples(samples: int, size: int) -> int:
    """The samples of a global batch that ``size`` ranks share equally: at most ``size - 1`` fewer. Uneven
    shares (a last batch of 29 on 2 ranks: 15 and 14) would weigh the smaller share's samples more; a batch
    smaller than the world size would leave a rank nothing (a mean over no samples: NaN)."""
    return samples - samples % size
