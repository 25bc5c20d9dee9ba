"""Counting the activations a forward pass saves for backward, without keeping anything alive."""

import gc
import weakref

import pytest
import torch
from torch import nn

import mixprec
from mixprec.engine.memory import saved_activation_bytes


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 32), nn.Tanh())  # tanh saves its own output: the case that made a cycle


def test_counts_inputs_and_saved_outputs_but_not_parameters():
    model, x = _model(), torch.randn(64, 32)
    # addmm saves x (the weight is a parameter), tanh its output: two 64 x 32 FP32 tensors
    assert saved_activation_bytes(lambda: model(x), model) == 2 * 64 * 32 * 4


def _measured(policy):
    """A weak reference to a parameter of a model measured under ``policy``, the model itself dropped."""
    model, x = _model(), torch.randn(64, 32)
    with mixprec.autocast(policy, model, device="cpu"):
        assert saved_activation_bytes(lambda: model(x), model) > 0
    return weakref.ref(model[0].weight)


@pytest.mark.parametrize("policy", ["fp32", "mixed_fp16"])  # mixed_fp16 on this CPU: the emulation's packing
def test_the_measured_model_and_its_graph_are_freed(policy):
    alive = _measured(policy)
    gc.collect()
    assert alive() is None  # a saved output holding its own grad_fn kept every measured model alive


def test_the_measured_graph_refuses_a_backward():
    model, x = _model(), torch.randn(4, 32)
    outputs = []
    saved_activation_bytes(lambda: outputs.append(model(x)), model)
    with pytest.raises(RuntimeError, match="measures a forward pass"):
        outputs[0].sum().backward()


def test_measuring_leaves_batch_norm_statistics_as_they_were():
    # a train-mode forward moved the running statistics after the run's final checkpoint
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8)).train()
    before = {name: b.clone() for name, b in model.named_buffers()}
    assert saved_activation_bytes(lambda: model(torch.randn(16, 4) * 5), model) > 0
    assert all(torch.equal(before[name], b) for name, b in model.named_buffers())
