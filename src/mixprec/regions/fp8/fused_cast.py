"""An FP8 operand's amax, scale and saturating cast (and the delayed history's update) in one compiled pass.

Eager, casting one operand is about a dozen launches: the amax, the scale from its exponent bits (several
one-value kernels), the multiply, infinities to NaN, the clamp and PyTorch's cast, four of them full passes
over the tensor. On an H200 that was about 25 ms of memory-bound work per step of a 4-layer width-2048 GPT,
more than FP8 saved on its GEMMs (docs/fp8.md). Inductor fuses the same operations into a reduction and
one pointwise pass that reads the tensor twice and writes one byte per value.

Where: CUDA devices with Triton, eagerly (a compiled step compiles this with everything else). Elsewhere,
and wherever compiling fails (warned once), the eager operations: the same code, so the two agree bit for
bit, except that a NaN may come out with the other sign bit (both are NaN, and NaN is all an overflow needs
to reach the loss scaler).

Compiled with dynamic shapes: every operand of a given dtype, format and scaling shares one graph, so a
model's many layer shapes cost one compile per dtype (inductor's few seconds at the first step), not one per
shape. Each format, margin and scaling has a function of its own, so that its variants (three dtypes in a bf16
model: bf16 inputs and gradients, FP32 weights) count alone against dynamo's recompile limit of 8.
"""

from __future__ import annotations

import types
import warnings
from collections.abc import Callable
from typing import NamedTuple

import torch

from mixprec.numerics.formats import Format
from mixprec.regions.fp8.scaling import ScaleState, current_scale, delayed_scale, saturating_cast

__all__ = ["fuses_cast", "scaled_cast"]


class _Target(NamedTuple):
    """What the cast needs of a format, as plain constants: traced with dynamic shapes, a Format's integer
    fields (and the largest value computed from them) would become symbols."""

    max: float
    has_inf: bool
    dtype: torch.dtype

    @staticmethod
    def of(fmt: Format) -> _Target:
        return _Target(float(fmt.max), bool(fmt.has_inf), fmt.torch_dtype)


_COMPILED: dict[tuple, object] = {}  # by format, margin, scaling and amax rule
_FAILED: list[str] = []  # why compiling failed, once: every later cast runs eagerly


def _cast_current(tensor: torch.Tensor, fmt: _Target, margin: int) -> tuple[torch.Tensor, torch.Tensor]:
    scale = current_scale(tensor, fmt.max, margin)
    return saturating_cast(tensor, scale, fmt.max, fmt.has_inf, fmt.dtype), scale


def _cast_delayed(
    tensor: torch.Tensor, history: torch.Tensor, recorded: torch.Tensor, fmt: _Target, margin: int, amax_rule: str
) -> tuple[torch.Tensor, torch.Tensor]:
    scale = delayed_scale(tensor, history, recorded, fmt.max, margin, amax_rule)
    return saturating_cast(tensor, scale, fmt.max, fmt.has_inf, fmt.dtype), scale


def fuses_cast(device: torch.device) -> bool:
    """Whether :func:`scaled_cast` compiles its pass on ``device`` by default: CUDA with Triton, eagerly, and
    compiling has not failed in this process."""
    if device.type != "cuda" or _FAILED or torch.compiler.is_compiling():
        return False
    from torch.utils._triton import has_triton  # the inductor backend's own test

    return has_triton()


def scaled_cast(
    tensor: torch.Tensor, state: ScaleState, fused: bool | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``tensor`` cast to ``state``'s FP8 format with the scale its recipe gives (current or delayed; a delayed
    state records the amax), and that scale: ``(state.scale_for(tensor), cast_to_fp8_storage(...))`` in one
    compiled pass where ``fused`` (default: :func:`fuses_cast` on the tensor's device)."""
    state.to(tensor.device)
    delayed = state.recipe.scaling == "delayed"
    if fused is None:
        fused = fuses_cast(tensor.device)
    if fused and not torch.compiler.is_compiling():
        try:
            if delayed:
                return _compiled(state)(tensor, state.history, state.recorded)
            return _compiled(state)(tensor)
        except Exception as error:  # inductor or Triton missing or broken here: the eager path is the same code
            _FAILED.append(f"{type(error).__name__}: {error}")
            warnings.warn(
                f"mixprec: compiling the FP8 cast failed ({_FAILED[0][:300]}); casting eagerly from now on.",
                RuntimeWarning,
                stacklevel=2,
            )
    fmt, margin = _Target.of(state.format), state.recipe.margin
    if delayed:
        return _cast_delayed(tensor, state.history, state.recorded, fmt, margin, state.recipe.amax)
    return _cast_current(tensor, fmt, margin)


def _compiled(state: ScaleState):
    """The compiled pass for ``state``'s format, margin and scaling: these are constants of the graph (closed
    over: as arguments, dynamic compilation would make them symbolic), the tensors' shapes are dynamic."""
    fmt, margin, amax_rule = _Target.of(state.format), state.recipe.margin, state.recipe.amax
    key = (state.format.name, margin, state.recipe.scaling, amax_rule)
    if key not in _COMPILED:
        if state.recipe.scaling == "delayed":

            def cast(tensor, history, recorded):
                return _cast_delayed(tensor, history, recorded, fmt, margin, amax_rule)

        else:

            def cast(tensor):
                return _cast_current(tensor, fmt, margin)

        _COMPILED[key] = torch.compile(_own_code(cast, "_".join(map(str, key))), dynamic=True, fullgraph=True)
    return _COMPILED[key]


def _own_code(function: Callable, name: str) -> Callable:
    """``function`` with a code object of its own: dynamo keeps compiled variants and counts them against its
    recompile limit per code object, and closures made by one ``def`` share theirs."""
    code = function.__code__.replace(co_name=f"fp8_cast_{name}")
    return types.FunctionType(code, function.__globals__, code.co_name, function.__defaults__, function.__closure__)
