"""DistributedDataParallel under a policy, with gradients all-reduced in FP32 on request.

Under an o2 or pure_bf16 policy DDP's buckets hold 16-bit gradients and are averaged in 16 bits.
``reduce_in_fp32=True`` registers :func:`fp32_allreduce_hook`: each bucket is widened to FP32,
summed across ranks, divided by the world size and rounded once back into the bucket, so the mean
is rounded once instead of the sum of N rounded values (twice the bytes on the wire).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from mixprec.checks import flag

__all__ = ["fp32_allreduce_hook", "wrap_ddp"]


def fp32_allreduce_hook(process_group, bucket):  # no annotations: DDP checks them as objects, not strings
    """A DDP communication hook: average the bucket's gradients in FP32; returns a Future of the bucket."""
    group = process_group if process_group is not None else dist.group.WORLD
    buffer = bucket.buffer()
    wide = buffer.float().div_(dist.get_world_size(group))
    future = dist.all_reduce(wide, group=group, async_op=True).get_future()

    def narrow(done: torch.futures.Future) -> torch.Tensor:
        buffer.copy_(done.value()[0])
        return buffer

    return future.then(narrow)


def wrap_ddp(model: nn.Module, *, reduce_in_fp32: bool = False) -> nn.parallel.DistributedDataParallel:
    """``DistributedDataParallel(model)`` on the model's device; FP32 gradient averaging on request."""
    flag(reduce_in_fp32, "wrap_ddp(reduce_in_fp32=...)")
    first = next(model.parameters(), None)
    device = first.device if first is not None else torch.device("cpu")
    wrapped = nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    if reduce_in_fp32:
        wrapped.register_comm_hook(None, fp32_allreduce_hook)
    return wrapped
