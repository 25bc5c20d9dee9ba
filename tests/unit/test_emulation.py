import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec
from mixprec.compute.emulation import EmulatedAutocast
from mixprec.engine.memory import saved_activation_bytes
from mixprec.regions.plan import compute_plan

FP16 = torch.float16


def half_values(t):
    return t.to(FP16).float()


def test_the_emulated_plan_says_what_it_does():
    plan = compute_plan(mixprec.get_policy("base=mixed_fp16,kernels=emulated"), "cpu")
    assert plan.mode == "emulated" and plan.dtype == FP16
    assert "float16 emulated in FP32" in plan.reason and "tensor cores" in plan.reason
    assert "policy kernels=emulated" in plan.reason
    assert compute_plan(mixprec.get_policy("base=mixed_bf16,kernels=native"), "cpu").mode == "native"
    assert compute_plan(mixprec.get_policy("fp32"), "cpu").mode == "fp32"


def test_linear_forward_and_backward_have_tensor_core_numerics():
    torch.manual_seed(0)
    x = torch.randn(8, 16, requires_grad=True)
    w = torch.randn(4, 16, requires_grad=True)
    with EmulatedAutocast(FP16):
        y = F.linear(x, w)
    assert y.dtype == FP16
    expected = F.linear(half_values(x), half_values(w)).to(FP16)  # fp16 inputs, FP32 accumulation, fp16 output
    assert torch.equal(y, expected)
    grad = torch.randn(8, 4)
    y.backward(grad.to(FP16))
    grad16 = half_values(grad)
    assert torch.equal(x.grad, half_values(grad16 @ half_values(w)))  # gradients rounded to fp16 as well
    assert torch.equal(w.grad, half_values(grad16.T @ half_values(x)))


@pytest.mark.parametrize(
    "gemm",
    [lambda x, w: torch.einsum("bi,ji->bj", x, w), lambda x, w: torch.tensordot(x, w.T, dims=1)],
    ids=["einsum", "tensordot"],
)
def test_gemm_composites_compute_in_16_bits_as_autocast_sees_their_gemms(gemm):
    # autocast casts the bmm/mm they decompose into in C++, where no torch function mode sees them: they ran in
    # FP32 under the emulation, equal to FP32, where a GPU's fp16 autocast computes them in fp16
    torch.manual_seed(0)
    x, w = torch.randn(8, 16), torch.randn(4, 16)
    with EmulatedAutocast(FP16):
        y = gemm(x, w)
    assert y.dtype == FP16
    assert torch.equal(y, F.linear(half_values(x), half_values(w)).to(FP16))
    with torch.autocast("cpu", dtype=FP16):
        assert gemm(x, w).dtype == FP16  # what native autocast gives


@pytest.mark.parametrize(
    "op",
    [lambda h: 2**h, torch.linalg.vector_norm, torch.linalg.matrix_norm],
    ids=["number ** tensor", "vector_norm", "matrix_norm"],
)
def test_ops_on_cudas_fp32_lists_compute_in_fp32(op):
    # pow's Scalar overload and the linalg norms are on CUDA autocast's FP32 lists; they stayed fp16 here
    h = torch.randn(4, 4).to(FP16)
    with EmulatedAutocast(FP16):
        out = op(h)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, op(h.float()))


def test_close_to_pytorchs_own_fp16_autocast():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 6 * 6, 10))
    x = torch.randn(4, 3, 8, 8)
    with torch.autocast("cpu", dtype=FP16):
        native = model(x)
    with EmulatedAutocast(FP16):
        emulated = model(x)
    assert native.dtype == emulated.dtype == FP16
    torch.testing.assert_close(emulated, native, rtol=2e-3, atol=2e-3)  # differ only in FP32 summation order


def test_small_gradients_underflow_without_loss_scaling_and_survive_with_it():
    """The classic reason for loss scaling, reproduced on a CPU."""

    def weight_grad(scaler):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 1))
        mp = mixprec.MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.0), "mixed_fp16", scaler)
        with mp.autocast():
            loss = model(torch.randn(32, 16)).float().mean() * 1e-6  # gradients around 1e-8: below fp16's range
        mp.backward(loss)
        mp.unscale_()
        return model[0].weight.grad

    assert torch.count_nonzero(weight_grad(mixprec.NoOpLossScaler())) == 0  # all flushed to zero in fp16
    scaled = weight_grad(mixprec.StaticLossScaler(2.0**16))
    assert torch.count_nonzero(scaled) == scaled.numel()


def test_fp32_lists_run_in_fp32_and_batch_norm_keeps_its_dtype():
    x = torch.randn(4, 6).to(FP16)
    with EmulatedAutocast(FP16):
        assert torch.softmax(x, -1).dtype == torch.float32
        assert F.layer_norm(x, (6,)).dtype == torch.float32
        assert F.cross_entropy(x, torch.zeros(4, dtype=torch.int64)).dtype == torch.float32
        assert F.gelu(x).dtype == FP16  # not in either list: its input's dtype
        assert F.batch_norm(x, torch.zeros(6), torch.ones(6), training=True).dtype == FP16


def test_policy_fp32_ops_and_modules_win_over_the_emulation():
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    seen = {}
    model[1].register_forward_hook(lambda m, a, o: seen.__setitem__("head", (a[0], o)))
    policy = mixprec.get_policy("mixed_fp16").replace(fp32_names=("1",), fp32_ops=("matmul",))
    with mixprec.autocast(policy, model, device="cpu"):
        model(torch.randn(3, 4))
        product = torch.randn(3, 3) @ torch.randn(3, 3)
    given, out = seen["head"]  # fp16 from the emulated layer before it, computed in FP32
    assert out.dtype == torch.float32
    assert torch.equal(out, F.linear(given.float(), model[1].weight, model[1].bias))
    assert product.dtype == torch.float32


@pytest.mark.parametrize("shape", [(4096, 256), (16, 256, 256)])  # 3-D inputs reach the GEMM as views
def test_activations_are_stored_in_fp16(shape):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 256))
    x = torch.randn(*shape)  # activations, not the fp16 copies of the weights, dominate
    fp32 = saved_activation_bytes(lambda: model(x), model)
    with mixprec.autocast("mixed_fp16", model, device="cpu"):
        fp16 = saved_activation_bytes(lambda: model(x), model)
    assert fp16 / fp32 < 0.55


def test_weights_are_rounded_once_per_region():
    w = nn.Parameter(torch.randn(4, 4))
    with EmulatedAutocast(FP16) as mode:
        F.linear(torch.randn(2, 4), w)
        F.linear(torch.randn(2, 4), w)
        assert len(mode._weights) == 1
    assert not mode._weights


def _flash_reference(q, k, v, grad, is_causal, rounded_output):
    """PyTorch's CPU flash attention on the 16-bit values in FP32, its backward fed the saved output
    either rounded to the 16-bit format (what a GPU's flash attention keeps) or exact."""
    wide = [t.detach().float() for t in (q, k, v)]
    out, logsumexp = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(*wide, 0.0, is_causal)[:2]
    saved = out.to(q.dtype).float() if rounded_output else out
    grads = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad.float(), *wide, saved, logsumexp, 0.0, is_causal
    )
    return out.to(q.dtype), [g.to(q.dtype) for g in grads]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("is_causal", [False, True])
def test_attention_keeps_its_own_output_at_16_bits_as_a_gpus_flash_attention_does(dtype, is_causal):
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 7, 16, dtype=dtype, requires_grad=True) for _ in range(3))
    grad = torch.randn(2, 3, 7, 16, dtype=dtype)
    with EmulatedAutocast(dtype):
        out = F.scaled_dot_product_attention(q, k, v, is_causal=is_causal)
    out.backward(grad)
    expected, expected_grads = _flash_reference(q, k, v, grad, is_causal, rounded_output=True)
    assert out.dtype == dtype and torch.equal(out, expected)
    for name, tensor, want in zip("qkv", (q, k, v), expected_grads, strict=True):
        assert torch.equal(tensor.grad, want), name
    _, exact_output_grads = _flash_reference(q, k, v, grad, is_causal, rounded_output=False)
    assert not torch.equal(q.grad, exact_output_grads[0])  # the rounding is seen: the test can tell them apart


def test_attention_saves_16_bit_inputs_and_output_and_only_its_logsumexp_in_fp32():
    q, k, v = (torch.randn(2, 3, 7, 16, requires_grad=True) for _ in range(3))
    model = nn.Linear(1, 1)  # no parameters in the attention itself
    with EmulatedAutocast(torch.bfloat16):
        saved = saved_activation_bytes(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), model)
    inputs_and_output, logsumexp = 4 * q.numel() * 2, 2 * 3 * 7 * 4
    assert saved == inputs_and_output + logsumexp


@pytest.mark.parametrize("rnn", [nn.GRU, nn.LSTM, nn.RNN])
@pytest.mark.parametrize("spec", ["base=mixed_fp16,kernels=emulated", "base=mixed_bf16,kernels=emulated"])
def test_recurrent_layers_after_a_16_bit_layer_compute_in_the_emulated_format(rnn, spec):
    # the Linear's 16-bit output met the RNN's FP32 weights in torch's own dtype check, which only autocast
    # waives: "RNN input dtype (torch.float16) does not match weight dtype (torch.float32)"
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), rnn(16, 16, batch_first=True))
    x, seen = torch.randn(2, 5, 16), {}
    model[1].register_forward_hook(lambda module, inputs, output: seen.update(out=output[0]))
    reference = model(x)[0]
    mp = mixprec.MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), spec)
    with mp.autocast():
        output, _ = model(x)
    mp.backward(output.float().square().mean())
    assert mp.step()
    low = mixprec.get_policy(spec).compute_dtype
    assert seen["out"].dtype == low  # the recurrent op itself in 16 bits, as CUDA autocast runs it
    torch.testing.assert_close(output.float(), reference, rtol=0, atol=0.05)
