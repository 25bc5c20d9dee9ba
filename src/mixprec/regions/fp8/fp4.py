"""FP4 training, emulated exactly: ``scaling=nvfp4`` (NVIDIA's NVFP4 recipe) and ``scaling=mxfp4`` (OCP MXFP4).

Every operand of a GEMM layer's three products is held in fp4_e2m1 with block scales along the product's
reduction (:mod:`mixprec.numerics.block_formats`), computed through
:class:`~mixprec.regions.fp8.linear.Recast` from the high-precision input and weight saved for backward:

    y  = q(x) @ q(w)^T                      x in 1x16 (NVFP4) or 1x32 (MXFP4) blocks along K
    dx = q_sr(g) @ q(w)                     g in blocks along N, rounded stochastically
    dw = q_sr(R g)^T @ q(R x)               both along the tokens M, after R, a random Hadamard transform

as in "Pretraining Large Language Models with NVFP4" (NVIDIA, 2025), which Transformer Engine's NVFP4 recipe and
torchao's NVFP4 training follow:

- NVFP4's weights are quantized in 16x16 tiles (one e4m3 scale per tile, times the tensor's FP32 scale), so the
  forward and the input gradient use the same quantized weight (the tile is square); MXFP4 has no 2D variant
  in the OCP specification, so its weight is quantized along each product's reduction (32 along K forward,
  along N for dx).
- Gradients are rounded stochastically (unbiased); activations and weights to nearest even. The random draws
  come from torch's generator on the device, so a seeded run repeats exactly. MXFP4's gradients take the
  round-up scale (``scale_rule="ceil"``): under the OCP rule a block's amax lands in [4, 8) times its scale,
  so values past e2m1's 6 saturate, a bias stochastic rounding would keep (and average into every update).
  NVFP4's e4m3 block scale lands the amax near 6 already.
- R rotates each group of 16 tokens by ``D H / 4`` (H the 16x16 Sylvester Hadamard matrix, D a fixed random
  sign diagonal). R is orthogonal, so ``(R g)^T (R x) = g^T x`` before quantization; it spreads an outlier
  over 16 values, so fewer round to zero in their block. Computed in FP32 (sums of 16 values times 1/4).

Emulated on every device: PyTorch's ``scaled_mm`` has no FP4 training path mixprec uses yet.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import torch.nn.functional as F

from mixprec.numerics.block_formats import BLOCK_FORMATS, quantize_blocks
from mixprec.regions.fp8.gemm import with_bias

__all__ = ["MXFP4", "NVFP4", "NVFP4_TILES", "hadamard_rotation", "nvfp4_weight", "rotate_tokens", "tiles", "untiles"]

_GROUP = 16  # tokens per Hadamard rotation
# D: one fixed pattern for every layer and run (drawn once, by torch.randint seeded 0x4F4). Written out, not drawn
# at each build: torch.compile traces through the cache below, and a Generator made inside a compiled step fails
_SIGNS = (-1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1, -1, -1, 1, 1, -1)


def hadamard_rotation(device: torch.device | str | None = None) -> torch.Tensor:
    """``D H / 4``: the 16x16 Sylvester Hadamard matrix with its rows' signs flipped by a fixed random pattern,
    scaled to be orthogonal (every entry ±1/4, exact in FP32). Built once per device (every weight gradient
    reads it); the tensor is shared, so it is not to be written to. Traced by torch.compile, built in the graph
    (the compiler folds it; dynamo warns of a cache it cannot keep)."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    return _build_rotation(device) if torch.compiler.is_compiling() else _rotation(device)


@functools.cache
def _rotation(device: torch.device) -> torch.Tensor:
    return _build_rotation(device)


def _build_rotation(device: torch.device) -> torch.Tensor:
    h = torch.ones(1, 1)
    while h.shape[0] < _GROUP:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    signs = torch.tensor(_SIGNS, dtype=h.dtype)
    return (signs[:, None] * h / 4).to(device)


def rotate_tokens(t: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
    """``t`` (M, C) with each group of 16 rows multiplied by ``rotation``'s transpose, M padded with zero rows
    to a multiple of 16 (the padding rows stay in: ``rotate(g)^T rotate(x)`` needs them to equal ``g^T x``)."""
    padded = F.pad(t.float(), (0, 0, 0, -t.shape[0] % _GROUP))
    groups = padded.reshape(-1, _GROUP, padded.shape[1])
    return torch.einsum("ji,gjc->gic", rotation, groups).reshape(padded.shape)


def _q(t: torch.Tensor, name: str, stochastic: bool = False) -> torch.Tensor:
    """``t``'s values after a round trip through the block format ``name`` along its last dimension, in FP32;
    ``stochastic``: a gradient, its elements rounded stochastically, and an MX scale that never saturates."""
    if not stochastic:
        return quantize_blocks(t.float(), BLOCK_FORMATS[name])
    rule = "ceil" if BLOCK_FORMATS[name].scale == "e8m0" else "ocp"
    return quantize_blocks(t.float(), BLOCK_FORMATS[name], scale_rule=rule, rounding="stochastic")


def tiles(t: torch.Tensor) -> torch.Tensor:
    """``t`` (R, C) padded with zeros to whole 16x16 tiles, one tile a row of 256 values (row-major in the tile)."""
    padded = F.pad(t, (0, -t.shape[1] % _GROUP, 0, -t.shape[0] % _GROUP))
    r, c = padded.shape
    return padded.reshape(r // _GROUP, _GROUP, c // _GROUP, _GROUP).permute(0, 2, 1, 3).reshape(-1, _GROUP * _GROUP)


def untiles(rows: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """:func:`tiles`'s inverse: the (R, C) tensor of ``shape`` back from its tiles."""
    r, c = -(-shape[0] // _GROUP) * _GROUP, -(-shape[1] // _GROUP) * _GROUP
    whole = rows.reshape(r // _GROUP, c // _GROUP, _GROUP, _GROUP).permute(0, 2, 1, 3).reshape(r, c)
    return whole[: shape[0], : shape[1]]


NVFP4_TILES = dataclasses.replace(BLOCK_FORMATS["nvfp4"], name="nvfp4_16x16", block=_GROUP * _GROUP)


def nvfp4_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` (N, K) through NVFP4 with one e4m3 scale per 16x16 tile (and one FP32 scale for the tensor), in
    FP32: each tile is one block of 256 values of a format with NVFP4's elements and scales."""
    return untiles(quantize_blocks(tiles(weight.float()), NVFP4_TILES), weight.shape)


def _weight_grad(grad, rows, name: str) -> torch.Tensor:
    rotation = hadamard_rotation(grad.device)
    rotated_grad, rotated_rows = rotate_tokens(grad, rotation), rotate_tokens(rows, rotation)
    return _q(rotated_grad.t(), name, stochastic=True) @ _q(rotated_rows.t(), name).t()


class NVFP4:
    """NVFP4's three products (see the module docstring)."""

    @staticmethod
    def output(rows, weight, state, bias, out_dtype) -> torch.Tensor:
        return with_bias(_q(rows, "nvfp4") @ nvfp4_weight(weight).t(), bias, out_dtype)

    @staticmethod
    def input_grad(grad, weight, state) -> torch.Tensor:  # the forward's quantized weight: its tiles are square
        return _q(grad, "nvfp4", stochastic=True) @ nvfp4_weight(weight)

    @staticmethod
    def weight_grad(grad, rows, state) -> torch.Tensor:
        return _weight_grad(grad, rows, "nvfp4")


class MXFP4:
    """MXFP4's three products (see the module docstring): blocks of 32 with E8M0 scales (OCP rule)."""

    @staticmethod
    def output(rows, weight, state, bias, out_dtype) -> torch.Tensor:
        return with_bias(_q(rows, "mxfp4") @ _q(weight, "mxfp4").t(), bias, out_dtype)

    @staticmethod
    def input_grad(grad, weight, state) -> torch.Tensor:  # reduced over the output features: w down its columns
        return _q(grad, "mxfp4", stochastic=True) @ _q(weight.t(), "mxfp4").t()

    @staticmethod
    def weight_grad(grad, rows, state) -> torch.Tensor:
        return _weight_grad(grad, rows, "mxfp4")
