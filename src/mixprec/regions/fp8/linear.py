"""A Linear layer computed in FP8, emulated exactly with FP32 arithmetic on any device.

Forward:   y = (q4(x * sx) @ q4(w * sw)^T) / (sx * sw) + b   (b in the output's dtype, as autocast's Linear has it;
           summed in FP32, rounded once)
Backward:  dx = (q5(g * sg) @ q4(w * sw)) / (sg * sw),  dw = (q5(g * sg)^T @ q4(x * sx)) / (sg * sx),
           db = sum(g) (from the unquantized gradient, as FP8 GEMM libraries do)

q4 / q5 are the recipe's forward and backward formats (fp8_e4m3, fp8_e5m2), s the power-of-two scales.
The three products go through :func:`mixprec.regions.fp8.gemm.fp8_matmul`: PyTorch's FP8 GEMM where the recipe's
``gemm`` setting picks it, else its exact emulation (FP32 products of FP8 values, FP32 sums). Operands
are held in FP8 storage (1 byte per value) and the quantized input and weight are saved that way for
the backward pass, as a real FP8 implementation saves them. fp8_e4m3 has no infinity: an infinite input
becomes NaN on the cast (:func:`~mixprec.regions.fp8.scaling.cast_to_fp8`; PyTorch's cast alone would give
448), so an overflow still reaches the loss scaler as a non-finite value.

Under torch.compile the autograd function traces whole, forward and backward: the scales it takes
record their amaxes by updating the state's tensors in place (see :mod:`mixprec.regions.fp8.scaling`),
which the compiler carries into the graph, and the GEMM's kernel choice is a constant to it.
"""

from __future__ import annotations

from typing import Any

import torch

from mixprec.numerics.formats import Format
from mixprec.policy.fp8_recipe import Fp8Recipe
from mixprec.regions.fp8.fused_cast import scaled_cast
from mixprec.regions.fp8.gemm import fp8_matmul, recipe_uses_kernel, uses_kernel
from mixprec.regions.fp8.scaling import ScaleState, own_scale_cast, power_of_two_scale

__all__ = ["Fp8LinearState", "fp8_linear"]


class Fp8LinearState:
    """The scale states of one Linear layer: its input, its weight and its output gradient."""

    def __init__(self, recipe: Fp8Recipe, device: torch.device | str | None = None) -> None:
        self.recipe = recipe
        self.input = ScaleState(recipe.forward, recipe, device)
        self.weight = ScaleState(recipe.forward, recipe, device)
        self.grad = ScaleState(recipe.backward, recipe, device)

    def to(self, device: torch.device) -> None:
        """Keep the three scale states on ``device``."""
        for role in (self.input, self.weight, self.grad):
            role.to(device)

    def state_dict(self) -> dict:
        return {"input": self.input.state_dict(), "weight": self.weight.state_dict(), "grad": self.grad.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        for role in ("input", "weight", "grad"):
            getattr(self, role).load_state_dict(state[role])


def _cast(
    tensor: torch.Tensor, role: ScaleState, kernel: bool, record: bool = True
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """An operand's FP8 storage, its scale, and, for the kernel, the scale's reciprocal (else None); ``record``:
    whether a delayed scale records the operand's amax."""
    if kernel:
        return scaled_cast(tensor, role, decode=True, record=record)
    return (*scaled_cast(tensor, role, record=record), None)


class _Fp8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x, weight, bias, state: Fp8LinearState, out_dtype: torch.dtype, record: bool):
        with torch._C.DisableTorchFunction(), torch.autocast(x.device.type, enabled=False):
            kernel = uses_kernel(state.recipe.gemm, x.device)
            # the kernel takes the scales' reciprocals: taken once here, reused by the backward's products
            xq, sx, x_decode = _cast(x.reshape(-1, x.shape[-1]), state.input, kernel, record)
            wq, sw, w_decode = _cast(weight, state.weight, kernel, record)
            decode = (x_decode, w_decode) if kernel else None
            # rounded once, the bias (in the output's dtype) added in the GEMM's epilogue
            fast = state.recipe.fast_accumulation("output")
            y = fp8_matmul(xq, wq.t(), sx, sw, kernel, out_dtype, decode, bias, fast)
            ctx.save_for_backward(xq, wq, sx, sw, x_decode, w_decode)
            ctx.state, ctx.has_bias, ctx.kernel, ctx.x_shape = state, bias is not None, kernel, x.shape
            ctx.dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype)
            return _output(y, x.shape, out_dtype)

    @staticmethod
    def backward(ctx: Any, grad):
        xq, wq, sx, sw, x_decode, w_decode = ctx.saved_tensors
        state, kernel = ctx.state, ctx.kernel
        x_dtype, w_dtype, b_dtype = ctx.dtypes
        with torch._C.DisableTorchFunction(), torch.autocast(grad.device.type, enabled=False):
            grad = grad.reshape(-1, grad.shape[-1])
            gq, sg, g_decode = _cast(grad, state.grad, kernel)
            grad_x = grad_w = grad_b = None
            if ctx.needs_input_grad[0]:
                decode = (g_decode, w_decode) if kernel else None
                fast = state.recipe.fast_accumulation("input_grad")
                grad_x = fp8_matmul(gq, wq, sg, sw, kernel, x_dtype, decode, fast_accum=fast).reshape(ctx.x_shape)
            if ctx.needs_input_grad[1]:
                decode = (g_decode, x_decode) if kernel else None
                fast = state.recipe.fast_accumulation("weight_grad")
                grad_w = fp8_matmul(gq.t(), xq, sg, sx, kernel, w_dtype, decode, fast_accum=fast)
            if ctx.has_bias and ctx.needs_input_grad[2]:
                grad_b = _bias_grad(grad, b_dtype)
        return grad_x, grad_w, grad_b, None, None, None


def _row_scales(tensor: torch.Tensor, fmt: Format, dim: int, margin: int) -> torch.Tensor:
    """A power-of-two scale per slice of ``tensor`` along ``dim`` (its amax over ``dim``), kept as a dimension: each
    slice's own amax, so no guard (a zero or non-finite slice casts the same under any scale). Along an empty
    ``dim`` (no rows: an MoE expert given no tokens) every scale is 1."""
    if tensor.shape[dim] == 0:  # torch's inf-norm refuses to reduce an empty dimension
        shape = list(tensor.shape)
        shape[dim] = 1
        return torch.ones(shape, dtype=torch.float32, device=tensor.device)
    amax = torch.linalg.vector_norm(tensor, float("inf"), dim=dim, keepdim=True, dtype=torch.float32)
    return power_of_two_scale(amax, fmt.max, margin, guard=False)


class Recast(torch.autograd.Function):
    """A Linear layer whose operands are cast again for each of its three products, from the high-precision
    input and weight saved for backward: ``products`` computes them (the output, in ``out_dtype`` with the bias
    added as :func:`~mixprec.regions.fp8.gemm.with_bias` adds it; the input's and the weight's gradients, in FP32),
    as the finer recipes need, whose scales run along each product's reduction."""

    @staticmethod
    def forward(ctx: Any, x, weight, bias, state: Fp8LinearState, out_dtype: torch.dtype, products: Any):
        with torch._C.DisableTorchFunction(), torch.autocast(x.device.type, enabled=False):
            rows = x.reshape(-1, x.shape[-1])
            y = products.output(rows, weight, state, bias, out_dtype)  # the bias as the per-tensor layer adds it
            ctx.save_for_backward(rows, weight)
            ctx.state, ctx.products, ctx.has_bias, ctx.x_shape = state, products, bias is not None, x.shape
            ctx.dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype)
            return _output(y, x.shape, out_dtype)

    @staticmethod
    def backward(ctx: Any, grad):
        rows, weight = ctx.saved_tensors
        x_dtype, w_dtype, b_dtype = ctx.dtypes
        with torch._C.DisableTorchFunction(), torch.autocast(grad.device.type, enabled=False):
            grad = grad.reshape(-1, grad.shape[-1])
            grad_x = grad_w = grad_b = None
            if ctx.needs_input_grad[0]:
                grad_x = ctx.products.input_grad(grad, weight, ctx.state).reshape(ctx.x_shape).to(x_dtype)
            if ctx.needs_input_grad[1]:
                grad_w = ctx.products.weight_grad(grad, rows, ctx.state).to(w_dtype)
            if ctx.has_bias and ctx.needs_input_grad[2]:
                grad_b = _bias_grad(grad, b_dtype)
        return grad_x, grad_w, grad_b, None, None, None


def _output(y: torch.Tensor, x_shape: torch.Size, out_dtype: torch.dtype) -> torch.Tensor:
    """The product's rows in the input's leading shape, in ``out_dtype``: cast only where it is not (a no-op
    ``.to`` returns the tensor itself, and dynamo of torch 2.11 then gives every input of the autograd function a
    zero gradient: compiled FP8 training trained nothing but the layers after the last FP8 one)."""
    y = y.reshape(*x_shape[:-1], y.shape[-1])
    return y if y.dtype == out_dtype else y.to(out_dtype)


def _bias_grad(grad: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The bias's gradient: ``grad``'s rows summed in FP32 by the reduction itself (no FP32 copy of ``grad``
    written and read again: a full pass over the layer's output gradient, eagerly), in the bias's dtype."""
    return grad.sum(0, dtype=torch.float32).to(dtype)


class _Rowwise:
    """Rowwise scaling (``scaling=rowwise``): each GEMM operand scaled per slice orthogonal to the reduction,
    from its current amax, as torchao's rowwise recipe does; every scale is a power of two, so the products
    stay exact. Forward: the input per row (token), the weight per output row. Backward: dx = g @ w with g per
    row and w per column (input feature); dw = g^T @ x with g per column (output feature) and x per column."""

    @staticmethod
    def output(rows, weight, state: Fp8LinearState, bias, out_dtype) -> torch.Tensor:
        fwd, margin = state.input.format, state.recipe.margin
        sx, sw = _row_scales(rows, fwd, -1, margin), _row_scales(weight, fwd, -1, margin)
        kernel = recipe_uses_kernel(state.recipe, rows.device)
        qx, qw = own_scale_cast(rows, sx, fwd), own_scale_cast(weight, sw, fwd)
        fast = state.recipe.fast_accumulation("output")
        return fp8_matmul(qx, qw.t(), sx, sw.t(), kernel, out_dtype, bias=bias, fast_accum=fast)

    @staticmethod
    def input_grad(grad, weight, state: Fp8LinearState) -> torch.Tensor:
        fwd, bwd, margin = state.input.format, state.grad.format, state.recipe.margin
        sg, sw = _row_scales(grad, bwd, -1, margin), _row_scales(weight, fwd, 0, margin)
        kernel = recipe_uses_kernel(state.recipe, grad.device)
        fast = state.recipe.fast_accumulation("input_grad")
        qg, qw = own_scale_cast(grad, sg, bwd), own_scale_cast(weight, sw, fwd)
        return fp8_matmul(qg, qw, sg, sw, kernel, fast_accum=fast)

    @staticmethod
    def weight_grad(grad, rows, state: Fp8LinearState) -> torch.Tensor:
        fwd, bwd, margin = state.input.format, state.grad.format, state.recipe.margin
        sg, sx = _row_scales(grad, bwd, 0, margin), _row_scales(rows, fwd, 0, margin)
        kernel = recipe_uses_kernel(state.recipe, grad.device)
        fast = state.recipe.fast_accumulation("weight_grad")
        qg, qx = own_scale_cast(grad, sg, bwd).t(), own_scale_cast(rows, sx, fwd)
        return fp8_matmul(qg, qx, sg.t(), sx, kernel, fast_accum=fast)


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    state: Fp8LinearState,
    out_dtype: torch.dtype,
    record: bool = True,
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` with FP8 inputs, weights and gradients (see the module docstring).
    ``record=False`` (a forward without gradients: an evaluation): delayed scales record no amax, so that
    evaluating never changes the training's scales (as Transformer Engine updates them only with gradients)."""
    # a state on another device (loaded on the CPU, a model moved) moves here, where a compiled step may
    # reassign attributes; inside the autograd function only tensor contents change
    state.to(x.device)
    if state.recipe.scaling in ("current", "delayed"):  # one scale per tensor
        return _Fp8Linear.apply(x, weight, bias, state, out_dtype, record)
    # scales along each product's reduction: each product casts its operands again
    from mixprec.regions.fp8.blockwise import BLOCKWISE, MXFP8  # they build on this module
    from mixprec.regions.fp8.fp4 import MXFP4, NVFP4

    products = {"rowwise": _Rowwise, "blockwise": BLOCKWISE, "mxfp8": MXFP8, "mxfp4": MXFP4, "nvfp4": NVFP4}
    return Recast.apply(x, weight, bias, state, out_dtype, products[state.recipe.scaling])
