"""A Linear layer computed in FP8, emulated exactly with FP32 arithmetic on any device.

Forward:   y = (q4(x * sx) @ q4(w * sw)^T) / (sx * sw) + b
Backward:  dx = (q5(g * sg) @ q4(w * sw)) / (sg * sw),  dw = (q5(g * sg)^T @ q4(x * sx)) / (sg * sx),
           db = sum(g) (from the unquantized gradient, as FP8 GEMM libraries do)

q4 / q5 are the recipe's forward and backward formats (fp8_e4m3, fp8_e5m2), s the power-of-two scales.
Products of two FP8 values are exact in FP32 and the sums are FP32, as in an FP8 tensor-core GEMM with
FP32 accumulation; only the order of additions may differ. The quantized input and weight are saved for
the backward pass in FP8 storage (1 byte per value), as a real FP8 implementation saves them.
"""

from __future__ import annotations

from typing import Any

import torch

from mixprec.fp8.scaling import ScaleState, cast_to_fp8

__all__ = ["Fp8LinearState", "fp8_linear"]

_STORAGE = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


class Fp8LinearState:
    """The scale states of one Linear layer: its input, its weight and its output gradient."""

    def __init__(self, recipe) -> None:
        self.recipe = recipe
        self.input = ScaleState(recipe.forward, recipe)
        self.weight = ScaleState(recipe.forward, recipe)
        self.grad = ScaleState(recipe.backward, recipe)

    def state_dict(self) -> dict:
        return {"input": self.input.state_dict(), "weight": self.weight.state_dict(), "grad": self.grad.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        for role in ("input", "weight", "grad"):
            getattr(self, role).load_state_dict(state[role])


class _Fp8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x, weight, bias, state: Fp8LinearState, out_dtype: torch.dtype):
        with torch._C.DisableTorchFunction(), torch.autocast(x.device.type, enabled=False):
            sx, sw = state.input.scale_for(x), state.weight.scale_for(weight)
            xq = cast_to_fp8(x, sx, state.recipe.forward)
            wq = cast_to_fp8(weight, sw, state.recipe.forward)
            y = torch.matmul(xq, wq.t()) / (sx * sw)
            if bias is not None:
                y = y + bias.float()
            ctx.save_for_backward(xq.to(_STORAGE[state.recipe.forward]), wq.to(_STORAGE[state.recipe.forward]), sx, sw)
            ctx.state, ctx.has_bias = state, bias is not None
            ctx.dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype)
            return y.to(out_dtype)

    @staticmethod
    def backward(ctx: Any, grad):
        xq, wq, sx, sw = ctx.saved_tensors
        state = ctx.state
        x_dtype, w_dtype, b_dtype = ctx.dtypes
        with torch._C.DisableTorchFunction(), torch.autocast(grad.device.type, enabled=False):
            xq, wq = xq.float(), wq.float()
            sg = state.grad.scale_for(grad)
            gq = cast_to_fp8(grad, sg, state.recipe.backward)
            grad_x = grad_w = grad_b = None
            if ctx.needs_input_grad[0]:
                grad_x = (torch.matmul(gq, wq) / (sg * sw)).to(x_dtype)
            if ctx.needs_input_grad[1]:
                grad_w = (torch.matmul(gq.reshape(-1, gq.shape[-1]).t(), xq.reshape(-1, xq.shape[-1])) / (sg * sx)).to(
                    w_dtype
                )
            if ctx.has_bias and ctx.needs_input_grad[2]:
                grad_b = grad.float().reshape(-1, grad.shape[-1]).sum(0).to(b_dtype)
        return grad_x, grad_w, grad_b, None, None


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    state: Fp8LinearState,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with FP8 inputs, weights and gradients (see the module docstring)."""
    return _Fp8Linear.apply(x, weight, bias, state, out_dtype)
