"""Block-scaled FP8 layers, emulated exactly: ``scaling=blockwise``, DeepSeek-V3's recipe (a scale per 1x128
tile of activations and gradients and per 128x128 tile of weights), and ``scaling=mxfp8`` (blocks of 32 with
E8M0 scales, OCP MX v1.0; :class:`MXFP8`).

Each product's reduction dimension is cut into blocks of 128; within a block every operand has one scale per
row (activations, gradients) or per 128x128 tile (weights), so a block's partial sums are FP32 sums of exact
FP8 products, divided by the two scales and added across blocks in FP32, as Hopper kernels that promote each
block's partial sum to FP32 do:

    y  = x @ w^T    x in 1x128 tiles along K,   w in 128x128 tiles
    dx = g @ w      g in 1x128 tiles along N,   w in the same 128x128 tiles (they are square), cast again
    dw = g^T @ x    g and x in 128x1 tiles along M (the tokens)

Scales are powers of two from each tile's current amax, so scaling is exact. A dimension that is not a
multiple of 128 is padded with zeros, which change no tile's amax. The blockwise products run on cuBLAS's
blockwise kernel where the recipe picks the kernel and it passed its probe on the device
(:mod:`mixprec.regions.fp8.block_gemm`), else emulated; MXFP8 is emulated on every device for now.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mixprec.numerics.block_formats import BlockFormat, quantize_blocks
from mixprec.numerics.formats import Format
from mixprec.regions.fp8.block_gemm import BLOCK, block_scaled_matmul
from mixprec.regions.fp8.gemm import uses_kernel, with_bias
from mixprec.regions.fp8.scaling import cast_to_fp8_storage, power_of_two_scale

__all__ = ["BLOCK", "BLOCKWISE", "MXFP8", "MX_BLOCK", "round_tiles"]


def _cast_tiles(t: torch.Tensor, fmt: Format, margin: int, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``t`` (R, C) padded with zeros to whole tiles of ``rows`` x ``cols`` and cast to ``fmt``'s storage with a
    power-of-two scale per tile, and the scales, one per tile (R / rows, C / cols)."""
    padded = F.pad(t.float(), (0, -t.shape[1] % cols, 0, -t.shape[0] % rows))
    r, c = padded.shape
    tiles = padded.reshape(r // rows, rows, c // cols, cols)
    amax = torch.linalg.vector_norm(tiles, float("inf"), dim=(1, 3), keepdim=True)
    scale = power_of_two_scale(amax, fmt.max, margin)
    return cast_to_fp8_storage(tiles, scale, fmt).reshape(r, c), scale.reshape(r // rows, c // cols)


def round_tiles(t: torch.Tensor, fmt: Format, rows: int, cols: int, margin: int = 0) -> torch.Tensor:
    """``t`` (R, C) cast to ``fmt`` with a power-of-two scale per tile of ``rows`` x ``cols`` and scaled back, in
    FP32: what a tiled recipe makes of it (a tile of the whole tensor: tensorwise; of a row: rowwise)."""
    quantized, scale = _cast_tiles(t, fmt, margin, rows, cols)
    per_value = scale.repeat_interleave(rows, 0).repeat_interleave(cols, 1)
    return (quantized.float() / per_value)[: t.shape[0], : t.shape[1]]


class BLOCKWISE:
    """The blockwise recipe's three products (through :class:`~mixprec.regions.fp8.linear.Recast`, which casts
    each operand again for each product from the saved high-precision tensors: the weight's 128x128 tiles for
    dx are the forward's, cast again the same way), each a :func:`block_scaled_matmul`: on cuBLAS's blockwise
    kernel where the recipe picks the kernel and it passed its probe for that product's tiles, else emulated."""

    @staticmethod
    def output(rows, weight, state, bias, out_dtype) -> torch.Tensor:  # x in 1x128 tiles along K, w in 128x128 tiles
        fwd, margin = state.input.format, state.recipe.margin
        qx, sx = _cast_tiles(rows, fwd, margin, 1, BLOCK)
        qw, sw = _cast_tiles(weight, fwd, margin, BLOCK, BLOCK)
        y = block_scaled_matmul(qx, sx, qw.t(), sw.t(), True, _kernel(state, rows))
        return with_bias(y[:, : weight.shape[0]], bias, out_dtype)

    @staticmethod
    def input_grad(grad, weight, state) -> torch.Tensor:  # g in 1x128 tiles along N, w in its 128x128 tiles
        margin = state.recipe.margin
        qg, sg = _cast_tiles(grad, state.grad.format, margin, 1, BLOCK)
        qw, sw = _cast_tiles(weight, state.input.format, margin, BLOCK, BLOCK)
        return block_scaled_matmul(qg, sg, qw, sw, True, _kernel(state, grad))[:, : weight.shape[1]]

    @staticmethod
    def weight_grad(grad, rows, state) -> torch.Tensor:  # reduced over the tokens: both in 128x1 tiles along M
        margin = state.recipe.margin
        qg, sg = _cast_tiles(grad, state.grad.format, margin, BLOCK, 1)
        qx, sx = _cast_tiles(rows, state.input.format, margin, BLOCK, 1)
        return block_scaled_matmul(qg.t(), sg.t(), qx, sx, False, _kernel(state, grad))


def _kernel(state, t: torch.Tensor) -> bool:
    """Whether the recipe picks PyTorch's FP8 GEMM on ``t``'s device (each product's own probe decides then)."""
    return uses_kernel(state.recipe.gemm, t.device)


MX_BLOCK = 32


def _mx(t: torch.Tensor, fmt: Format, state) -> torch.Tensor:
    """``t``'s values after an MX round trip along its last dimension: blocks of 32, an E8M0 scale each (by the
    recipe's ``scale_rule``), elements in ``fmt``."""
    block = BlockFormat(f"mx_{fmt.name}", fmt, MX_BLOCK, "e8m0")
    return quantize_blocks(t.float(), block, scale_rule=state.recipe.scale_rule)


class MXFP8:
    """MXFP8's three products (``scaling=mxfp8``, through :class:`~mixprec.regions.fp8.linear.Recast`): every
    operand in blocks of 32 along the product's reduction with an E8M0 scale (OCP MX v1.0; the recipe's
    ``scale_rule``), elements in the recipe's formats. The scales are powers of two, so a product of two
    dequantized values is the exact product of the elements times both scales, and each GEMM is an FP32 product of
    the dequantized operands (a kernel sums in another order)."""

    @staticmethod
    def output(rows, weight, state, bias, out_dtype) -> torch.Tensor:
        fwd = state.input.format
        return with_bias(_mx(rows, fwd, state) @ _mx(weight, fwd, state).t(), bias, out_dtype)

    @staticmethod
    def input_grad(grad, weight, state) -> torch.Tensor:  # reduced over the output features: w down its columns
        return _mx(grad, state.grad.format, state) @ _mx(weight.t(), state.input.format, state).t()

    @staticmethod
    def weight_grad(grad, rows, state) -> torch.Tensor:  # reduced over the tokens: both down their columns
        return _mx(grad.t(), state.grad.format, state) @ _mx(rows.t(), state.input.format, state).t()
