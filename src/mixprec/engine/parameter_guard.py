"""A guard: the parameters as MixedPrecision prepared them, checked at every region entry and update.

Three things done to the model behind the policy's back would otherwise train silently wrong:

- a cast (Lightning Fabric's ``precision="bf16-true"``, ``model.half()``, a full-bf16 evaluation): bf16
  weights updated without FP32 masters under ``mixed_bf16``, other numerics than the policy names;
- a replacement of the parameter tensors (FSDP's ``fully_shard`` applied afterwards, as Accelerate's and the
  Hugging Face Trainer's FSDP do; ``load_state_dict(..., assign=True)``): the optimizer and the FP32 masters
  update the old tensors, and the model the forward runs never changes;
- a move to another device (Accelerate's ``prepare`` and Fabric's ``setup`` place the model on their device):
  the region autocasts for the device MixedPrecision was built on, so a model moved from the CPU to a GPU
  would compute in FP32 there, and the FP32 masters would stay behind on the CPU.
"""

from __future__ import annotations

import operator

import torch
from torch import nn

_DTYPE, _DEVICE, _DATA_PTR = operator.attrgetter("dtype"), operator.attrgetter("device"), torch.Tensor.data_ptr

__all__ = ["ParameterGuard"]

_FIX_CAST = (
    "something cast the model after MixedPrecision prepared it (another framework's precision setting such as "
    "Lightning Fabric's precision='bf16-true' or '16-true', model.half(), or a full-16-bit evaluation). The update "
    "was not applied. Keep the framework at full precision (precision='32-true', mixed_precision='no') and let the "
    "policy set the precision."
)
_FIX_REPLACED = (
    "something replaced the model's parameters after MixedPrecision prepared it (FSDP's fully_shard, as "
    "Accelerate's and the Hugging Face Trainer's FSDP apply it; load_state_dict(..., assign=True)), so the "
    "optimizer and the FP32 masters would update tensors the model no longer uses, and the model would never "
    "train. Nothing was applied. Shard with mixprec.fully_shard(model, policy) before building MixedPrecision "
    "(FSDP2 then carries out the policy), and load weights in place (without assign=True) or before it."
)

_FIX_MOVED = (
    "the model was moved after MixedPrecision prepared it (Accelerate's prepare and Fabric's setup move it to "
    "their device), so the policy's region would autocast for the old device and the FP32 masters would stay "
    "there. Nothing was applied. Move the model to its device first: model.to(accelerator.device) or "
    "model.to(fabric.device), then build MixedPrecision, then prepare or set up."
)


class ParameterGuard:
    """A snapshot of a model's parameters: which tensor each module holds under each name, its dtype and device.

    :meth:`refuse_changes` raises if any was cast, replaced or moved since: a guard (:mod:`mixprec.engine.guards`)
    at every region entry (a clear error, not a dtype clash deep in the forward) and before every update. Two
    loops over the parameters in C (map): the tensor each module holds (a dict lookup), and where its data lives
    (a cast or a move allocates new memory; reading the pointer costs half of reading dtype and device, 34
    against 57 us at 200 parameters); no device work, no host sync. Only when a pointer moved are the dtypes
    and devices read.
    ``sharded``: FSDP2 itself swaps a sharded model's parameters for gathered ones around the forward, so only
    the dtypes are checked.
    """

    def __init__(self, model: nn.Module, sharded: bool = False) -> None:
        self._expected = [
            (f"{prefix}.{name}" if prefix else name, module, name, param, param.dtype, param.device)
            for prefix, module in model.named_modules()
            for name, param in module.named_parameters(recurse=False)
        ]
        self._identity = not sharded
        # the same, as columns for the check's loops in C (map) rather than Python
        self._tables = [entry[1]._parameters for entry in self._expected]
        self._names = [entry[2] for entry in self._expected]
        self._params = [entry[3] for entry in self._expected]
        self._dtypes = [entry[4] for entry in self._expected]
        self._devices = [entry[5] for entry in self._expected]
        self._pointers = list(map(_DATA_PTR, self._params)) if self._identity else None
        # what model.parameters() gives while the check passes (a tied weight once), without walking the modules
        self.parameters = tuple(dict.fromkeys(self._params))

    def before_forward(self, mp: object) -> None:
        self.refuse_changes()

    def before_update(self, mp: object) -> None:
        self.refuse_changes()

    def refuse_changes(self) -> None:
        """Raise ValueError naming the first parameter cast, replaced or moved since the snapshot."""
        if not torch.compiler.is_compiling():  # traced, the loop below becomes the compiler's guards
            params = self._params
            if not self._identity:  # FSDP2 swaps the tensors themselves: their dtypes alone
                if list(map(_DTYPE, params)) == self._dtypes:
                    return
            elif all(map(operator.is_, map(dict.get, self._tables, self._names), params)):
                pointers = list(map(_DATA_PTR, params))
                if pointers == self._pointers:
                    return
                if list(map(_DTYPE, params)) == self._dtypes and list(map(_DEVICE, params)) == self._devices:
                    self._pointers = pointers  # new memory of the same dtype and device (p.data = a clone)
                    return
        for qualified, module, name, param, dtype, device in self._expected:  # which one, and how
            if self._identity and module._parameters.get(name) is not param:
                raise ValueError(
                    f"MixedPrecision: parameter {qualified!r} is no longer the tensor it was: {_FIX_REPLACED}"
                )
            if param.dtype != dtype:
                raise ValueError(
                    f"MixedPrecision: parameter {qualified!r} is now {param.dtype}, but the policy set it to {dtype}: "
                    + _FIX_CAST
                )
            if param.device != device:
                raise ValueError(
                    f"MixedPrecision: parameter {qualified!r} is now on {param.device}, not {device}: {_FIX_MOVED}"
                )
