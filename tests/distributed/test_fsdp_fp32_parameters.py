"""Two gloo processes: MixedPrecision's FP32-parameter check on FSDP2-sharded (DTensor) models. Shards are
judged as mixprec.fully_shard leaves them: FP32, except pure_bf16's bf16 ones (no master is made of them);
16-bit shards that would serve as FP32 masters (o2) or be trained as FP32 weights (mixed) are refused."""

import gc
import json

import pytest
import torch
import torch.distributed as dist
from torch import nn

import mixprec

CASES = {  # name -> (the model's dtype before sharding, policy, sharded by)
    "fp32 model, o2_bf16": (torch.float32, "o2_bf16", "mixprec"),
    "fp32 model, pure_bf16": (torch.float32, "pure_bf16", "mixprec"),
    "bf16 model, pure_bf16": (torch.bfloat16, "pure_bf16", "mixprec"),
    "bf16 model, o2_bf16": (torch.bfloat16, "o2_bf16", "mixprec"),
    "fp32 model, FSDP2 directly, mixed_bf16": (torch.float32, "mixed_bf16", "torch"),
    "bf16 model, FSDP2 directly, mixed_bf16": (torch.bfloat16, "mixed_bf16", "torch"),
}


def _net(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 16)) for _ in range(2))
    return nn.Sequential(nn.Linear(8, 16), blocks[0], blocks[1], nn.Linear(16, 3)).to(dtype)


def _outcome(dtype: torch.dtype, policy: str, sharded_by: str) -> str:
    model = _net(dtype)
    if sharded_by == "mixprec":
        mixprec.fully_shard(model, policy)
    else:
        torch.distributed.fsdp.fully_shard(model)
    optimizer = (mixprec.AdamW if policy == "pure_bf16" else torch.optim.SGD)(model.parameters(), lr=1e-2)
    try:
        mixprec.MixedPrecision(model, optimizer, policy)
    except ValueError as exc:
        return str(exc)
    return "accepted"


def _worker(rank: int, port: int, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        outcomes = {name: _outcome(*case) for name, case in CASES.items()}
        with open(f"{out}/rank{rank}.json", "w") as f:
            json.dump(outcomes, f)
        gc.collect()  # sharded models caught in a reference cycle go now, while the group is alive
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory, run_gloo_workers):
    out = tmp_path_factory.mktemp("fsdp-fp32")
    run_gloo_workers(_worker, out, seconds=120)
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0] == ranks[1]
    return ranks[0]


@pytest.mark.parametrize(
    "name",
    ["fp32 model, o2_bf16", "fp32 model, pure_bf16", "bf16 model, pure_bf16", "fp32 model, FSDP2 directly, mixed_bf16"],
)
def test_shards_in_the_policys_dtypes_are_accepted(outcomes, name):
    assert outcomes[name] == "accepted"


@pytest.mark.parametrize("name", ["bf16 model, o2_bf16", "bf16 model, FSDP2 directly, mixed_bf16"])
def test_16_bit_shards_meant_to_be_fp32_are_refused(outcomes, name):
    assert "MixedPrecision(model=...) needs a model with FP32 parameters" in outcomes[name]
    assert "received one where 12 parameters are torch.bfloat16, e.g. '0.weight'" in outcomes[name]
    assert "before any mixprec.fully_shard" in outcomes[name]
