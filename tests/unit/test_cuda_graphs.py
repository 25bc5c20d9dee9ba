"""Forwards replayed from CUDA graphs (serve-bench's --cuda-graphs): the eager forward's outputs, one graph per
input shape, refused in one line off CUDA."""

import pytest
import torch
from torch import nn

import mixprec
from mixprec.app.cuda_graphs import GraphedForward
from mixprec.regions import Region, cast_module


def _exported(device: str) -> tuple[nn.Module, Region]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.GELU(), nn.Linear(32, 4)).to(device).eval()
    policy = mixprec.get_policy("p=bf16,c=bf16,o=f32")  # what `mixprec export --dtype bf16` stores
    cast_module(model, policy)
    return model, Region(policy, model, torch.device(device))


def test_graphs_are_refused_off_cuda_naming_what_to_do():
    model, region = _exported("cpu")
    with pytest.raises(ValueError, match=r"CUDA graphs: CUDA graphs need a CUDA device; this model runs on cpu"):
        GraphedForward(model, region.enter)(torch.randn(2, 16))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_replayed_forward_returns_the_eager_forwards_outputs_for_each_shape():
    model, region = _exported("cuda")
    graphed = GraphedForward(model, region.enter)
    for batch in (1, 8, 1):  # the second batch-1 call replays the first graph with new inputs
        inputs = torch.randn(batch, 16, device="cuda")
        with torch.inference_mode(), region.enter():
            eager = model(inputs)
        replayed = graphed(inputs).clone()
        assert replayed.dtype == eager.dtype == torch.float32  # the region's output cast was captured too
        assert torch.equal(replayed, eager)
    assert len(graphed._graphs) == 2
