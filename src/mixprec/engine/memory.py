"""Activation memory: the bytes autograd saves for the backward pass of one forward.

Counted with ``torch.autograd.graph.saved_tensors_hooks`` while the forward runs: every tensor saved
for backward, each storage once, except the parameters themselves (they exist anyway). Low-precision
copies of weights that autocast saves do count: they are memory the policy adds.

Example:
    >>> import torch
    >>> model = torch.nn.Linear(64, 64)
    >>> saved_activation_bytes(lambda: model(torch.randn(8, 64)).sum(), model) > 0
    True
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

__all__ = ["saved_activation_bytes"]


def saved_activation_bytes(forward: Callable[[], torch.Tensor], model: nn.Module) -> int:
    """Bytes saved for backward while ``forward()`` runs (its result is discarded, no backward is run)."""
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        forward()
    return sum(storages.values())
