"""What a 16-bit export keeps in FP32: what the run's policy kept, and the norms of FP32-parameter runs."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mixprec import cast_module, get_policy
from mixprec.policy import export_policy


def _dtypes(policy):
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 2))
    return [p.dtype for p in cast_module(model, policy).parameters()]


@pytest.mark.parametrize("trained", ["fp32", "mixed_bf16", "mixed_fp16", "o2_bf16", "o2_fp16"])
def test_an_export_keeps_the_norms_in_fp32(trained):
    policy = export_policy(get_policy(trained), "fp16")
    assert (policy.param_dtype, policy.compute_dtype, policy.output_dtype) == (
        torch.float16,
        torch.float16,
        torch.float32,
    )
    f16, f32 = torch.float16, torch.float32
    assert _dtypes(policy) == [f16, f16, f32, f32, f16, f16]


def test_an_export_keeps_what_the_policy_keeps_and_nothing_more():
    kept_last = get_policy("o2_bf16").replace(fp32_names=("2",), fp32_ops=("softmax",))
    policy = export_policy(kept_last, "bf16")
    assert policy.fp32_names == ("2",) and policy.fp32_ops == ("softmax",)
    b16, f32 = torch.bfloat16, torch.float32
    assert _dtypes(policy) == [b16, b16, f32, f32, f32, f32]
    assert _dtypes(export_policy(get_policy("pure_bf16"), "bf16")) == [b16] * 6  # pure_bf16 kept nothing


def test_an_unknown_export_dtype_is_refused_by_name():
    with pytest.raises(ValueError, match=r"export dtype: received 'fp8'; use one of fp16, bf16"):
        export_policy(get_policy("fp32"), "fp8")
