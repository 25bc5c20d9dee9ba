"""Whether torch.compile can run at this moment: not under a user's TorchDispatchMode.

Dynamo refuses to trace while a TorchDispatchMode that is not PyTorch's own machinery is active (an op counter,
``torch.utils.flop_counter.FlopCounterMode``, a debugging mode around one step), unless the mode says it may be
left out of compiled code (``ignore_compile_internals``): ``torch.compile(..., fullgraph=True)`` raises there, and
torch 2.13 leaves dynamo's ``assume_static_by_default`` switched off after that failure, so every later compile in
the process traces sizes as symbols (measured: a compiled FP8 layer then took other decisions than eager). What
mixprec compiles on its own at first use (the single-pass AdamW kernel, the compiled FP8 cast) therefore neither
compiles nor records a failure under such a mode: that call takes the eager path, and the first call outside the
mode compiles.
"""

from __future__ import annotations

try:  # dynamo's own test (torch 2.12 and later)
    from torch.utils._python_dispatch import any_torch_dispatch_mode_on_stack as _blocking_mode
except ImportError:  # torch 2.11: every mode but PyTorch's own machinery blocks
    from functools import partial

    from torch.utils._python_dispatch import is_in_torch_dispatch_mode

    _blocking_mode = partial(is_in_torch_dispatch_mode, include_infra_modes=False)

__all__ = ["compile_blocked"]


def compile_blocked() -> bool:
    """True while a TorchDispatchMode that dynamo refuses to trace under is active: one other than PyTorch's own
    (fake tensors, functionalization) that does not set ``ignore_compile_internals``."""
    return _blocking_mode()
