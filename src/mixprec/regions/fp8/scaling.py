"""Per-tensor FP8 scaling: power-of-two scales from the current amax or from an amax history.

Everything stays on the device (no host sync). A scale is the largest power of two 2**k with
``amax * 2**k <= max`` of the format, less ``margin`` powers of two; found from the exponent bits of
amax (``frexp``), so it is exact. An amax of zero, or a non-finite one, gives the scale 1; non-finite
amaxes are recorded as zero so one overflowing step does not poison a delayed history.
"""

from __future__ import annotations

import math

import torch

from mixprec.numerics.formats import get_format
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


def cast_to_fp8(tensor: torch.Tensor, scale: torch.Tensor, fmt: str) -> torch.Tensor:
    """``tensor * scale`` rounded to ``fmt`` (nearest even, finite values saturating at ±max), as FP32.

    Non-finite values pass through unchanged, so an overflow still reaches the loss scaler.
    """
    spec = get_format(fmt)
    scaled = tensor.float() * scale
    clamped = scaled.clamp(-spec.max, spec.max)
    # PyTorch's own float8 cast where it has the dtype (one fused pass; mixprec.quantize, which equals it
    # bit for bit, is ten times slower); quantize for formats PyTorch lacks
    rounded = clamped.to(spec.torch_dtype).float() if spec.torch_dtype is not None else quantize(clamped, spec)
    return torch.where(torch.isfinite(scaled), rounded, scaled)


class ScaleState:
    """The scale of one tensor role (a layer's input, weight or gradient) under a recipe."""

    def __init__(self, fmt: str, recipe: Fp8Recipe) -> None:
        self.fmt = fmt
        self.recipe = recipe
        self.max = get_format(fmt).max
        self.history: torch.Tensor | None = None  # amaxes, newest at index 0
        self.recorded = 0  # host-side count of entries (no sync needed)

    def scale_for(self, tensor: torch.Tensor) -> torch.Tensor:
        """The scale to cast ``tensor`` with; records its amax for later (delayed) scales."""
        current = torch.linalg.vector_norm(tensor.detach(), float("inf")).float()  # one pass
        if self.recipe.scaling == "delayed" and self.recorded:
            past = self.history[: min(self.recorded, self.recipe.history)]
            amax = past.max() if self.recipe.amax == "max" else past[0]
        else:
            amax = current
        scale = power_of_two_scale(amax, self.max, self.recipe.margin)
        self._record(torch.where(torch.isfinite(current), current, 0.0))
        return scale

    def _record(self, amax: torch.Tensor) -> None:
        if self.recipe.scaling != "delayed":
            return
        if self.history is None:
            self.history = torch.zeros(self.recipe.history, device=amax.device)
        elif self.history.device != amax.device:  # a history loaded on the CPU: keep it, on the tensors' device
            self.history = self.history.to(amax.device)
        self.history = torch.cat([amax.reshape(1), self.history[:-1]])
        self.recorded += 1

    def state_dict(self) -> dict:
        history = self.history if self.history is not None else torch.zeros(self.recipe.history)
        return {"history": history.clone(), "recorded": self.recorded}

    def load_state_dict(self, state: dict) -> None:
        history = state["history"]
        if not isinstance(history, torch.Tensor) or history.shape != (self.recipe.history,):
            raise ValueError(f"FP8 scale state: expected an amax history of {self.recipe.history} values.")
        self.history, self.recorded = history.clone(), int(state["recorded"])
