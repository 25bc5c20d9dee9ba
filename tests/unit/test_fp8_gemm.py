"""PyTorch's real FP8 GEMM (torch._scaled_mm) held to mixprec's exact emulation, on every device that has it."""

import dataclasses
import math

import pytest
import torch
from torch import nn

import mixprec
from mixprec.policy import Fp8Recipe
from mixprec.regions.fp8 import (
    Fp8LinearState,
    ScaleState,
    fp8_linear,
    fp8_matmul,
    power_of_two_scale,
    scaled_mm_available,
)
from mixprec.regions.fp8 import gemm as fp8_gemm

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
CPU_ROWWISE = fp8_gemm.rowwise_kernel_runs(torch.device("cpu"))  # torch 2.11's CPU kernel: one scale per tensor only


def _accumulation_eps(device: torch.device) -> float:
    """The relative precision of the kernel's partial sums: FP32 on the CPU. Hopper's FP8 tensor cores keep
    about 14 bits of each partial sum before cuBLAS promotes it to FP32 (DeepSeek-V3 technical report,
    section 3.3.2), so on CUDA the bounds are those of 14-bit accumulation; the GPU check (docs/gpu.md)
    records the error actually measured against the FP32 bound."""
    return torch.finfo(torch.float32).eps if device.type == "cpu" else 2.0**-13


def _devices():
    devices = [torch.device("cpu")]
    if torch.cuda.is_available():
        devices.append(torch.device("cuda"))
    return [
        pytest.param(
            d, marks=pytest.mark.skipif(not scaled_mm_available(d), reason=f"torch._scaled_mm does not run on {d}")
        )
        for d in devices
    ]


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("dtypes", [(E4M3, E4M3), (E5M2, E4M3), (E4M3, E5M2)])
def test_kernel_equals_emulation_bit_for_bit_when_sums_are_exact(device, dtypes):
    # small integers: every product and partial sum is exact in FP32, so the order of additions
    # cannot matter and the two paths must agree to the last bit
    gen = torch.Generator().manual_seed(0)
    a = torch.randint(-8, 9, (64, 128), generator=gen).float().to(device, dtypes[0])
    b = torch.randint(-8, 9, (128, 48), generator=gen).float().to(device, dtypes[1])
    sa, sb = torch.tensor(4.0, device=device), torch.tensor(0.5, device=device)
    kernel = fp8_matmul(a, b, sa, sb, kernel=True)
    emulated = fp8_matmul(a, b, sa, sb, kernel=False)
    assert kernel.dtype == emulated.dtype == torch.float32
    assert torch.equal(kernel, emulated)
    assert torch.equal(emulated, (a.double() @ b.double() / 2.0).float())  # and both are the exact product


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
def test_a_16_bit_product_is_the_fp32_product_rounded_once(device, out_dtype):
    # exact sums, then one rounding to nearest even: the kernel's epilogue and the emulation's cast agree; the
    # values are chosen so that many products are not representable in 16 bits (odd integers past 2^8)
    gen = torch.Generator().manual_seed(2)
    a = torch.randint(-15, 16, (32, 256), generator=gen).float().to(device, E4M3)
    b = torch.randint(-15, 16, (256, 64), generator=gen).float().to(device, E4M3)
    sa, sb = torch.tensor(0.25, device=device), torch.tensor(2.0, device=device)
    fp32 = fp8_matmul(a, b, sa, sb, kernel=False)
    assert (fp32.to(out_dtype).float() != fp32).any()  # the rounding matters here
    for kernel in (True, False):
        out = fp8_matmul(a, b, sa, sb, kernel=kernel, out_dtype=out_dtype)
        assert out.dtype == out_dtype and torch.equal(out, fp32.to(out_dtype)), kernel
        # a dtype the kernel cannot write (float64): its FP32 product, cast
        assert torch.equal(fp8_matmul(a, b, sa, sb, kernel=kernel, out_dtype=torch.float64), fp32.double()), kernel


@pytest.mark.parametrize("device", _devices())
def test_kernel_agrees_with_emulation_to_the_order_of_additions(device):
    gen = torch.Generator().manual_seed(1)
    x, w = torch.randn(96, 256, generator=gen), torch.randn(64, 256, generator=gen) * 0.02
    sx, sw = power_of_two_scale(x.abs().amax(), 448.0), power_of_two_scale(w.abs().amax(), 448.0)
    xq, wq = (x * sx).to(E4M3).to(device), (w * sw).to(E4M3).to(device)
    sx, sw = sx.to(device), sw.to(device)
    kernel = fp8_matmul(xq, wq.t(), sx, sw, kernel=True).cpu()
    emulated = fp8_matmul(xq, wq.t(), sx, sw, kernel=False).cpu()
    exact = (xq.double() @ wq.double().t()).cpu() / (sx * sw).double().cpu()
    # accumulation of K=256 exact products: each path is within K roundings of the magnitude sum, FP32's
    # for the emulation, the kernel's own for the kernel
    magnitude = (xq.double().abs() @ wq.double().abs().t()).cpu() / (sx * sw).double().cpu()
    bound, kernel_bound = (256 * eps * magnitude for eps in (torch.finfo(torch.float32).eps, _accumulation_eps(device)))
    assert torch.all((emulated.double() - exact).abs() <= bound)
    assert torch.all((kernel.double() - exact).abs() <= kernel_bound)
    assert (kernel - emulated).abs().max() <= (bound + kernel_bound).max()


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("scaling", ["current", "delayed", "rowwise"])
@pytest.mark.parametrize("fast_accum", ["none", "auto"])
def test_fp8_linear_with_the_kernel_matches_the_emulated_layer(device, scaling, fast_accum):
    torch.manual_seed(0)
    x0 = torch.randn(4, 12, 64, device=device)
    w0, b0 = torch.randn(32, 64, device=device) * 0.05, torch.randn(32, device=device)
    grad = torch.randn(4, 12, 32, device=device) * 1e-3
    results = {}
    for gemm in ("scaled_mm", "emulated"):
        state = Fp8LinearState(Fp8Recipe(scaling=scaling, gemm=gemm, fast_accum=fast_accum))
        x, w, b = x0.clone().requires_grad_(), nn.Parameter(w0.clone()), nn.Parameter(b0.clone())
        for _ in range(2):  # the second call uses the delayed history
            x.grad = w.grad = b.grad = None
            y = fp8_linear(x, w, b, state, torch.bfloat16)
            y.float().backward(grad)
        results[gemm] = (y.float(), x.grad, w.grad, b.grad)
    # FP32 accumulation (CPU): a few FP32 roundings apart. 14-bit accumulation (CUDA): the output, rounded
    # to bf16, may differ by one bf16 ulp; the gradients (K = 48 at most) by K of the kernel's roundings
    # relative to the largest value (CUDA's rowwise kernel writes the FP32 gradients in bf16: within that too)
    # Fast accumulation of the output ("auto"; CUDA: no promotion to FP32 at all): within K = 64 of the kernel's
    # roundings of the magnitude sum; the CPU's kernel sums in FP32 whatever it is asked
    out_rtol = 1e-5 if device.type == "cpu" else 2.0**-7
    magnitude = (x0.abs().reshape(-1, 64) @ w0.abs().t()).max().item() + b0.abs().max().item()
    fast_atol = 64 * _accumulation_eps(device) * magnitude if device.type == "cuda" and fast_accum == "auto" else 0.0
    for i, (kernel, emulated) in enumerate(zip(results["scaled_mm"], results["emulated"], strict=True)):
        assert kernel.shape == emulated.shape
        rtol = out_rtol if i == 0 else 1e-5
        atol = (1e-6 if device.type == "cpu" else 48 * _accumulation_eps(device)) * emulated.abs().max().item()
        torch.testing.assert_close(kernel, emulated, rtol=rtol, atol=atol + (fast_atol if i == 0 else 0.0))
    assert results["scaled_mm"][0].shape == (4, 12, 32)


@pytest.mark.parametrize("scaling", ["current", "delayed", "rowwise"])
@pytest.mark.parametrize(
    ("fast_accum", "fast"),
    [("auto", (True, False, False)), ("output", (True, False, False)), ("all", (True,) * 3), ("none", (False,) * 3)],
)
def test_the_products_ask_the_kernel_for_the_accumulation_the_recipe_names(monkeypatch, scaling, fast_accum, fast):
    # the output, input gradient and weight gradient, in that order; the emulation has no such choice
    if scaling == "rowwise" and not CPU_ROWWISE:
        pytest.skip(fp8_gemm.rowwise_kernel_unavailable_reason(torch.device("cpu")))
    calls = []
    real = torch._scaled_mm

    def spy(*args, use_fast_accum=False, **kwargs):
        calls.append(use_fast_accum)
        return real(*args, use_fast_accum=use_fast_accum, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", spy)
    recipe = Fp8Recipe(scaling=scaling, gemm="scaled_mm", fast_accum=fast_accum)
    x, w = torch.randn(16, 32, requires_grad=True), nn.Parameter(torch.randn(48, 32) * 0.05)
    fp8_linear(x, w, None, Fp8LinearState(recipe), torch.bfloat16).float().sum().backward()
    assert tuple(calls) == fast
    assert mixprec.get_policy(f"base=fp8,fp8=(scaling={scaling},fast_accum={fast_accum})").fp8 == dataclasses.replace(
        recipe, gemm="auto"
    )


def test_fast_accumulation_is_a_run_option_of_the_kernels_layers():
    assert str(Fp8Recipe(fast_accum="none")) == "hybrid(fast_accum=none)" and str(Fp8Recipe()) == "hybrid"
    with pytest.raises(ValueError, match=r"fast_accum=\.\.\.\): received 'fast'; use one of auto, output, all, none"):
        Fp8Recipe(fast_accum="fast")
    with pytest.raises(ValueError, match="not to scaling='blockwise': use auto or none"):
        mixprec.get_policy("base=fp8,fp8=(scaling=blockwise,fast_accum=all)")
    assert not Fp8Recipe(scaling="blockwise").fast_accumulation("output")  # auto: none where no kernel takes it
    # a state saved under one accumulation resumes under another: the scale states are the same
    assert mixprec.policy.resumes_under("base=fp8,fp8=(fast_accum=none)", mixprec.get_policy("fp8"))


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("gemm", ["scaled_mm", "emulated"])
def test_the_bias_joins_the_fp32_sum_in_the_outputs_dtype_before_the_one_rounding(device, gemm):
    # as F.linear under torch.autocast computes it (its bias cast to bf16), and as the kernel's epilogue adds it: a
    # 16-bit output with no FP32 copy written and read again
    torch.manual_seed(0)
    x, w = torch.randn(24, 64, device=device), torch.randn(32, 64, device=device) * 0.05
    bias = 1.0 + torch.arange(32, device=device) * 2.0**-12  # most of it not representable in bf16
    recipe = Fp8Recipe(scaling="current", gemm=gemm, fast_accum="none")  # the bias's rounding, not the accumulation's
    with_bias = fp8_linear(x, w, bias, Fp8LinearState(recipe), torch.bfloat16)
    product = fp8_linear(x, w, None, Fp8LinearState(recipe), torch.float32)
    expected = (product + bias.bfloat16().float()).bfloat16()
    if device.type == "cpu" or gemm == "emulated":
        assert torch.equal(with_bias, expected)
    else:  # CUDA: another kernel for the other output dtype may sum in another order
        torch.testing.assert_close(with_bias, expected, rtol=2.0**-7, atol=0)
    assert not torch.equal(expected, (product + bias).bfloat16())  # the case tells the two roundings apart
    full = fp8_linear(x, w, bias, Fp8LinearState(recipe), torch.float32)  # an FP32 output: the FP32 bias itself
    if device.type == "cpu" or gemm == "emulated":
        assert torch.equal(full, product + bias)
    else:
        torch.testing.assert_close(full, product + bias)


def test_auto_uses_the_kernel_on_cuda_only_and_the_choice_is_part_of_the_policy():
    from mixprec.regions.fp8.gemm import uses_kernel

    cpu = torch.device("cpu")
    assert not uses_kernel("auto", cpu) and not uses_kernel("emulated", cpu)
    assert uses_kernel("scaled_mm", cpu) == scaled_mm_available(cpu)
    policy = mixprec.get_policy("base=fp8,fp8=(gemm=scaled_mm)")
    assert policy.fp8.gemm == "scaled_mm" and mixprec.get_policy(str(policy)) == policy
    assert "gemm" not in str(mixprec.get_policy("fp8"))  # the default, auto, is not spelled out
    with pytest.raises(ValueError, match=r"gemm=\.\.\.\): received 'cublas'; use one of auto, emulated, scaled_mm"):
        mixprec.get_policy("base=fp8,fp8=(gemm=cublas)")


@pytest.mark.skipif(not scaled_mm_available(torch.device("cpu")), reason="no CPU FP8 GEMM in this torch")
def test_a_model_trains_identically_enough_with_the_kernel(train_mlp):
    losses = {}
    for gemm in ("scaled_mm", "emulated"):
        # widths the kernel takes (multiples of 16): where it runs, a layer it refuses stays bf16
        _, losses[gemm] = train_mlp(f"base=fp8,fp8=(gemm={gemm},shapes=all)", steps=40, samples=256, classes=4)
    assert losses["scaled_mm"][-1] < 0.7 * losses["scaled_mm"][0]
    assert max(abs(a - b) for a, b in zip(losses["scaled_mm"], losses["emulated"], strict=True)) < 1e-3


@pytest.mark.skipif(not CPU_ROWWISE, reason="no CPU FP8 GEMM with rowwise scales in this torch")
def test_rowwise_scaling_runs_on_the_kernel_where_the_recipe_picks_it(monkeypatch):
    """The kernel is really called, with one scale per row of ``a`` and per column of ``b``, for all three
    products, and the plan says so."""
    calls = []
    scaled_mm = torch._scaled_mm

    def recording(a, b, *, scale_a, scale_b, bias=None, out_dtype, use_fast_accum=False):
        calls.append((tuple(scale_a.shape), tuple(scale_b.shape)))
        return scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, bias=bias, out_dtype=out_dtype)

    monkeypatch.setattr(torch, "_scaled_mm", recording)
    state = Fp8LinearState(Fp8Recipe(scaling="rowwise", gemm="scaled_mm"))
    x, w = torch.randn(24, 64, requires_grad=True), nn.Parameter(torch.randn(32, 64) * 0.05)
    fp8_linear(x, w, None, state, torch.bfloat16).float().sum().backward()
    assert calls == [((24, 1), (1, 32)), ((24, 1), (1, 64)), ((32, 1), (1, 64))]  # y, dx, dw
    model = nn.Linear(64, 32)
    plan = mixprec.MixedPrecision(
        model, torch.optim.SGD(model.parameters(), lr=0.1), "base=fp8,fp8=(scaling=rowwise,gemm=scaled_mm)"
    )
    assert "GEMM layers in FP8 on PyTorch's FP8 GEMM (torch._scaled_mm)" in plan.compute_plan.reason


@pytest.mark.skipif(not scaled_mm_available(torch.device("cpu")), reason="no CPU FP8 GEMM in this torch")
def test_rowwise_scaling_is_emulated_where_the_kernel_takes_no_rowwise_scales(monkeypatch):
    # as torch 2.11's CPU kernel: it asserted on the layer's first product; now the probe finds it, the layer
    # computes the emulation and the plan says why
    real = torch._scaled_mm

    def tensorwise_only(a, b, *, scale_a, scale_b, **kwargs):
        if scale_a.numel() > 1 or scale_b.numel() > 1:
            raise RuntimeError("_scaled_mm only supports per-tensor scaling for CPU backend.")
        return real(a, b, scale_a=scale_a, scale_b=scale_b, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", tensorwise_only)
    monkeypatch.setattr(fp8_gemm, "_WHY_NOT_ROWWISE", {})
    x, w = torch.randn(24, 64), torch.randn(32, 64) * 0.05
    outputs = [
        fp8_linear(x, w, None, Fp8LinearState(Fp8Recipe(scaling="rowwise", gemm=kind)), torch.bfloat16)
        for kind in ("scaled_mm", "emulated")
    ]
    assert torch.equal(*outputs)
    model = nn.Linear(64, 32)
    policy = "base=fp8,fp8=(scaling=rowwise,gemm=scaled_mm)"
    plan = mixprec.MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), policy).compute_plan.reason
    assert "emulated with FP32 arithmetic" in plan and "takes no rowwise scales on cpu" in plan, plan


def test_the_compute_plan_says_which_fp8_gemm_runs():
    def plan(policy: str) -> str:
        model = nn.Linear(16, 16)
        return mixprec.MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), policy).compute_plan.reason

    assert "emulated with FP32 arithmetic" in plan("fp8")  # auto: the emulation on a CPU
    kernel = "torch._scaled_mm" if scaled_mm_available(torch.device("cpu")) else "emulated with FP32 arithmetic"
    assert kernel in plan("base=fp8,fp8=(gemm=scaled_mm)")


def test_a_delayed_history_loaded_on_the_cpu_is_kept_on_the_tensors_device(device):
    recipe = Fp8Recipe(scaling="delayed", history=4)
    state = ScaleState("fp8_e4m3", recipe)
    state.load_state_dict({"history": torch.tensor([3.0, 2.0, 1.0, 0.0]), "recorded": 3})
    scale = state.scale_for(torch.full((8,), 5.0, device=device))
    assert scale.device.type == device
    assert state.history.device.type == device
    assert state.history.cpu().tolist() == [5.0, 3.0, 2.0, 1.0]  # the loaded amaxes kept, the new one first
    assert scale.item() == 2.0 ** math.floor(math.log2(448.0 / 3.0))  # scaled from the loaded history's max


def test_only_the_recorded_amaxes_of_a_loaded_history_count(device):
    # 2 recorded: the 9.0 after them was never recorded (a hand-made or tampered state) and must not set the scale
    state = ScaleState("fp8_e4m3", Fp8Recipe(scaling="delayed", history=4))
    state.load_state_dict({"history": torch.tensor([3.0, 2.0, 9.0, 7.0]), "recorded": 2})
    scale = state.scale_for(torch.full((8,), 0.5, device=device))
    assert scale.item() == 2.0 ** math.floor(math.log2(448.0 / 3.0))
    assert state.history.cpu().tolist() == [0.5, 3.0, 2.0, 0.0] and int(state.recorded) == 3


def test_where_the_kernel_fails_the_probe_says_why_and_the_compute_plan_repeats_it(monkeypatch):
    from mixprec.regions.fp8 import gemm
    from mixprec.regions.plan import compute_plan

    def failing(*args, **kwargs):
        raise RuntimeError("CUBLAS_STATUS_NOT_SUPPORTED when calling cublasLtMatmul\nmore lines")

    monkeypatch.setattr(gemm, "_WHY_NOT", {})  # a fresh probe
    monkeypatch.setattr(torch, "_scaled_mm", failing)
    why = mixprec.fp8.scaled_mm_unavailable_reason(torch.device("cpu"))
    assert (
        why == "torch._scaled_mm failed on cpu: RuntimeError: CUBLAS_STATUS_NOT_SUPPORTED when calling cublasLtMatmul"
    )
    assert not scaled_mm_available(torch.device("cpu"))
    plan = compute_plan(mixprec.get_policy("base=fp8,fp8=(gemm=scaled_mm)"), "cpu")
    assert f"GEMM layers in FP8 emulated with FP32 arithmetic ({why})" in plan.reason
    assert "(torch._scaled_mm failed" not in compute_plan(mixprec.get_policy("fp8"), "cpu").reason  # auto: emulated


def test_the_probe_carries_the_mark_that_makes_torch_compile_take_it_as_a_constant():
    marked = torch.compiler.assume_constant_result(lambda device: True)
    assert vars(marked) and vars(marked).items() <= vars(scaled_mm_available).items()
