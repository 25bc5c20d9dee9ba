"""mixprec doctor, its advice file, and tracing non-finite values in mixprec train."""

import json

import pytest


def test_doctor_reports_advises_and_applies(tmp_path, mixprec_cli):
    run = mixprec_cli
    advice = tmp_path / "advice.json"
    result = run("doctor", "digits", "--size", "tiny", "--steps", "3", "--batch-size", "32", "--out", tmp_path / "doc",
                 "--apply", advice)  # fmt: skip
    assert result.returncode == 0, result.stderr
    # the command it suggests trains what was diagnosed: the scale found at a batch size is the scale for it
    assert f"train with mixprec train digits --size tiny --batch-size 32 --policy {advice}" in result.stdout
    lines = result.stdout.splitlines()
    assert lines[0].split()[:2] == ["format", "grads"]
    assert [line.split()[0] for line in lines[2:6]] == ["fp16", "bf16", "fp8_e4m3", "fp8_e5m2"]
    assert any(line.startswith("recommended: ") for line in lines)
    report = json.loads((tmp_path / "doc" / "report.json").read_text())
    assert set(report["formats"]) == {"fp16", "bf16", "fp8_e4m3", "fp8_e5m2"}
    assert report["report"]["steps"] == 3
    assert (tmp_path / "doc" / "histograms.png").read_bytes()[:4] == b"\x89PNG"
    written = json.loads(advice.read_text())
    assert written["source"] == "mixprec doctor digits --steps 3 --size tiny --batch-size 32"
    assert written["policy"] == report["policy"] and written["loss_scale"] == report["loss_scale"]

    trained = run("train", "digits", "--size", "tiny", "--steps", "3", "--policy", advice, "--out", tmp_path / "run")
    assert trained.returncode == 0, trained.stderr
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["policy"] == written["policy"] and config["loss_scale"] == written["loss_scale"]


def test_train_traces_the_first_non_finite_value(tmp_path, mixprec_cli):
    run = mixprec_cli
    # a loss scale of 2**120 overflows fp16 gradients on every step until it backs off
    result = run(
        "train", "digits", "--size", "tiny", "--steps", "3", "--policy", "mixed_fp16", "--loss-scale", 2.0**120,
        "--trace-nonfinite", "--quiet", "--out", tmp_path / "run",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    line = next(line for line in result.stdout.splitlines() if line.startswith("non-finite"))
    assert "first: first non-finite value at step 1: inf in" in line and "(backward," in line


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["doctor"], "name a task"),
        (["doctor", "digits", "--steps", "0"], "--steps: received 0"),
        (["train", "digits", "--policy", "missing.json"], "--policy missing.json: not a readable policy file"),
        (["train", "digits", "--loss-scale", "-1"], "argument --loss-scale: received -1"),
    ],
)
def test_bad_input_is_one_line(args, message, mixprec_cli):
    run = mixprec_cli
    result = run(*args)
    assert result.returncode == 2
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_doctor_on_a_model_that_makes_nan_in_fp32_writes_no_policy(tmp_path, mixprec_cli):
    (tmp_path / "nanmodel.py").write_text(
        "import torch\n"
        "from mixprec.app import TaskParts\n"
        "def build(config):\n"
        "    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 2))\n"
        "    with torch.no_grad():\n"
        "        model[0].weight.mul_(1e38)\n"
        "    batches = [(torch.randn(16, 4), torch.zeros(16, dtype=torch.int64)) for _ in range(2)]\n"
        "    return TaskParts(model=model, train_data=batches, eval_data=batches,\n"
        "                     loss_fn=torch.nn.functional.cross_entropy)\n"
    )
    advice = tmp_path / "advice.json"
    args = ("doctor", "--model", "nanmodel:build", "--steps", "2", "--out", tmp_path / "doc", "--apply", advice)
    result = mixprec_cli(*args, cwd=tmp_path)
    assert result.returncode == 1
    assert "makes inf or NaN in FP32; no policy written" in result.stderr
    assert "inf or NaN already in FP32" in result.stdout and not advice.exists()
    assert json.loads((tmp_path / "doc" / "report.json").read_text())["fp32_nonfinite"][0] == "1"  # the LayerNorm


def test_doctor_measures_each_fp8_recipe_per_gemm_layer(tmp_path, mixprec_cli):
    out = tmp_path / "doc"
    result = mixprec_cli("doctor", "charlm", "--size", "tiny", "--steps", "2", "--fp8-recipes", "--out", out)
    assert result.returncode == 0, result.stderr
    assert "FP8 recipes: each GEMM layer's output error against bf16" in result.stdout
    assert "lowest median error: " in result.stdout
    written = json.loads((out / "fp8_recipes.json").read_text())
    layers = {fit["layer"] for fit in written["fits"]}
    assert "lm_head" in layers and len(layers) == 5  # TinyGPT tiny: 4 projections and the head
    assert {fit["recipe"] for fit in written["fits"]} == {
        "tensorwise", "rowwise", "blockwise", "mxfp8_e4m3", "mxfp8_e5m2", "mxfp4", "nvfp4",
    }  # fmt: skip
    assert all(0 < fit["error"] < 0.5 for fit in written["fits"])
