"""This process's place among the ranks, and the few collectives MixedPrecision needs.

Every function here is a no-op in a single process. The collectives run on the tensors' own device
(gloo for CPU tensors, nccl for CUDA ones); none of them reads a value on the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["World", "agree_max", "barrier", "copy_from_main", "local", "reduce_across_ranks", "shard_groups", "world"]


@dataclass(frozen=True)
class World:
    rank: int = 0
    size: int = 1
    backend: str | None = None

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.size > 1


def world() -> World:
    """This process's place in the initialized process group (rank 0 of 1 without one)."""
    if dist.is_available() and dist.is_initialized():
        return World(dist.get_rank(), dist.get_world_size(), dist.get_backend())
    return World()


def agree_max(flags: list[torch.Tensor]) -> list[torch.Tensor]:
    """Every rank's flags become their maximum over ranks (one all-reduce of a few numbers).

    MixedPrecision passes its found-inf flags here, so that all ranks skip the same steps and their
    loss scales never diverge, whether a rank's gradients are a replica (DDP) or a shard (FSDP2).
    """
    if not world().distributed:
        return flags
    stacked = torch.stack([f.reshape(()).float() for f in flags])
    dist.all_reduce(stacked, op=dist.ReduceOp.MAX)
    return [value.reshape(f.shape).to(f.dtype) for value, f in zip(stacked.unbind(), flags, strict=True)]


def copy_from_main(tensors: list[torch.Tensor]) -> None:
    """Every rank's ``tensors`` become rank 0's, in place (one broadcast each): what DDP does to the
    parameters when it wraps a model, done before anything (FP32 masters) is derived from them."""
    if not world().distributed:
        return
    for tensor in tensors:
        dist.broadcast(tensor.detach(), src=0)  # detached: the same storage, outside autograd


def barrier() -> None:
    """Wait until every rank of the process group reaches this point (nothing in a single process)."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def reduce_across_ranks(value: torch.Tensor, op: str = "sum", group: object = None) -> torch.Tensor:
    """``value`` summed over ranks (or, with ``op="max"``, their maximum), out of place; over ``group``'s ranks
    where given (a process group), else every rank's."""
    if not world().distributed:
        return value
    value = value.clone()
    dist.all_reduce(value, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM, group=group)
    return value


def shard_groups(tensor: torch.Tensor) -> tuple:
    """The process groups over which a DTensor's parts add up to the whole: one per mesh dimension of more
    than one rank that shards it (FSDP2: the one; HSDP's 2-D mesh: the shard dimension, not the replicas,
    which hold equal copies); () for a DTensor replicated whole. A plain tensor: every rank's (``(None,)``, the
    default group), as before placements were read: what a rank holds of it is unknown, and the ranks must agree."""
    placements, mesh = getattr(tensor, "placements", None), getattr(tensor, "device_mesh", None)
    if placements is None or mesh is None:
        return (None,)
    return tuple(
        mesh.get_group(dim) for dim, placement in enumerate(placements) if placement.is_shard() and mesh.size(dim) > 1
    )


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor: a DTensor's local shard (sharing its storage), else the tensor."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if to_local is not None else tensor
