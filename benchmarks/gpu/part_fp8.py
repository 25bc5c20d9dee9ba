"""Part ``fp8``: PyTorch's FP8 GEMM (``torch._scaled_mm``) held to mixprec's exact emulation, and its speed.

Correctness, as docs/fp8.md states it (tests/unit/test_fp8_gemm.py holds the same on every device that
has the kernel): a product of two FP8 values is exact in FP32 and both paths accumulate in FP32, so
    - with small-integer operands every partial sum is exact: kernel == emulation == exact, bit for bit
      (each operand pairing; a row count not divisible by 16 too, which mixprec sends to the kernel);
    - otherwise each differs from the exact product by at most K * eps32 * (|A| @ |B|) / (scales).
mixprec's own kernel path (``fp8_matmul(kernel=True)``) must equal the direct ``torch._scaled_mm`` call. The
kernel's fast accumulation (``use_fast_accum``, the recipes' forward product by default) is recorded against the
same bound, not held to it.
Throughput: e4m3 x e4m3 -> bf16, tensorwise and rowwise, with and without fast accumulation (torchao found the rowwise
kernel slow without it) (and, where its probe passed, the blockwise
kernel as ``scaling=blockwise`` calls it) against a bf16 matmul at 4096^3 and 8192^3, TFLOP/s, CUDA events.
Where the kernel does not run (a CPU without PyTorch's CPU kernel, a GPU below compute capability 8.9)
the emulation is held to the exact product alone, with the reason recorded.
"""

from __future__ import annotations

import statistics

import torch
from benchmarks.gpu.common import Part, Settings, sync

import mixprec
from mixprec.regions.fp8.block_gemm import block_kernel_runs, block_kernel_unavailable_reason, block_scaled_matmul

__all__ = ["run"]

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
PAIRS = {"e4m3 x e4m3": (E4M3, E4M3), "e5m2 x e4m3": (E5M2, E4M3), "e4m3 x e5m2": (E4M3, E5M2)}
EPS32 = torch.finfo(torch.float32).eps


def _kernel(a: torch.Tensor, b: torch.Tensor, sa: torch.Tensor, sb: torch.Tensor) -> torch.Tensor:
    """``torch._scaled_mm`` called directly: it multiplies by its scales, so it gets the reciprocals."""
    b = b.t().contiguous().t()  # column-major, as the kernel wants
    out = torch._scaled_mm(a.contiguous(), b, scale_a=sa.reciprocal(), scale_b=sb.reciprocal(), out_dtype=torch.float32)
    return out[0] if isinstance(out, tuple) else out  # torch before 2.5 returns (out, amax)


def _compare(a, b, sa, sb, kernel: bool, bitwise: bool) -> dict:
    emulated = mixprec.fp8.fp8_matmul(a, b, sa, sb, kernel=False)
    exact = (a.double() @ b.double()) / (sa * sb).double()
    bound = a.shape[1] * EPS32 * (a.double().abs() @ b.double().abs()) / (sa * sb).double()
    figures = {"emulation_error_over_bound": _ratio(emulated, exact, bound)}
    if bitwise:
        figures["emulation_exact"] = bool(torch.equal(emulated, exact.float()))
    ok = figures.get("emulation_exact", figures["emulation_error_over_bound"] <= 1.0)
    if kernel:
        direct = _kernel(a, b, sa, sb)
        through_mixprec = mixprec.fp8.fp8_matmul(a, b, sa, sb, kernel=True)
        figures["kernel_error_over_bound"] = _ratio(direct, exact, bound)
        figures["kernel_max_diff_vs_emulation"] = float((direct - emulated).abs().max())
        figures["mixprec_kernel_path_equals_kernel"] = bool(torch.equal(through_mixprec, direct))
        # fast accumulation (the recipes' forward product by default): recorded, not held to the FP32 bound
        fast = mixprec.fp8.fp8_matmul(a, b, sa, sb, kernel=True, fast_accum=True)
        figures["fast_accum_error_over_bound"] = _ratio(fast, exact, bound)
        if bitwise:
            figures["kernel_equals_emulation"] = bool(torch.equal(direct, emulated))
        ok = ok and figures.get("kernel_equals_emulation", figures["kernel_error_over_bound"] <= 1.0)
        ok = ok and figures["mixprec_kernel_path_equals_kernel"]
    if not ok:
        raise AssertionError(f"FP8 GEMM outside what docs/fp8.md states: {figures}")
    return {"kernel_ran": kernel, **figures}


def _ratio(result: torch.Tensor, exact: torch.Tensor, bound: torch.Tensor) -> float:
    excess = (result.double() - exact).abs() / bound.clamp_min(1e-300)
    return float(excess.max())


def _exact_case(device, pair, shape, kernel) -> dict:
    # integers in [-8, 8]: products <= 64, sums of K <= 4096 of them < 2^24, all exact in FP32
    m, k, n = shape
    gen = torch.Generator().manual_seed(0)
    a = torch.randint(-8, 9, (m, k), generator=gen).float().to(device, pair[0])
    b = torch.randint(-8, 9, (k, n), generator=gen).float().to(device, pair[1])
    sa, sb = torch.tensor(4.0, device=device), torch.tensor(0.5, device=device)
    return _compare(a, b, sa, sb, kernel, bitwise=True)


def _bounded_case(device, shape, kernel) -> dict:
    m, k, n = shape
    gen = torch.Generator().manual_seed(1)
    x, w = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen) * 0.02
    sx = mixprec.fp8.power_of_two_scale(x.abs().amax(), 448.0)
    sw = mixprec.fp8.power_of_two_scale(w.abs().amax(), 448.0)
    xq, wq = (x * sx).to(E4M3).to(device), (w * sw).to(E4M3).to(device)
    return _compare(xq, wq.t(), sx.to(device), sw.to(device), kernel, bitwise=False)


def _tflops(device: torch.device, n: int, kind: str) -> dict:
    """Median TFLOP/s of an n^3 product (``kind``: bf16; e4m3, e4m3 rowwise, each with "fast accum" or not; e4m3
    blockwise) over 5 timed loops (CUDA events)."""
    gen = torch.Generator(device=device).manual_seed(0)
    a, b = (torch.randn(n, n, device=device, generator=gen) for _ in range(2))
    one = torch.ones((), device=device)
    if kind.startswith("e4m3") and kind != "e4m3 blockwise":
        a8, b8, fast = a.to(E4M3), b.to(E4M3).t(), kind.endswith("fast accum")  # b column-major
        # rowwise: a scale per row of a and per column of b (PyTorch's CUTLASS kernel), as scaling=rowwise calls it
        rowwise = "rowwise" in kind
        sa, sb = (torch.ones(n, 1, device=device), torch.ones(1, n, device=device)) if rowwise else (one, one)

        def gemm():
            return torch._scaled_mm(a8, b8, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16, use_fast_accum=fast)
    elif kind == "e4m3 blockwise":  # as the blockwise layers call it: 1x128 x 128x128 scales, FP32 out
        a8, b8 = a.to(E4M3), b.to(E4M3).t()
        sa, sb = torch.ones(n, n // 128, device=device), torch.ones(n // 128, n // 128, device=device)

        def gemm():
            return block_scaled_matmul(a8, sa, b8, sb, square=True, kernel=True)
    else:
        a16, b16 = a.bfloat16(), b.bfloat16()

        def gemm():
            return a16 @ b16

    iters = max(5, int(4e13 // (2 * n**3)))  # about 40 TFLOP per timed loop: long next to a launch
    for _ in range(3):
        gemm()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            gemm()
        end.record()
        sync(device)
        times.append(start.elapsed_time(end) / 1e3 / iters)
    seconds = statistics.median(times)
    return {"ms": round(seconds * 1e3, 3), "tflops": round(2 * n**3 / seconds / 1e12, 1)}


def run(settings: Settings, part: Part) -> None:
    device = settings.device
    kernel = mixprec.fp8.scaled_mm_available(device)
    if not kernel:
        why = mixprec.fp8.scaled_mm_unavailable_reason(device)
        part.meta["kernel_note"] = f"{why}: the emulation is held to the exact product alone"
    small = settings.dry_run
    exact_shapes = [(16, 32, 16), (17, 32, 16)] if small else [(64, 128, 48), (256, 4096, 512), (17, 256, 64)]
    for name, pair in PAIRS.items():
        for shape in exact_shapes:
            part.case({"case": "exact sums", "pair": name, "shape": "x".join(map(str, shape))},
                      lambda p=pair, s=shape: _exact_case(device, p, s, kernel))  # fmt: skip
    bounded = (32, 64, 16) if small else (512, 4096, 1024)
    part.case({"case": "FP32 accumulation bound", "pair": "e4m3 x e4m3", "shape": "x".join(map(str, bounded))},
              lambda: _bounded_case(device, bounded, kernel))  # fmt: skip
    if not (settings.cuda and kernel):
        part.leave_out("throughput", "FP8 GEMM throughput needs CUDA with compute capability 8.9 or newer")
        return
    blockwise = block_kernel_runs(device, True)  # the probe: the kernel held to the emulation on spread scales
    part.meta["blockwise_kernel"] = block_kernel_unavailable_reason(device) or "runs, equal to the emulation"
    for n in (4096, 8192):
        bf16 = part.case({"case": "throughput", "n": n, "dtype": "bf16"}, lambda n=n: _tflops(device, n, "bf16"))
        kinds = ("e4m3", "e4m3 fast accum", "e4m3 rowwise", "e4m3 rowwise fast accum")
        for kind in (*kinds, *(("e4m3 blockwise",) if blockwise else ())):
            fp8 = part.case({"case": "throughput", "n": n, "dtype": kind}, lambda n=n, k=kind: _tflops(device, n, k))
            if bf16 and fp8:
                part.records[-1]["vs_bf16"] = round(fp8["tflops"] / bf16["tflops"], 2)
