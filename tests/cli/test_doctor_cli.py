"""mixprec doctor, its advice file, and tracing non-finite values in mixprec train."""

import json

import pytest


def test_doctor_reports_advises_and_applies(tmp_path, mixprec_cli):
    run = mixprec_cli
    advice = tmp_path / "advice.json"
    result = run("doctor", "digits", "--size", "tiny", "--steps", "3", "--out", tmp_path / "doc", "--apply", advice)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].split()[:2] == ["format", "grads"]
    assert [line.split()[0] for line in lines[2:6]] == ["fp16", "bf16", "fp8_e4m3", "fp8_e5m2"]
    assert any(line.startswith("recommended: ") for line in lines)
    report = json.loads((tmp_path / "doc" / "report.json").read_text())
    assert set(report["formats"]) == {"fp16", "bf16", "fp8_e4m3", "fp8_e5m2"}
    assert report["report"]["steps"] == 3
    assert (tmp_path / "doc" / "histograms.png").read_bytes()[:4] == b"\x89PNG"
    written = json.loads(advice.read_text())
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
        (["train", "digits", "--loss-scale", "-1"], "config 'loss_scale': received -1.0"),
    ],
)
def test_bad_input_is_one_line(args, message, mixprec_cli):
    run = mixprec_cli
    result = run(*args)
    assert result.returncode == 2
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1
