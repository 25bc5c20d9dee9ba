"""Editable FP32 op list for a low-precision region, which ``torch.autocast`` does not offer.

PyTorch's autocast op lists are fixed in C++. ``FP32Ops`` is a ``TorchFunctionMode`` (PyTorch's
public extension point, nothing is patched) that intercepts the listed ops at the Python level,
lifts their 16-bit floating inputs to FP32 and runs them with autocast disabled, so they return
FP32. Ops called from inside C++ kernels (the softmax inside ``scaled_dot_product_attention``)
are not seen; list the Python-level op or the module instead.

The mode costs a Python call per torch function while active, so regions only enter it when the
policy lists at least one op.

Example:
    >>> import torch
    >>> with torch.autocast("cpu", dtype=torch.bfloat16), FP32Ops(("softmax",), "cpu"):
    ...     torch.softmax(torch.ones(2, 2) @ torch.ones(2, 2), dim=-1).dtype
    torch.float32
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.overrides import TorchFunctionMode

from mixprec.compute.eager_frames import run_eagerly_when_called_back
from mixprec.compute.nest import map_floating

__all__ = ["FP32Ops"]

_LOW_PRECISION = (torch.float16, torch.bfloat16)


def _names(ops: tuple[str, ...]) -> frozenset[str]:
    # Operators reach __torch_function__ under their dunder names too (a @ b, a + b).
    return frozenset(n for op in ops for n in (op, f"__{op}__", f"__r{op}__"))


def _to_fp32(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.float() if tensor.dtype in _LOW_PRECISION else tensor


class FP32Ops(TorchFunctionMode):
    """Run the torch functions named in ``ops`` in FP32 while the mode is active.

    Args:
        ops: op names as PyTorch spells them (``"softmax"``, ``"exp"``, ``"matmul"``); both the
            function and the Tensor method of that name are matched.
        device_type: the autocast device type to disable around those ops (``"cpu"``, ``"cuda"``).
    """

    def __init__(self, ops: tuple[str, ...], device_type: str, refuse: Callable[[str], None] | None = None) -> None:
        super().__init__()
        self._refuse = refuse  # called first with what this part does (the region's foreign-recompute refusal)
        self._names = _names(ops)
        self._device_type = device_type

    @run_eagerly_when_called_back
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if kwargs.get("out") is None and getattr(func, "__name__", None) in self._names:  # out=: see emulation.py
            if self._refuse is not None:
                self._refuse(f"the policy's FP32 op {func.__name__}")
            with torch.autocast(self._device_type, enabled=False):
                args, kwargs = map_floating((args, kwargs), _to_fp32)
                return func(*args, **kwargs)
        return func(*args, **kwargs)
