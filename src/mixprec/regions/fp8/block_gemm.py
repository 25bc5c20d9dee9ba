"""The block-scaled FP8 product of ``scaling=blockwise``: cuBLAS's blockwise kernel where it runs, else its exact
emulation.

Operands come in FP8 storage, their reduction (K) a whole number of blocks of 128, with compact power-of-two
scales (the values were multiplied by them):
    a (M, K) with ``sa`` (M, K/128): a scale per row and K block (1x128 tiles; a 128x1 tile of a transposed
      tensor is one of these too);
    b (K, N) with ``sb`` (K/128, N/128) for 128x128 tiles (``square``), or (K/128, N) for tiles of 128x1.
The product is the FP32 sum over K blocks of each block's FP32 partial sum divided by its two scales, as Hopper
kernels that promote each block's partial sum to FP32 compute it (DeepSeek-V3's recipe).

The kernel: ``torch.nn.functional.scaled_mm`` with ``ScalingType.BlockWise1x128`` for ``a`` and ``BlockWise128x128``
or ``BlockWise1x128`` for ``b``, which PyTorch runs on cuBLAS (CUDA 12.9 or newer) on compute capability 9.0
alone. It takes the scales' reciprocals in the layouts cuBLAS reads: 1x128 scales outer-dimension-major,
128x128 scales K-major with their K blocks padded to a multiple of 4 (PyTorch's own tests build them so). Those
layouts could not be run where they were written (no CUDA), so the kernel is used on a device only after a
probe there has held it to the emulation on operands whose tiles' scales span many binades: a wrong layout
fails the probe, and the layers run the emulation, the compute plan saying why.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mixprec.regions.fp8.gemm import error_line

__all__ = ["BLOCK", "block_kernel_available", "block_kernel_unavailable_reason", "block_scaled_matmul"]

BLOCK = 128
_PROBE_RTOL = 2.0**-8  # a wrong layout misplaces scales by binades: errors of order one, not this
_WHY_NOT: dict[torch.device, str | None] = {}


def block_scaled_matmul(
    a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor, square: bool, kernel: bool
) -> torch.Tensor:
    """The FP32 product of block-scaled ``a`` and ``b`` (see the module docstring); on the kernel where ``kernel``
    and the shapes suit it (rows and columns multiples of 16), else emulated."""
    if kernel and a.shape[0] % 16 == 0 and b.shape[1] % 16 == 0:
        return _on_kernel(a, sa, b, sb, square)
    return _emulated(a, sa, b, sb, square)


def _emulated(a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor, square: bool) -> torch.Tensor:
    m, k = a.shape
    n = b.shape[1]
    blocks = k // BLOCK
    partial = torch.einsum("mbi,bin->bmn", a.float().reshape(m, blocks, BLOCK), b.float().reshape(blocks, BLOCK, n))
    b_scale = sb.repeat_interleave(BLOCK, dim=1)[:, :n] if square else sb  # (blocks, N)
    return (partial / (sa.t().unsqueeze(2) * b_scale.unsqueeze(1))).sum(0)


def _on_kernel(a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor, square: bool) -> torch.Tensor:
    scaling = F.ScalingType
    a_decode = sa.reciprocal().t().contiguous().t()  # (M, K/128), outer-dimension-major
    if square:  # (K/128 padded to a multiple of 4, N/128), K-major
        b_decode = F.pad(sb.reciprocal().t().contiguous(), (0, -sb.shape[0] % 4)).contiguous().t()
    else:  # (K/128, N), row-major: the transposed operand's 1x128 scales outer-dimension-major
        b_decode = sb.reciprocal().contiguous()
    b = b if b.stride(0) == 1 else b.t().contiguous().t()  # column-major
    b_scaling = scaling.BlockWise128x128 if square else scaling.BlockWise1x128
    return F.scaled_mm(
        a.contiguous(), b, a_decode, scaling.BlockWise1x128, b_decode, b_scaling, output_dtype=torch.float32
    )


def block_kernel_available(device: torch.device) -> bool:
    """Whether the blockwise kernel runs on ``device`` and matched the emulation there (probed once per device)."""
    return block_kernel_unavailable_reason(device) is None


# taken as a constant by torch.compile, as the plain kernel's probe is (mixprec.regions.fp8.gemm)
block_kernel_available._dynamo_marked_constant = True  # type: ignore[attr-defined]


def block_kernel_unavailable_reason(device: torch.device) -> str | None:
    """Why the blockwise kernel is not used on ``device`` (absent, refused, or unequal to the emulation), or None."""
    if device not in _WHY_NOT:
        _WHY_NOT[device] = _probe(device)
    return _WHY_NOT[device]


def _probe(device: torch.device) -> str | None:
    if not hasattr(F, "ScalingType"):
        return f"torch {torch.__version__} has no torch.nn.functional.scaled_mm"
    if device.type == "cuda" and torch.cuda.get_device_capability(device) != (9, 0):
        major, minor = torch.cuda.get_device_capability(device)
        return f"PyTorch's blockwise FP8 GEMM runs on compute capability 9.0 alone; this GPU has {major}.{minor}"
    gen = torch.Generator().manual_seed(0)
    for square, (m, k, n) in ((True, (128, 384, 256)), (False, (256, 384, 128))):  # 3 K blocks: padded to 4
        a = _spread(torch.randn(m, k, generator=gen), 1, gen)
        b = _spread(torch.randn(k, n, generator=gen), BLOCK if square else 1, gen, transpose=True)
        sa = torch.exp2(torch.randint(-6, 7, (m, k // BLOCK), generator=gen).float())
        sb_shape = (k // BLOCK, n // BLOCK) if square else (k // BLOCK, n)
        sb = torch.exp2(torch.randint(-6, 7, sb_shape, generator=gen).float())
        a, b, sa, sb = (t.to(device) for t in (a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn), sa, sb))
        try:
            got = _on_kernel(a, sa, b, sb, square)
        except (RuntimeError, NotImplementedError, ValueError, TypeError) as error:
            return f"F.scaled_mm refused blockwise scales on {device}: {error_line(error)}"
        want = _emulated(a, sa, b, sb, square)
        if not bool(torch.isfinite(got).all()) or (got - want).norm() > _PROBE_RTOL * want.norm():  # host syncs, once
            error = ((got - want).norm() / want.norm()).item()
            return f"PyTorch's blockwise FP8 GEMM differed from the emulation on {device} (relative error {error:.3g})"
    return None


def _spread(t: torch.Tensor, rows: int, gen: torch.Generator, transpose: bool = False) -> torch.Tensor:
    """``t`` with each tile (``rows`` x 128 along the reduction) multiplied by its own power of two, within e4m3's
    range: values whose products differ by binades from tile to tile."""
    view = t.t() if transpose else t
    r, c = view.shape
    tiles = torch.exp2(torch.randint(-4, 5, (r // rows, c // BLOCK), generator=gen).float())
    spread = view * tiles.repeat_interleave(rows, 0).repeat_interleave(BLOCK, 1)
    return spread.t() if transpose else spread
