"""The FP8 matrix product: PyTorch's real FP8 GEMM (``torch._scaled_mm``) or its exact emulation.

Both take operands already cast to FP8 storage and the power-of-two scales they were cast with, and
return the FP32 product, rounded once to the dtype asked for. A product of two FP8 values is exact in
FP32; the emulation and PyTorch's CPU kernel accumulate in FP32, so they agree to the order of the
additions (bit for bit whenever the partial sums are exact). Hopper's FP8 tensor cores keep about 14
bits of each partial sum before promoting it to FP32, so CUDA's kernel may differ by more; the tests hold
the kernel to the emulation on every device that has it, within that device's accumulation precision.

Which path a recipe's ``gemm`` setting picks:
    "emulated"   FP32 matmul of the FP8 values: any device, any shape
    "scaled_mm"  the kernel wherever PyTorch has it (CUDA with compute capability 8.9 or newer, and
                 PyTorch's CPU kernel, which is slower than FP32 there but lets a CPU check it);
                 shapes the kernel refuses (CUDA wants dimensions divisible by 16) fall back to
                 the emulation, so a model never fails on an odd layer
    "auto"       the kernel on CUDA devices that have it, the emulation everywhere else
"""

from __future__ import annotations

import torch

__all__ = [
    "fp8_matmul",
    "recipe_kernel_missing",
    "recipe_uses_kernel",
    "scaled_mm_available",
    "scaled_mm_unavailable_reason",
    "uses_kernel",
]

_CUDA_ALIGNMENT = 16


_WHY_NOT: dict[torch.device, str | None] = {}  # the probe's answers, by device: None where the kernel runs


def scaled_mm_available(device: torch.device) -> bool:
    """Whether ``torch._scaled_mm`` runs on ``device`` (probed once per device with a tiny product)."""
    return scaled_mm_unavailable_reason(device) is None


# torch.compile calls it eagerly and takes the answer as a constant, rather than tracing the probe into
# the graph (it would ignore a functools.cache wrapper). This is the mark torch.compiler.assume_constant_result
# sets, set without it: the decorator imports torch._dynamo, 1.4 s of every process's start (a test holds
# the two marks equal).
scaled_mm_available._dynamo_marked_constant = True  # type: ignore[attr-defined]


def scaled_mm_unavailable_reason(device: torch.device) -> str | None:
    """Why ``torch._scaled_mm`` does not run on ``device`` (the probe's error, say), or None where it does."""
    if device not in _WHY_NOT:
        _WHY_NOT[device] = _probe(device)
    return _WHY_NOT[device]


def _probe(device: torch.device) -> str | None:
    if not hasattr(torch, "_scaled_mm"):
        return f"torch {torch.__version__} has no torch._scaled_mm"
    if device.type == "cuda" and torch.cuda.get_device_capability(device) < (8, 9):
        major, minor = torch.cuda.get_device_capability(device)
        return f"{torch.cuda.get_device_name(device)} has compute capability {major}.{minor}; FP8 GEMM needs 8.9"
    try:
        a = torch.ones(16, 16, device=device, dtype=torch.float8_e4m3fn)
        one = torch.ones((), device=device)
        torch._scaled_mm(a, a.t(), scale_a=one, scale_b=one, out_dtype=torch.float32)
    except (RuntimeError, NotImplementedError) as error:  # kept: on a GPU that should have it, this is a finding
        return f"torch._scaled_mm failed on {device}: {error_line(error)}"
    return None


def rowwise_kernel_runs(device: torch.device) -> bool:
    """Whether ``torch._scaled_mm`` takes rowwise scales on ``device`` (probed once per device; torch 2.11's CPU
    kernel takes one scale per tensor only, and asserts otherwise)."""
    return rowwise_kernel_unavailable_reason(device) is None


rowwise_kernel_runs._dynamo_marked_constant = True  # type: ignore[attr-defined]  # as scaled_mm_available's


def rowwise_kernel_unavailable_reason(device: torch.device) -> str | None:
    """Why rowwise scales do not run on ``device``'s kernel, or None where they do."""
    if device not in _WHY_NOT_ROWWISE:
        _WHY_NOT_ROWWISE[device] = scaled_mm_unavailable_reason(device) or _probe_rowwise(device)
    return _WHY_NOT_ROWWISE[device]


_WHY_NOT_ROWWISE: dict[torch.device, str | None] = {}


def _probe_rowwise(device: torch.device) -> str | None:
    try:
        a = torch.ones(16, 16, device=device, dtype=torch.float8_e4m3fn)
        rows, cols = torch.ones(16, 1, device=device), torch.ones(1, 16, device=device)
        torch._scaled_mm(a, a.t(), scale_a=rows, scale_b=cols, out_dtype=torch.bfloat16)
    except (RuntimeError, NotImplementedError) as error:
        return f"torch._scaled_mm takes no rowwise scales on {device}: {error_line(error)}"
    return None


def error_line(error: BaseException) -> str:
    """A kernel's error in one line for a probe's reason: its type and the first line of its message."""
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0][:300] if text else ''}"


def wants_kernel(gemm: str, device: torch.device) -> bool:
    """Whether a recipe's ``gemm`` setting asks for the kernel on ``device`` (``auto``: on GPUs only)."""
    return gemm == "scaled_mm" or (gemm == "auto" and device.type == "cuda")


def uses_kernel(gemm: str, device: torch.device) -> bool:
    """Whether a recipe's ``gemm`` setting computes with the kernel on ``device``."""
    return wants_kernel(gemm, device) and scaled_mm_available(device)


def recipe_uses_kernel(recipe, device: torch.device) -> bool:
    """Whether ``recipe``'s layers compute on an FP8 GEMM kernel on ``device``: its ``gemm`` setting picks it there,
    and its scaling has a kernel path that runs there. Called inside compiled steps: each probe it reads is taken
    as a constant there."""
    if recipe.scaling in EMULATED_SCALINGS or not uses_kernel(recipe.gemm, device):
        return False
    if recipe.scaling == "blockwise":
        from mixprec.regions.fp8.block_gemm import block_kernel_runs  # it builds on this module

        return block_kernel_runs(device, True)  # the output and the input gradient (1x128 x 128x128)
    return recipe.scaling != "rowwise" or rowwise_kernel_runs(device)


def recipe_kernel_missing(recipe, device: torch.device) -> str | None:
    """Why ``recipe``'s scaling has no kernel path on ``device`` where the plain kernel runs (the scalings in
    EMULATED_SCALINGS have none yet; blockwise's is used where its own probe passed), or None."""
    if recipe.scaling in EMULATED_SCALINGS:
        return f"{recipe.scaling} scaling has no kernel path yet"
    if recipe.scaling == "blockwise":
        from mixprec.regions.fp8.block_gemm import block_kernel_unavailable_reason  # it builds on this module

        return block_kernel_unavailable_reason(device)
    return rowwise_kernel_unavailable_reason(device) if recipe.scaling == "rowwise" else None


EMULATED_SCALINGS = ("mxfp8", "mxfp4", "nvfp4")  # scalings without a kernel path yet (MX, NVFP4: Blackwell's)


def fp8_matmul(
    a: torch.Tensor,
    b: torch.Tensor,
    a_scale: torch.Tensor,
    b_scale: torch.Tensor,
    kernel: bool,
    out_dtype: torch.dtype = torch.float32,
    decode: tuple[torch.Tensor, torch.Tensor] | None = None,
    bias: torch.Tensor | None = None,
    fast_accum: bool = False,
) -> torch.Tensor:
    """``(a / a_scale) @ (b / b_scale) [+ bias]`` for 2-D FP8 tensors ``a`` (M×K) and ``b`` (K×N): summed in FP32,
    then rounded once to the dtype asked for (nearest even). The kernel rounds in its epilogue, so a bf16 product is
    written at half an FP32 one's bytes, with no separate cast pass.

    ``bias`` (N): rounded to ``out_dtype`` first, then added to the FP32 product before the one rounding, as the
    kernel's epilogue adds it and as ``F.linear`` under ``torch.autocast`` does (its bias cast to the compute dtype);
    for an FP32 product that is the FP32 bias itself. On the kernel, a 16-bit product takes it in the epilogue: no
    FP32 output written and read again, no launch of its own.

    Scales are one per tensor, or one per row of ``a`` (M×1) and per column of ``b`` (1×N): rowwise scaling,
    which CUDA's kernel writes in bf16 alone (a product asked in FP32 is then the bf16 rounding of the FP32 sum,
    as torchao's rowwise recipe has it; PyTorch's CPU kernel writes FP32).

    ``decode``: the scales' reciprocals, which the kernel takes, where the caller has them already (a layer
    reuses its operands' in the backward: fewer launches); else computed here. ``fast_accum``: the kernel's fast
    accumulation (on Hopper, partial sums never promoted to FP32: faster, less precise); the emulation and the
    CPU's kernel sum in FP32 either way."""
    if kernel and _kernel_takes(a, b, a_scale, b_scale):
        # the kernel multiplies by its scales: pass the reciprocals (exact, they are powers of two).
        # It wants ``a`` row-major and ``b`` column-major, and writes FP32, bf16 or fp16 only.
        a_decode, b_decode = decode if decode is not None else (a_scale.reciprocal(), b_scale.reciprocal())
        b = b if b.stride(0) == 1 else b.t().contiguous().t()
        written = out_dtype if out_dtype in _KERNEL_OUTPUTS else torch.float32
        rowwise = a_scale.numel() > 1 or b_scale.numel() > 1
        if rowwise and a.device.type == "cuda":
            written = torch.bfloat16
        in_epilogue = bias is not None and written == out_dtype and written != torch.float32
        out = torch._scaled_mm(
            a.contiguous(),
            b,
            scale_a=a_decode.contiguous(),
            scale_b=b_decode.contiguous(),
            bias=bias.to(out_dtype) if in_epilogue else None,
            out_dtype=written,
            use_fast_accum=fast_accum,
        )
        out = out[0] if isinstance(out, tuple) else out  # older torch returns (out, amax)
        return out.to(out_dtype) if in_epilogue else with_bias(out, bias, out_dtype)
    return with_bias(torch.matmul(a.float(), b.float()) / (a_scale * b_scale), bias, out_dtype)


def with_bias(product: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
    """``product`` + ``bias`` rounded once to ``out_dtype``: the bias rounded to ``out_dtype`` first (as the kernel's
    epilogue takes it, and as ``F.linear`` under ``torch.autocast`` casts it), added in FP32. ``product`` (FP32, or
    the kernel's 16-bit output) is not kept: an FP32 one is added to in place."""
    if bias is None:
        return product.to(out_dtype)
    if product.dtype != torch.float32:
        product = product.float()
    return product.add_(bias.to(out_dtype)).to(out_dtype)


_KERNEL_OUTPUTS = (torch.float32, torch.bfloat16, torch.float16)


def _kernel_takes(a: torch.Tensor, b: torch.Tensor, a_scale: torch.Tensor, b_scale: torch.Tensor) -> bool:
    if a.device.type != "cuda":
        return True
    # CUDA's kernel: the inner and output widths (K, N) multiples of 16, any row count M; no e5m2 × e5m2; with
    # rowwise scales, an e4m3 ``b`` (its rowwise kernel takes e4m3 × e4m3 and e5m2 × e4m3)
    if any(size % _CUDA_ALIGNMENT for size in (a.shape[1], b.shape[1])):
        return False
    if a_scale.numel() > 1 or b_scale.numel() > 1:
        return b.dtype == torch.float8_e4m3fn
    return not (a.dtype == torch.float8_e5m2 and b.dtype == torch.float8_e5m2)
