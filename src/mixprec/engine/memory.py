"""Activation memory: the bytes autograd saves for the backward pass of one forward.

Counted with ``torch.autograd.graph.saved_tensors_hooks`` while the forward runs: every tensor saved
for backward, each storage once, except the parameters themselves (they exist anyway; under FSDP2 the
all-gathered weights are parameters during the forward, and are freed or re-gathered by FSDP2, so
they are not counted either). Low-precision copies of weights that autocast saves do count: they are
memory the policy adds.

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

from mixprec.compute.emulation import active_emulation
from mixprec.distributed.ranks import local

__all__ = ["saved_activation_bytes"]


def saved_activation_bytes(forward: Callable[[], torch.Tensor], model: nn.Module) -> int:
    """Bytes saved for backward while ``forward()`` runs (its result is discarded, no backward is run); the
    model's buffers are put back as they were.

    Inside an emulated 16-bit region the region's own packing applies first, so what is counted is
    what a training step would really keep.
    """
    parameters = {local(p).untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}
    kept: list[object] = []  # alive until the forward ends, so that no freed address is reused and counted once
    emulation = active_emulation()

    def pack(tensor: torch.Tensor) -> None:
        packed = emulation.pack(tensor) if emulation is not None else tensor
        kept.append((packed, isinstance(tensor, nn.Parameter)))
        # The graph keeps nothing: an op's saved output, returned here, would hold its own grad_fn, a reference
        # cycle through autograd's C++ that Python's collector cannot see (every run leaked its model).

    def unpack(packed: None) -> torch.Tensor:
        raise RuntimeError("saved_activation_bytes measures a forward pass; its graph cannot be backpropagated.")

    buffers = [(buffer, buffer.detach().clone()) for buffer in model.buffers()]
    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        forward()
    with torch.no_grad():  # a measurement changes nothing: a train-mode forward moved BatchNorm's running statistics
        for buffer, before in buffers:
            buffer.copy_(before)
    for packed, is_parameter in kept:  # counted once the forward is done: the emulation settles what it keeps
        storage = (emulation.stored(packed) if emulation is not None else packed).untyped_storage()
        if storage.data_ptr() not in parameters and not is_parameter:
            storages[storage.data_ptr()] = storage.nbytes()
    kept.clear()
    return sum(storages.values())
