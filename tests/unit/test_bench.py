import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from mixprec.app.bench import suites
from mixprec.app.bench.timing import SLOW_FACTOR, SLOW_REPEATS, interleaved
from mixprec.app.cli.bench_cmd import step_rows

MIXPREC = str(Path(sys.executable).with_name("mixprec"))


def test_interleaved_timing_orders_modes_by_cost():
    calls = []

    def fast():
        calls.append("fast")

    def slow():
        calls.append("slow")
        time.sleep(0.01)

    timings = interleaved({"fast": fast, "slow": slow}, repeats=3, warmup=1)
    warmup, rounds = ["fast", "slow"], ["fast", "slow", "slow", "fast", "fast", "slow"]
    assert calls == [*warmup, *rounds]  # each round starts one mode later: each mode follows every other alike
    assert timings["slow"].median_ms >= 10 > timings["fast"].median_ms
    assert timings["slow"].repeats == 3 and timings["slow"].spread_ms >= 0


def test_a_mode_ten_times_slower_than_the_fastest_stops_after_three_rounds():
    calls = []

    def fast():
        calls.append("fast")
        time.sleep(0.001)

    def twice():
        calls.append("twice")
        time.sleep(0.002)

    def crawling():
        calls.append("crawling")
        time.sleep(0.05)

    timings = interleaved({"fast": fast, "twice": twice, "crawling": crawling}, repeats=6, warmup=0)
    assert SLOW_REPEATS == 3 and SLOW_FACTOR == 10
    rounds = [["fast", "twice", "crawling"], ["twice", "crawling", "fast"], ["crawling", "fast", "twice"]]
    rounds += [["twice", "fast"], ["fast", "twice"], ["twice", "fast"]]  # rounds 3-5 without the slow mode
    assert calls == [name for round_ in rounds for name in round_]
    assert {name: t.repeats for name, t in timings.items()} == {"fast": 6, "twice": 6, "crawling": 3}
    assert timings["crawling"].median_ms >= 50


_RESIDENT_AFTER_A_FREE = """
import os, sys, torch
from mixprec.app.bench.timing import keep_freed_memory
applied = keep_freed_memory() if sys.argv[1] == "keep" else None
def resident():
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
block = torch.ones(6 * 2**20)  # 24 MB, touched
held = resident()
del block  # a step's gradients, freed
print(applied, (held - resident()) // 2**20)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator, /proc")
def test_the_timing_keeps_the_memory_a_step_frees_in_the_process():
    def returned_mb(mode: str) -> tuple[str, int]:
        run = subprocess.run([sys.executable, "-c", _RESIDENT_AFTER_A_FREE, mode], capture_output=True, text=True)
        assert run.returncode == 0, run.stderr
        applied, megabytes = run.stdout.split()
        return applied, int(megabytes)

    applied, kept = returned_mb("keep")
    _, default = returned_mb("default")
    assert default >= 20  # glibc's default: the 24 MB went back to the system, to be faulted in again
    assert applied == "True" and kept < 4


def test_the_step_table_says_how_many_runs_a_cut_mode_got():
    records = [
        {"model": "gpt", "mode": m, "median_ms": ms, "spread_ms": 1.0, "repeats": n, "vs_fp32": 1.0,
         "overhead_vs_torch": None}
        for m, ms, n in [("torch fp32", 10.0, 7), ("torch autocast bf16", 250.0, 3)]
    ]  # fmt: skip
    headers, rows = step_rows(records)
    spread = headers.index("spread")
    assert [row[spread] for row in rows] == ["1.0", "1.0 (3 runs)"]


def test_gemm_suite_ratios():
    records = suites.gemm_suite(sizes=(64,), repeats=2)
    dtypes = [r["dtype"] for r in records]
    assert dtypes == ["fp32", "bf16", "fp16 (torch)", "fp16 (emulated)"]
    fp32 = records[0]
    assert fp32["vs_fp32"] == 1.0 and fp32["gflops"] > 0
    assert max(r["of_best_measured"] for r in records) == 1.0


def _small_cnn() -> suites.BenchModel:
    """The bench's CNN at a quarter of its width and an eighth of its batch (PyTorch's own bf16 loops, which
    the suite times, run 20x slower than FP32 on CPUs without bf16 units)."""
    from mixprec.app.tasks.digits import DigitsCNN

    return suites.BenchModel(
        lambda: DigitsCNN(width=16), lambda: (torch.randn(32, 1, 8, 8), torch.randint(0, 10, (32,))), F.cross_entropy
    )


def test_step_and_memory_suites_on_the_cnn():
    step = suites.step_suite(["cnn"], ["fp32", "mixed_bf16", "pure_bf16"], repeats=1, builders={"cnn": _small_cnn})
    modes = {r["mode"]: r for r in step}
    limit = "torch bf16 + fp32 masters"  # the hand-written loop o2/pure_bf16 are held to
    assert set(modes) == {"torch fp32", "torch autocast bf16", limit, "fp32", "mixed_bf16", "pure_bf16"}
    assert modes["torch fp32"]["vs_fp32"] == 1.0 and modes["torch fp32"]["cpu_vs_fp32"] == 1.0
    assert modes["mixed_bf16"]["overhead_vs_torch"] > 0 and modes["pure_bf16"]["cpu_vs_torch"] > 0
    assert modes[limit]["overhead_vs_torch"] is None and modes[limit]["cpu_ms"] > 0
    memory = suites.memory_suite(["cnn"], ["mixed_bf16", "pure_bf16"], rss=False, builders={"cnn": _small_cnn})
    memory = {r["policy"]: r for r in memory}
    assert memory["fp32"]["activations_vs_fp32"] == 1.0
    assert memory["mixed_bf16"]["activations_vs_fp32"] < 0.7
    assert memory["pure_bf16"]["state_bytes_per_param"] == pytest.approx(12.0, abs=0.01)


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


def test_a_quick_run_writes_beside_the_full_results_not_over_them(tmp_path):
    # the default --out is benchmarks/results, where the full run's figures are kept
    result = subprocess.run(
        [MIXPREC, "bench", "--suite", "gemm", "--quick"], capture_output=True, text=True, timeout=300, check=False,
        cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert json.loads((tmp_path / "benchmarks/results/quick/bench_gemm.json").read_text())["quick"] is True
    assert not (tmp_path / "benchmarks/results/bench_gemm.json").exists()
