"""mixprec serve-bench on a tiny run: every mode measured, sizes halved in 16 bits, bad arguments one line."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# the installed script where there is one; else the module (the GPU machine runs mixprec from src/, uninstalled)
SCRIPT = Path(sys.executable).with_name("mixprec")
MIXPREC = [str(SCRIPT)] if SCRIPT.exists() else [sys.executable, "-m", "mixprec"]
REPO = Path(__file__).resolve().parents[2]
MODES = ["mixprec fp32", "mixprec bf16", "mixprec fp16", "plain fp32", "plain bf16"]


def run(*args):  # the installed script: for the module's shared run, which no test's capture can hold
    command = [*MIXPREC, *map(str, args)]
    return subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=REPO, check=False)


@pytest.fixture(scope="module")
def digits_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("serve") / "run"
    done = run("train", "digits", "--size", "tiny", "--policy", "mixed_bf16", "--quiet", "--out", out)
    assert done.returncode == 0, done.stderr[-2000:]
    return out


def test_serve_bench_measures_every_mode_side_by_side(digits_run, mixprec_cli):
    run = mixprec_cli
    done = run("serve-bench", digits_run, "--batches", "1,4", "--repeats", "1", "--latency-samples", "2")
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [line.split("  ")[0] for line in done.stdout.splitlines()]
    assert [mode for mode in MODES if mode in rows] == MODES
    results = {r["mode"]: r for r in json.loads((digits_run / "serve_bench.json").read_text())["results"]}
    fp32 = results["mixprec fp32"]
    for mode in ("mixprec bf16", "mixprec fp16", "plain bf16"):  # 16-bit weights: half the bytes (+ header)
        assert abs(results[mode]["size_bytes"] / fp32["size_bytes"] - 0.5) < 0.05, mode
    for result in results.values():
        assert result["latency_p50_ms"] > 0 and result["latency_p95_ms"] >= result["latency_p50_ms"]
        assert result["throughput"]["4"] > 0
        # the same trained weights: every precision classifies the evaluation split about as well
        assert abs(result["evaluation"]["accuracy"] - fp32["evaluation"]["accuracy"]) < 0.05


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--batches", "0,8"], "--batches: received '0,8'"),
        (["--batches", "x"], "--batches: received 'x'"),
        (["--repeats", "0"], "--repeats: received 0"),
    ],
)
def test_serve_bench_refuses_bad_arguments_in_one_line(digits_run, args, said, mixprec_cli):
    run = mixprec_cli
    done = run("serve-bench", digits_run, *args)
    assert done.returncode == 2 and said in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr


def test_serve_bench_measures_a_model_with_tied_weights(tmp_path, mixprec_cli):
    run = mixprec_cli
    # charlm's embedding is its output head: one tensor under two names, stored (and counted) once
    out = tmp_path / "charlm"
    done = run("train", "charlm", "--size", "tiny", "--steps", "4", "--quiet", "--out", out)
    assert done.returncode == 0, done.stderr[-2000:]
    done = run("serve-bench", out, "--batches", "1,2", "--seq", "16", "--repeats", "1", "--latency-samples", "2")
    assert done.returncode == 0, done.stderr[-2000:]
    results = {r["mode"]: r for r in json.loads((out / "serve_bench.json").read_text())["results"]}
    assert list(results) == MODES
    assert abs(results["mixprec bf16"]["size_bytes"] / results["mixprec fp32"]["size_bytes"] - 0.5) < 0.05
    assert json.loads((out / "serve_bench.json").read_text())["seq"] == 16


def test_serve_bench_times_token_models_at_a_length_they_take(tmp_path, mixprec_cli):
    # the tiny charlm's context is 32 tokens: the former default --seq 128 ended in an IndexError traceback
    out = tmp_path / "charlm"
    done = mixprec_cli("train", "charlm", "--size", "tiny", "--steps", "2", "--quiet", "--out", out)
    assert done.returncode == 0, done.stderr[-2000:]
    done = mixprec_cli("serve-bench", out, "--batches", "1,2", "--repeats", "1", "--latency-samples", "1")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "latency of one sequence of 32 tokens" in done.stdout
    assert json.loads((out / "serve_bench.json").read_text())["seq"] == 32
    done = mixprec_cli("serve-bench", out, "--seq", "33", "--batches", "1")
    assert done.returncode == 2 and "--seq: received 33" in done.stderr and "--seq 32 or less" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr, done.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_cuda_graphs_are_refused_without_cuda_in_one_line(digits_run, mixprec_cli):
    done = mixprec_cli("serve-bench", digits_run, "--cuda-graphs")
    assert done.returncode == 2, done.stderr
    assert "--cuda-graphs: CUDA graphs need a CUDA device" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_graphs_time_each_mixprec_mode_beside_its_eager_twin(digits_run, mixprec_cli):
    done = mixprec_cli("serve-bench", digits_run, "--batches", "1,4", "--repeats", "1", "--cuda-graphs")
    assert done.returncode == 0, done.stderr[-2000:]
    results = {r["mode"]: r for r in json.loads((digits_run / "serve_bench.json").read_text())["results"]}
    for name in ("fp32", "bf16", "fp16"):
        graphed, eager = results[f"mixprec {name}, CUDA graph"], results[f"mixprec {name}"]
        assert graphed["latency_p50_ms"] > 0 and graphed["throughput"]["4"] > 0
        assert graphed["evaluation"] == eager["evaluation"] and graphed["size_bytes"] == eager["size_bytes"]
