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
alone. It takes the scales' reciprocals in the layouts PyTorch checks (:func:`scaled_mm_arguments`; its meta
functions hold them, on any machine: a test). The kernel was not run where this was written (no CUDA), so it is
used on a device only after a probe there, per kind of product (128x128 or 1x128 right-hand tiles), has held it
to the emulation on operands whose tiles' scales span many binades: a wrong layout or a refusal fails the probe,
and those products run the emulation, the compute plan saying why. It is called as a custom op
(``mixprec::block_scaled_mm``), which torch.compile leaves as it is.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mixprec.regions.fp8.gemm import error_line

__all__ = [
    "BLOCK",
    "block_kernel_runs",
    "block_kernel_unavailable_reason",
    "block_scaled_matmul",
    "scaled_mm_arguments",
]

BLOCK = 128
_PROBE_RTOL = 2.0**-8  # a wrong layout misplaces scales by binades: errors of order one, not this
_WHY_NOT: dict[tuple[torch.device, bool], str | None] = {}  # the probe's answers, by device and right-hand tiles
_PRODUCTS = {True: "1x128 x 128x128 (the output and the input gradient)", False: "1x128 x 1x128 (the weight gradient)"}


def block_scaled_matmul(
    a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor, square: bool, kernel: bool
) -> torch.Tensor:
    """The FP32 product of block-scaled ``a`` and ``b`` (see the module docstring); on the kernel where ``kernel``
    (the recipe picks it), its probe passed for this product's tiles on the device, and the shapes suit it (rows
    and columns multiples of 16: the scales' leading dimensions aligned as cuBLAS reads them), else emulated."""
    if kernel and a.shape[0] % 16 == 0 and b.shape[1] % 16 == 0 and block_kernel_runs(a.device, square):
        return _kernel_op()(a, sa, b, sb, square)
    return _emulated(a, sa, b, sb, square)


def _emulated(a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor, square: bool) -> torch.Tensor:
    m, k = a.shape
    n = b.shape[1]
    blocks = k // BLOCK
    partial = torch.einsum("mbi,bin->bmn", a.float().reshape(m, blocks, BLOCK), b.float().reshape(blocks, BLOCK, n))
    b_scale = sb.repeat_interleave(BLOCK, dim=1)[:, :n] if square else sb  # (blocks, N)
    return (partial / (sa.t().unsqueeze(2) * b_scale.unsqueeze(1))).sum(0)


def scaled_mm_arguments(a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor, square: bool) -> tuple:
    """The positional arguments of ``F.scaled_mm`` for this product: ``a`` row-major and ``b`` column-major, the scales'
    reciprocals (decode scales) in the layouts PyTorch checks (its meta functions hold them; a test runs them):
    1x128 scales (rows, K/128), outer-dimension-major (for ``b``: one per column of ``b``, (N, K/128)); 128x128 scales
    (K/128 padded to a multiple of 4 with zeros, N/128), K-major."""
    scaling = F.ScalingType
    a_decode = sa.reciprocal().t().contiguous().t()  # (M, K/128), strides (1, M)
    if square:  # (L4, N/128), strides (1, L4)
        b_decode = F.pad(sb.reciprocal().t().contiguous(), (0, -sb.shape[0] % 4)).contiguous().t()
    else:  # (N, K/128), strides (1, N)
        b_decode = sb.reciprocal().contiguous().t()
    b = b if b.stride(0) == 1 else b.t().contiguous().t()
    b_scaling = scaling.BlockWise128x128 if square else scaling.BlockWise1x128
    return a.contiguous(), b, a_decode, scaling.BlockWise1x128, b_decode, b_scaling


def _on_kernel(a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor, square: bool) -> torch.Tensor:
    return F.scaled_mm(*scaled_mm_arguments(a, sa, b, sb, square), output_dtype=torch.float32)


_OP = None


def _kernel_op():
    """The kernel as a custom op: opaque to torch.compile, which would otherwise lower ``F.scaled_mm`` to the older
    ``torch._scaled_mm`` (seen in Inductor's output code under torch 2.13), whose checks want other scale layouts.
    Registered at the first use, the probe's (eager, where the compute plan is made)."""
    global _OP
    if _OP is None:

        @torch.library.custom_op("mixprec::block_scaled_mm", mutates_args=())
        def block_scaled_mm(
            a: torch.Tensor, sa: torch.Tensor, b: torch.Tensor, sb: torch.Tensor, square: bool
        ) -> torch.Tensor:
            return _on_kernel(a, sa, b, sb, square)

        @block_scaled_mm.register_fake
        def _(a, sa, b, sb, square):
            return a.new_empty((a.shape[0], b.shape[1]), dtype=torch.float32)

        _OP = block_scaled_mm
    return _OP


def block_kernel_runs(device: torch.device, square: bool) -> bool:
    """Whether the products with these right-hand tiles (``square``: 128x128, else 1x128) run on the blockwise kernel on
    ``device``: it took them and matched the emulation there (probed once per device and tiles)."""
    return _why_not(device, square) is None


# taken as a constant by torch.compile, as the plain kernel's probe is (mixprec.regions.fp8.gemm)
block_kernel_runs._dynamo_marked_constant = True  # type: ignore[attr-defined]


def block_kernel_unavailable_reason(device: torch.device) -> str | None:
    """Why blockwise products do not run on the kernel on ``device`` (absent, refused, or unequal to the emulation),
    naming which where one kind runs, or None where both do."""
    square, other = _why_not(device, True), _why_not(device, False)
    if square is None and other is None:
        return None
    if square is not None and other is not None and square == other:
        return square
    return "; ".join(f"{_PRODUCTS[kind]} emulated: {why}" for kind, why in ((True, square), (False, other)) if why)


def _why_not(device: torch.device, square: bool) -> str | None:
    if (device, square) not in _WHY_NOT:
        _WHY_NOT[(device, square)] = _probe(device, square)
    return _WHY_NOT[(device, square)]


def _probe(device: torch.device, square: bool) -> str | None:
    if not hasattr(F, "ScalingType"):
        return f"torch {torch.__version__} has no torch.nn.functional.scaled_mm"
    if device.type == "cuda" and torch.cuda.get_device_capability(device) != (9, 0):
        major, minor = torch.cuda.get_device_capability(device)
        return f"PyTorch's blockwise FP8 GEMM runs on compute capability 9.0 alone; this GPU has {major}.{minor}"
    gen = torch.Generator().manual_seed(0)
    m, k, n = (128, 384, 256) if square else (256, 384, 128)  # 3 K blocks: 128x128 scales padded to 4
    a = _spread(torch.randn(m, k, generator=gen), 1, gen)
    b = _spread(torch.randn(k, n, generator=gen), BLOCK if square else 1, gen, transpose=True)
    sa = torch.exp2(torch.randint(-6, 7, (m, k // BLOCK), generator=gen).float())
    sb_shape = (k // BLOCK, n // BLOCK) if square else (k // BLOCK, n)
    sb = torch.exp2(torch.randint(-6, 7, sb_shape, generator=gen).float())
    a, b, sa, sb = (t.to(device) for t in (a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn), sa, sb))
    try:  # through the custom op the layers call
        got = _kernel_op()(a, sa, b, sb, square)
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
