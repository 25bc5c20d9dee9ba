"""Whether torch.compile can run at this moment: not under a user's TorchDispatchMode.

Dynamo refuses to trace while a TorchDispatchMode that is not PyTorch's own machinery is active (an op counter,
``torch.utils.flop_counter.FlopCounterMode``, a debugging mode around one step): ``torch.compile(...,
fullgraph=True)`` raises there, and torch 2.13 leaves dynamo's ``assume_static_by_default`` switched off after
that failure, so every later compile in the process traces sizes as symbols (measured: a compiled FP8 layer then
took other decisions than eager). What mixprec compiles on its own at first use (the single-pass AdamW kernel, the
compiled FP8 cast) therefore neither compiles nor records a failure under such a mode: that call takes the eager
path, and the first call outside the mode compiles.
"""

from __future__ import annotations

from torch.utils._python_dispatch import is_in_torch_dispatch_mode

__all__ = ["compile_blocked"]


def compile_blocked() -> bool:
    """True while a TorchDispatchMode other than PyTorch's own (fake tensors, functionalization) is active."""
    return is_in_torch_dispatch_mode(include_infra_modes=False)
