import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mixprec.app.bench import suites
from mixprec.app.bench.timing import interleaved

MIXPREC = str(Path(sys.executable).with_name("mixprec"))


def test_interleaved_timing_orders_modes_by_cost():
    calls = []

    def fast():
        calls.append("fast")

    def slow():
        calls.append("slow")
        time.sleep(0.01)

    timings = interleaved({"fast": fast, "slow": slow}, repeats=3, warmup=1)
    assert calls == ["fast", "slow"] + ["fast", "slow"] * 3  # warm-up, then interleaved rounds
    assert timings["slow"].median_ms >= 10 > timings["fast"].median_ms
    assert timings["slow"].repeats == 3 and timings["slow"].spread_ms >= 0


def test_gemm_suite_ratios():
    records = suites.gemm_suite(sizes=(64,), repeats=2)
    dtypes = [r["dtype"] for r in records]
    assert dtypes == ["fp32", "bf16", "fp16 (torch)", "fp16 (emulated)"]
    fp32 = records[0]
    assert fp32["vs_fp32"] == 1.0 and fp32["gflops"] > 0
    assert max(r["of_best_measured"] for r in records) == 1.0


def test_step_and_memory_suites_on_the_cnn():
    step = suites.step_suite(["cnn"], ["fp32", "mixed_bf16", "pure_bf16"], repeats=1)
    modes = {r["mode"]: r for r in step}
    limit = "torch bf16 + fp32 masters"  # the hand-written loop o2/pure_bf16 are held to
    assert set(modes) == {"torch fp32", "torch autocast bf16", limit, "fp32", "mixed_bf16", "pure_bf16"}
    assert modes["torch fp32"]["vs_fp32"] == 1.0 and modes["torch fp32"]["cpu_vs_fp32"] == 1.0
    assert modes["mixed_bf16"]["overhead_vs_torch"] > 0 and modes["pure_bf16"]["cpu_vs_torch"] > 0
    assert modes[limit]["overhead_vs_torch"] is None and modes[limit]["cpu_ms"] > 0
    memory = {r["policy"]: r for r in suites.memory_suite(["cnn"], ["mixed_bf16", "pure_bf16"], rss=False)}
    assert memory["fp32"]["activations_vs_fp32"] == 1.0
    assert memory["mixed_bf16"]["activations_vs_fp32"] < 0.7
    assert memory["pure_bf16"]["state_bytes_per_param"] == pytest.approx(10.0, abs=0.01)


def test_bench_cli_writes_json_with_the_machine(tmp_path):
    result = subprocess.run(
        [MIXPREC, "bench", "--suite", "gemm", "--quick", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    data = json.loads((tmp_path / "bench_gemm.json").read_text())
    assert data["quick"] is True and data["machine"]["torch"].startswith("2.") and data["machine"]["isa"]
    assert result.stdout.startswith(f"{data['machine']['cpu']}, ") and "ISA: " in result.stdout.splitlines()[0]
    assert {r["dtype"] for r in data["records"]} >= {"fp32", "bf16"}
    bad = subprocess.run([MIXPREC, "bench", "--suite", "speed"], capture_output=True, text=True, check=False)
    assert bad.returncode == 2 and "--suite: received 'speed'; choose from step, memory, accuracy, gemm" in bad.stderr
