"""The total norm of a step's gradients, as ``torch.nn.utils.clip_grad_norm_`` computes it, sharded or not."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mixprec.distributed.ranks import reduce_across_ranks

__all__ = ["total_norm"]


def total_norm(grads: Sequence[torch.Tensor], norm_type: float, device: torch.device, sharded: bool) -> torch.Tensor:
    """The ``norm_type`` norm of all ``grads`` together, in FP32, on ``device``. No host sync.

    One kernel launch per device and dtype (as torch's clip_grad_norm_), not one per gradient. ``sharded``: each
    rank holds a part of every gradient (FSDP2), and the parts' norms are combined over ranks (one all-reduce).
    """
    per_grad = torch._foreach_norm(grads, norm_type, dtype=torch.float32)
    norms = torch.stack([norm.to(device) for norm in per_grad])
    if not sharded:
        return torch.linalg.vector_norm(norms, norm_type)
    if norm_type == float("inf"):
        return reduce_across_ranks(norms.amax(), op="max")
    return reduce_across_ranks(norms.pow(norm_type).sum()).pow(1.0 / norm_type)
