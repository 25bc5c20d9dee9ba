"""The total norm of a step's gradients, as ``torch.nn.utils.clip_grad_norm_`` computes it, sharded or not."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mixprec.distributed.ranks import reduce_across_ranks

__all__ = ["total_norm"]


def total_norm(
    grads: Sequence[torch.Tensor], norm_type: float, device: torch.device, groups: Sequence[tuple] | None = None
) -> torch.Tensor:
    """The ``norm_type`` norm of all ``grads`` together, in FP32, on ``device``. No host sync.

    One kernel launch per device and dtype (as torch's clip_grad_norm_), not one per gradient. ``groups``
    (sharded models): for each gradient, this rank's part, the process groups over which its parts add up
    (:func:`~mixprec.distributed.ranks.shard_groups`); the parts' norms are combined over those alone, one
    all-reduce per group (FSDP2: one). Summed over every rank, an HSDP mesh's replicas counted each copy: the
    norm came out sqrt(replicas) too large.
    """
    per_grad = torch._foreach_norm(grads, norm_type, dtype=torch.float32)
    norms = torch.stack([norm.to(device) for norm in per_grad])
    if groups is None:
        return torch.linalg.vector_norm(norms, norm_type)
    infinite = norm_type == float("inf")
    by_groups: dict[tuple, list[int]] = {}
    for index, combined_over in enumerate(groups):
        by_groups.setdefault(combined_over, []).append(index)
    parts = []
    for combined_over, indices in by_groups.items():
        chosen = norms[indices]
        part = chosen.amax() if infinite else chosen.pow(norm_type).sum()
        for group in combined_over:
            part = reduce_across_ranks(part, op="max" if infinite else "sum", group=group)
        parts.append(part)
    together = torch.stack(parts)
    return together.amax() if infinite else together.sum().pow(1.0 / norm_type)
