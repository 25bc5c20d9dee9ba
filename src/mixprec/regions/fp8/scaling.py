"""Per-tensor FP8 scaling: power-of-two scales from the current amax or from an amax history.

Everything stays on the device (no host sync). A scale is the largest power of two 2**k with
``amax * 2**k <= max`` of the format, less ``margin`` powers of two; found from the exponent bits of
amax (``frexp``), so it is exact. An amax of zero, or a non-finite one, gives the scale 1; non-finite
amaxes are left out of a delayed history, so one overflowing step does not poison it.

The state a delayed scale reads and writes is tensors only: the amax history, allocated once and updated
in place (``copy_``), and the count of recorded amaxes, a device scalar (``add_``). So recording inside
the FP8 Linear's autograd function (the gradient's in its backward) traces under torch.compile: the
compiler carries in-place updates of tensors into the graph, while an attribute reassigned there (the
history rebuilt by ``torch.cat``) or a count kept in Python is a side effect it refuses, a graph break in
every FP8 layer. "No history yet" is a ``torch.where`` on the count, not a Python branch, and a
fixed-shape mask stands in for slicing by it, so nothing waits for the host. A custom op
(``torch.library.custom_op`` with ``mutates_args``) was not needed: the autograd function carries the
updates as they are, and the compiled FP8 arithmetic equals eager bit for bit. ``state_dict`` reads the count
(a host sync, at checkpoints only) and keeps the format of earlier checkpoints, ``{"history": tensor,
"recorded": int}``.
"""

from __future__ import annotations

import math

import torch

from mixprec.numerics.formats import Format, get_format
from mixprec.numerics.quantize import quantize
from mixprec.policy.fp8_recipe import Fp8Recipe

__all__ = ["ScaleState", "cast_to_fp8", "power_of_two_scale"]


def power_of_two_scale(amax: torch.Tensor, fmt_max: float, margin: int = 0) -> torch.Tensor:
    """The FP32 scale 2**k, k the largest integer with ``amax * 2**k <= fmt_max``, minus ``margin``."""
    max_mantissa, max_exponent = math.frexp(fmt_max)
    mantissa, exponent = torch.frexp(amax.float())
    k = (max_exponent - exponent) - (mantissa > max_mantissa).int() - margin
    usable = torch.isfinite(amax) & (amax > 0)
    k = torch.where(usable, k, 0).clamp(-126, 126)
    return torch.ldexp(torch.ones_like(amax, dtype=torch.float32), k)


def cast_to_fp8(tensor: torch.Tensor, scale: torch.Tensor, fmt: str | Format) -> torch.Tensor:
    """``tensor * scale`` rounded to ``fmt`` (nearest even, finite values saturating at ±max), as FP32.

    Non-finite values stay non-finite, so an overflow still reaches the loss scaler: NaN and, where the
    format has an infinity (e5m2), ±inf pass through; ±inf becomes NaN where it has none (e4m3, whose NaN
    is its only non-finite value; PyTorch's own cast would saturate it to ±448, a finite value that would
    train on).
    """
    spec = get_format(fmt)
    scaled = tensor.float() * scale
    clamped = scaled.clamp(-spec.max, spec.max)
    # PyTorch's own float8 cast where it has the dtype (one fused pass; mixprec.quantize, which equals it
    # bit for bit, is ten times slower); quantize for formats PyTorch lacks
    rounded = clamped.to(spec.torch_dtype).float() if spec.torch_dtype is not None else quantize(clamped, spec)
    return torch.where(torch.isfinite(scaled), rounded, scaled if spec.has_inf else scaled - scaled)  # inf-inf: NaN


class ScaleState:
    """The scale of one tensor role (a layer's input, weight or gradient) under a recipe.

    Delayed scaling keeps ``history`` (amaxes, newest at index 0) and ``recorded`` (how many amaxes were
    recorded, a device scalar); recording updates both in place (see the module docstring).
    """

    def __init__(self, fmt: str, recipe: Fp8Recipe, device: torch.device | str | None = None) -> None:
        self.fmt = fmt
        self.recipe = recipe
        self.format = get_format(fmt)  # resolved once: a compiled step does no lookup by name
        self.max = self.format.max
        self.history = torch.zeros(recipe.history, dtype=torch.float32, device=device)
        self.recorded = torch.zeros((), dtype=torch.int64, device=device)

    def to(self, device: torch.device) -> None:
        """Keep the state on ``device`` (a history loaded on the CPU, a model moved after setup)."""
        if self.history.device != device:
            self.history, self.recorded = self.history.to(device), self.recorded.to(device)

    def scale_for(self, tensor: torch.Tensor) -> torch.Tensor:
        """The scale to cast ``tensor`` with; records its amax for later (delayed) scales."""
        self.to(tensor.device)
        current = torch.linalg.vector_norm(tensor.detach(), float("inf")).float()  # one pass
        if self.recipe.scaling != "delayed":
            return power_of_two_scale(current, self.max, self.recipe.margin)
        amax = torch.where(self.recorded > 0, self._past_amax(), current)
        scale = power_of_two_scale(amax, self.max, self.recipe.margin)
        self._record(current)
        return scale

    def _past_amax(self) -> torch.Tensor:
        """The history reduced by the recipe (meaningful once ``recorded`` > 0)."""
        if self.recipe.amax != "max":
            return self.history[0]
        # the first min(recorded, history) entries, as a mask of fixed shape: slicing by a device count
        # would wait for the host
        valid = torch.arange(self.history.numel(), device=self.history.device) < self.recorded
        return torch.where(valid, self.history, 0.0).max()

    def _record(self, amax: torch.Tensor) -> None:
        """Push ``amax`` onto the history; a non-finite one (an overflowing step, skipped) is left out, so the
        next scale comes from the amaxes before it (no device-to-host read: both updates are masked)."""
        finite = torch.isfinite(amax)
        shifted = torch.cat([amax.reshape(1), self.history[:-1]])  # cat first: no overlapping copy
        self.history.copy_(torch.where(finite, shifted, self.history))
        self.recorded.add_(finite.to(self.recorded.dtype))

    def state_dict(self) -> dict:
        """The history and the count as an int (reads one device scalar: a host sync, at checkpoints only)."""
        return {"history": self.history.clone(), "recorded": int(self.recorded)}

    def load_state_dict(self, state: dict) -> None:
        history = state["history"]
        if not isinstance(history, torch.Tensor) or history.shape != (self.recipe.history,):
            raise ValueError(f"FP8 scale state: expected an amax history of {self.recipe.history} values.")
        # onto the state's device; a state still on the CPU moves to the tensors' device on first use
        self.history = history.detach().to(self.history.device, torch.float32, copy=True)
        self.recorded = torch.tensor(int(state["recorded"]), dtype=torch.int64, device=self.history.device)
