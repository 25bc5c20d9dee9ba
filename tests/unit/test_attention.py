"""Attention from bf16 GEMMs: the same function as PyTorch's, routed to under bf16 policies on CPUs."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec
from mixprec.compute.attention import gemm_attention


def _qkv(dtype, batch=(2, 3), length=16, source=16, dim=8, seed=0):
    generator = torch.Generator().manual_seed(seed)
    shapes = [(*batch, length, dim), (*batch, source, dim), (*batch, source, dim)]
    return [torch.randn(s, generator=generator, dtype=torch.float64).to(dtype).requires_grad_() for s in shapes]


CASES = {
    "plain": {},
    "causal": {"is_causal": True},
    "bool mask": {"attn_mask": torch.rand(16, 16, generator=torch.Generator().manual_seed(1)) > 0.3},
    "float mask": {"attn_mask": torch.randn(3, 16, 16, generator=torch.Generator().manual_seed(2))},
    # padded positions: queries that may see no key; torch's kernels give them 0 (a softmax of -inf rows: NaN)
    "bool mask, rows of none": {"attn_mask": torch.arange(16)[:, None].expand(16, 16) < 12},
    "float mask, rows of -inf": {
        "attn_mask": torch.zeros(3, 16, 16).masked_fill(torch.arange(16)[:, None] >= 12, float("-inf"))
    },
    "scale 0.3": {"scale": 0.3},
    "scale 0.25 causal": {"scale": 0.25, "is_causal": True},
}


@pytest.mark.parametrize("case", list(CASES))
def test_same_function_as_pytorch_in_fp64(case):
    kwargs = dict(CASES[case])
    if "attn_mask" in kwargs:
        kwargs["attn_mask"] = (
            kwargs["attn_mask"].double() if kwargs["attn_mask"].is_floating_point() else kwargs["attn_mask"]
        )
    ours, theirs = _qkv(torch.float64), _qkv(torch.float64)
    grad = torch.randn(2, 3, 16, 8, dtype=torch.float64)
    out = gemm_attention(*ours, **kwargs)
    ref = F.scaled_dot_product_attention(*theirs, **kwargs)
    out.backward(grad)
    ref.backward(grad)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-12)
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-9, atol=1e-11)


def test_bf16_error_stays_close_to_the_flash_kernels():
    reference = _qkv(torch.float64, batch=(4, 6), length=128, source=128, dim=64, seed=3)
    grad = torch.randn(4, 6, 128, 64, dtype=torch.float64)
    exact = F.scaled_dot_product_attention(*reference, is_causal=True)
    exact_grads = torch.autograd.grad(exact, reference, grad)

    def errors(fn):
        inputs = [t.detach().bfloat16().requires_grad_() for t in reference]
        out = fn(*inputs, is_causal=True)
        grads = torch.autograd.grad(out, inputs, grad.bfloat16())
        pairs = [(out, exact), *zip(grads, exact_grads, strict=True)]
        return [((a.double() - b).norm() / b.norm()).item() for a, b in pairs]

    ours, flash = errors(gemm_attention), errors(F.scaled_dot_product_attention)
    assert all(o < 2.5 * f for o, f in zip(ours, flash, strict=True)), (ours, flash)
    assert max(ours) < 0.03


class _Attend(nn.Module):
    def __init__(self, dropout=0.0):
        super().__init__()
        self.proj = nn.Linear(16, 48)
        self.dropout = dropout

    def forward(self, x):
        q, k, v = self.proj(x).view(x.shape[0], x.shape[1], 3, 2, 8).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout)


def test_bf16_policies_on_cpu_route_attention_to_the_gemm_path_where_it_measured_fastest(kernel_cache):
    kernel_cache(torch.bfloat16, attention="gemm")
    torch.manual_seed(0)
    model, x = _Attend(), torch.randn(2, 12, 16)
    with mixprec.autocast("mixed_bf16", model):
        routed = model(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        q, k, v = model.proj(x).view(2, 12, 3, 2, 8).permute(2, 0, 3, 1, 4)
    expected = gemm_attention(q, k, v, is_causal=True).float()
    assert torch.equal(routed, expected)
    # the policy's FP32 ops take precedence: PyTorch's kernel in FP32
    with mixprec.autocast("base=mixed_bf16,ops=scaled_dot_product_attention", model):
        fp32 = model(x)
    assert not torch.equal(fp32, routed)
    torch.testing.assert_close(fp32, routed, rtol=0.05, atol=0.05)


def test_inference_runs_pytorchs_kernel_the_probe_timed_training(kernel_cache):
    kernel_cache(torch.bfloat16, attention="gemm")
    torch.manual_seed(0)
    model, x = _Attend(), torch.randn(2, 12, 16)
    for no_autograd in (torch.no_grad, torch.inference_mode):
        with no_autograd(), mixprec.autocast("mixed_bf16", model):
            out = model(x)
        with no_autograd(), torch.autocast("cpu", dtype=torch.bfloat16):
            ref = model(x)
        assert torch.equal(out, ref.float())


def test_attention_runs_pytorchs_kernel_where_it_measured_fastest(kernel_cache):
    kernel_cache(torch.bfloat16, attention="native")
    torch.manual_seed(0)
    model, x = _Attend(), torch.randn(2, 12, 16)
    with mixprec.autocast("mixed_bf16", model):
        out = model(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = model(x)
    assert torch.equal(out, ref.float())


def test_dropout_falls_back_to_pytorch(kernel_cache):
    kernel_cache(torch.bfloat16, attention="gemm")
    torch.manual_seed(0)
    model, x = _Attend(dropout=0.5), torch.randn(2, 12, 16)
    with mixprec.autocast("mixed_bf16", model):
        torch.manual_seed(1)
        out = model(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        torch.manual_seed(1)
        ref = model(x)
    assert torch.equal(out, ref.float())


def test_the_causal_mask_is_built_once_and_survives_inference_mode():
    q = torch.randn(1, 2, 5, 8, dtype=torch.bfloat16)
    with torch.inference_mode():  # the first use of this shape: inside inference mode
        gemm_attention(q, q, q, is_causal=True)
    leaf = q.clone().requires_grad_()
    out = gemm_attention(leaf, leaf, leaf, is_causal=True)  # the cached mask is saved for backward
    out.float().sum().backward()
    assert leaf.grad is not None
    expected = F.scaled_dot_product_attention(leaf.double(), leaf.double(), leaf.double(), is_causal=True)
    torch.testing.assert_close(out.double(), expected, rtol=0.05, atol=0.05)


class _AttendLater(_Attend):
    """Calls attention from its second forward on: a forward that changes what it calls."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return self.proj(x)[..., :8] if self.calls == 1 else super().forward(x)


def test_a_model_whose_first_forward_calls_no_attention_is_not_watched_again(kernel_cache):
    # GEMM attention watches every torch call (a TorchFunctionMode, a few us each): 5% of a small model's step
    # on the CPU proxy (benchmarks/host_cost.py) when it has no attention at all
    kernel_cache(torch.bfloat16, attention="gemm")
    torch.manual_seed(0)
    model, x = _AttendLater(), torch.randn(2, 12, 16)
    mp = mixprec.MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), "mixed_bf16")
    for _ in range(2):
        with mp.autocast():
            out = model(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = _Attend.forward(model, x)  # PyTorch's kernel: the region no longer routes it
    assert torch.equal(out, expected.float())
    # a model that calls attention in its first forward keeps the GEMM path
    attends = _Attend()
    mp = mixprec.MixedPrecision(attends, torch.optim.SGD(attends.parameters(), lr=0.1), "mixed_bf16")
    for _ in range(2):
        with mp.autocast():
            routed = attends(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        q, k, v = attends.proj(x).view(2, 12, 3, 2, 8).permute(2, 0, 3, 1, 4)
    assert torch.equal(routed, gemm_attention(q, k, v, is_causal=True).float())
