"""The hf task: a transformers GPT-2 built offline, trained under mixprec's policies."""

from __future__ import annotations

import math
import socket
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

import mixprec  # noqa: E402
from mixprec.app.task import TaskConfig, TaskParts, bits_per_char, build_task  # noqa: E402

POLICIES = ["fp32", "mixed_bf16", "o2_bf16", "mixed_fp16"]


def tiny() -> TaskParts:
    return build_task("hf", TaskConfig(size="tiny"))


def test_builds_a_gpt2_on_bytes():
    parts = tiny()
    assert isinstance(parts.model, transformers.GPT2LMHeadModel)
    assert parts.model.config.vocab_size == 256
    assert parts.metric is bits_per_char
    assert parts.defaults["epochs"] == 1 and parts.defaults["lr"] == 1e-3
    assert "GPT2" in parts.description
    x, y = next(iter(parts.train_data))
    assert x.shape == y.shape == (8, 32) and x.dtype == y.dtype == torch.long
    assert int(x.max()) < 256 and torch.equal(x[:, 1:], y[:, :-1])
    assert len(parts.train_data) == 8 and len(list(parts.eval_data)) == 2


@pytest.mark.parametrize("policy", POLICIES)
def test_trains_under_policy(policy):
    parts = tiny()
    model = parts.model
    mp = mixprec.MixedPrecision(model, torch.optim.AdamW(model.parameters(), lr=1e-3), policy)

    def step(x: torch.Tensor, y: torch.Tensor) -> float:
        with mp.autocast():
            out = model(x)
            loss = parts.loss_fn(out, y)
        mp.backward(loss)
        mp.step()
        assert math.isfinite(loss.item())
        return loss.item()

    x, y = next(iter(parts.train_data))  # overfit one fixed batch
    losses = [step(x, y) for _ in range(15)]
    assert losses[-1] < losses[0] - 0.4, losses
    assert mp.stats().skipped_steps == 0


def test_outputs_stay_a_model_output_in_fp32():
    parts = tiny()
    model = parts.model
    mp = mixprec.MixedPrecision(model, torch.optim.AdamW(model.parameters()), "mixed_bf16")
    x, y = next(iter(parts.train_data))
    seen = []
    model.lm_head.register_forward_hook(lambda module, args, out: seen.append(out.dtype))
    with mp.autocast():
        out = model(x)
        assert isinstance(out, transformers.utils.ModelOutput)
        assert out.logits.dtype == out["logits"].dtype == torch.float32
        assert out.logits.shape == (8, 32, 256)
    assert seen == [torch.bfloat16]  # computed in bf16, handed back in FP32
    assert torch.isfinite(parts.loss_fn(out, y))


def test_o2_keeps_layernorm_fp32_and_lowers_projections():
    from transformers.pytorch_utils import Conv1D

    model = tiny().model
    mixprec.MixedPrecision(model, torch.optim.AdamW(model.parameters()), "o2_bf16")
    norms = [m for m in model.modules() if isinstance(m, torch.nn.LayerNorm)]
    projections = [m for m in model.modules() if isinstance(m, (Conv1D, torch.nn.Linear))]
    assert len(norms) == 3 and len(projections) == 5  # ln_1, ln_2, ln_f; c_attn, c_proj x2, c_fc, lm_head
    assert all(p.dtype == torch.float32 for m in norms for p in m.parameters())
    assert all(m.weight.dtype == torch.bfloat16 for m in projections)
    assert model.transformer.wte.weight.dtype == torch.bfloat16


def test_builds_offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")

    def no_network(*args, **kwargs):
        raise AssertionError("the hf task tried to open a network connection")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setattr(socket, "create_connection", no_network)
    parts = tiny()
    x, _ = next(iter(parts.train_data))
    assert parts.model(x).logits.shape == (8, 32, 256)


def test_without_transformers_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # makes `import transformers` raise ImportError
    with pytest.raises(ValueError, match=r"needs transformers: pip install 'mixprec\[hf\]'"):
        tiny()
