"""An FP8 operand's scale and saturating cast (and the delayed history's update) in one compiled pass.

Eager, casting one operand is about a dozen launches: the amax, the scale from its exponent bits (several
one-value kernels), the multiply, infinities to NaN, the clamp and PyTorch's cast, four of them full passes
over the tensor. On an H200 that was about 25 ms of memory-bound work per step of a 4-layer width-2048 GPT,
more than FP8 saved on its GEMMs (docs/fp8.md). A recipe with ``cast=compiled`` takes the amax eagerly (one
reduction, PyTorch's own) and has Inductor compile the rest into one pointwise pass that reads the tensor
once and writes one byte per value.

The amax stays out of the compiled graph on purpose: compiled with the cast and dynamic sizes, the reduction
ran on an H200 at a tenth of its eager speed (the width-2048 GPT's FP8 step took 566 ms against 50 eager;
docs/fp8.md), where Inductor could not split a reduction whose size it does not know.

Compiled wherever asked (a CUDA device with Triton, a CPU with a C++ compiler), eagerly only (a compiled step
compiles the eager operations with everything else). Compiled, e5m2's infinities are written as bit patterns
(Triton's cast saturates them on Hopper: :func:`~mixprec.regions.fp8.scaling.saturating_cast`), so the pass gives
the eager cast's values: bit for bit, except
that a NaN may come out with the other sign bit (both are NaN, and NaN is all an overflow needs to reach the
loss scaler). Where compiling fails (no Triton, no C++ compiler), that format and recipe cast eagerly from then
on, with one warning, and :func:`compiled_cast_failures` says why; past dynamo's recompile limit a call casts
eagerly and the next tries again. Under a user's TorchDispatchMode nothing compiles: that call casts eagerly
and records no failure (:mod:`mixprec.compute.compile_guard`).

The graph takes a flat alias of the tensor's storage (a 1-D tensor of one dynamic size, not a view: dynamo would
guard a view's base, its shape and the equalities between its sizes), so every layer shape shares it; what
remains to tell variants apart is the input's dtype and the calling context (the forward inside the autocast
region, the backward, inference mode): about five in a bf16 model, under dynamo's limit of 8 per function. Each
format, margin and scaling has a function of its own, so that its variants count alone.
"""

from __future__ import annotations

import types
import warnings
from collections.abc import Callable
from typing import NamedTuple

import torch

from mixprec.compute.compile_guard import compile_blocked
from mixprec.numerics.formats import Format
from mixprec.regions.fp8.scaling import (
    ScaleState,
    amax_of,
    cast_to_fp8_storage,
    delayed_scale,
    own_scale_cast,
    power_of_two_scale,
    saturating_cast,
)

__all__ = ["compiled_cast_failures", "scaled_cast"]


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
_FAILED: dict[tuple, str] = {}  # why compiling failed, by key: that key's later casts run eagerly
_WARNED: set[tuple] = set()


def scaled_cast(
    tensor: torch.Tensor, state: ScaleState, decode: bool = False, record: bool = True
) -> tuple[torch.Tensor, ...]:
    """``tensor`` cast to ``state``'s FP8 format with the scale its recipe gives (current or delayed; a delayed
    state records the amax), and that scale: :meth:`ScaleState.scale_for` then
    :func:`~mixprec.regions.fp8.scaling.own_scale_cast` (current scaling: the scale is the tensor's own) or
    :func:`~mixprec.regions.fp8.scaling.cast_to_fp8_storage` (delayed), the cast compiled where the recipe says
    ``cast=compiled``. ``decode``: also the scale's reciprocal (exact: a power of two), which PyTorch's FP8 GEMM
    takes; the compiled pass computes it with the scale, not as a launch of its own. ``record=False`` (a forward
    without gradients): a delayed state's amax history is read, not updated."""
    state.to(tensor.device)
    recipe = state.recipe
    amax, delayed = amax_of(tensor), recipe.scaling == "delayed"
    key = (state.format.name, recipe.margin, recipe.scaling, recipe.amax)
    if (
        recipe.cast == "compiled"
        and key not in _FAILED
        and tensor.is_contiguous()
        and not torch.compiler.is_compiling()
        and not compile_blocked()  # under a user's dispatch mode: eager, and no failure recorded
    ):
        flat = _flat_alias(tensor)
        try:
            if delayed:
                q, scale, inverse = _compiled(key, state)(flat, amax, *state.tensors(record))
            else:
                q, scale, inverse = _compiled(key, state)(flat, amax)
            return (q.view(tensor.shape), scale, inverse) if decode else (q.view(tensor.shape), scale)
        except Exception as error:
            _fall_back(key, error)
    scale = state.scale_from(amax, record)
    q = (cast_to_fp8_storage if delayed else own_scale_cast)(tensor, scale, state.format)  # the scale is its own
    return (q, scale, scale.reciprocal()) if decode else (q, scale)


def _flat_alias(tensor: torch.Tensor) -> torch.Tensor:
    """A 1-D tensor over ``tensor``'s values (contiguous), sharing its storage, that is not a view of it."""
    flat = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
    with torch.no_grad():
        return flat.set_(tensor.untyped_storage(), tensor.storage_offset(), (tensor.numel(),), (1,))


def _fall_back(key: tuple, error: Exception) -> None:
    """Cast eagerly after ``error``: for good where compiling failed, for this call past the recompile limit; any
    other error (out of memory, a CUDA error) is raised."""
    import torch._dynamo.exc as dynamo_errors  # imported by now: the compile ran

    if not isinstance(error, dynamo_errors.TorchDynamoException):
        raise error
    limit = type(error).__name__ in ("FailOnRecompileLimitHit", "RecompileLimitExceeded", "CacheLimitExceeded")
    reason = f"{type(error).__name__}: {str(error).strip()[:300]}"
    if not limit:
        _FAILED[key] = reason
    if key not in _WARNED:
        _WARNED.add(key)
        then = "this call casts eagerly, the next tries again" if limit else "casting eagerly from now on"
        warnings.warn(
            f"mixprec: compiling the FP8 cast for {key} failed ({reason}); {then}.", RuntimeWarning, stacklevel=3
        )


def compiled_cast_failures() -> dict[str, str]:
    """Why the compiled cast failed, by format, margin, scaling and amax rule (``"fp8_e5m2/0/current/max"``): those
    cast eagerly. Empty where every compiled cast compiled."""
    return {"/".join(map(str, key)): reason for key, reason in _FAILED.items()}


def _compiled(key: tuple, state: ScaleState):
    """The compiled pass for ``state``'s format, margin and scaling (``key``): these are constants of the graph
    (closed over: as arguments, dynamic compilation would make them symbolic), the tensor's size is dynamic."""
    if key in _COMPILED:
        return _COMPILED[key]
    fmt, margin, amax_rule = _Target.of(state.format), state.recipe.margin, state.recipe.amax
    # the operations ScaleState.scale_from and cast_to_fp8_storage run eagerly, with the format as constants
    if state.recipe.scaling == "delayed":

        def cast(tensor, amax, history, recorded):
            scale = delayed_scale(amax, history, recorded, fmt.max, margin, amax_rule)
            return saturating_cast(tensor, scale, fmt.max, fmt.has_inf, fmt.dtype), scale, scale.reciprocal()

    else:

        def cast(tensor, amax):
            scale = power_of_two_scale(amax, fmt.max, margin, guard=False)
            return saturating_cast(tensor, scale, fmt.max, fmt.has_inf, fmt.dtype), scale, scale.reciprocal()

    compiled = torch.compile(_own_code(cast, "_".join(map(str, key))), dynamic=True, fullgraph=True)
    return _COMPILED.setdefault(key, compiled)  # two threads at once: both use the first one stored


def _own_code(function: Callable, name: str) -> Callable:
    """``function`` with a code object of its own: dynamo keeps compiled variants and counts them against its
    recompile limit per code object, and closures made by one ``def`` share theirs."""
    code = function.__code__.replace(co_name=f"fp8_cast_{name}")
    return types.FunctionType(code, function.__globals__, code.co_name, function.__defaults__, function.__closure__)
