"""How a policy maps onto FSDP2's MixedPrecisionPolicy (no process group needed)."""

import pytest
import torch
from torch import nn

import mixprec
from mixprec.parallel import fsdp_policy


@pytest.mark.parametrize(
    ("policy", "gathered"),
    [
        ("fp32", None),  # FP32 shards all-gathered as they are
        ("mixed_bf16", None),  # FP32 weights; the policy's autocast computes in bf16
        ("mixed_fp16", None),
        ("o2_bf16", torch.bfloat16),  # FP32 shards (the masters) all-gathered in bf16
        ("o2_fp16", torch.float16),
        ("pure_bf16", None),  # the shards are bf16 already
    ],
)
def test_the_gather_dtype_follows_where_the_policy_keeps_fp32_masters(policy, gathered):
    mapped = fsdp_policy(mixprec.get_policy(policy))
    assert mapped.param_dtype == gathered
    assert mapped.reduce_dtype is None  # gradients reduced in their own dtype unless asked
    assert mapped.output_dtype is None and not mapped.cast_forward_inputs  # outputs: the policy's autocast
    assert fsdp_policy(mixprec.get_policy(policy), torch.float32).reduce_dtype == torch.float32


def test_fully_shard_names_bad_arguments_before_touching_the_process_group():
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))  # o2 keeps the norm FP32: its own unit
    with pytest.raises(TypeError, match=r"units=\.\.\.\) takes a list of name globs; received the string"):
        mixprec.fully_shard(model, "o2_bf16", units="0")
    with pytest.raises(ValueError, match="has no parameters to shard"):
        mixprec.fully_shard(nn.ReLU(), "o2_bf16")
    with pytest.raises(TypeError, match=r"needs an nn\.Module; received str"):
        mixprec.fully_shard("model", "o2_bf16")
