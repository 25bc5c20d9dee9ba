"""benchmarks/integration_step.py runs (a tiny model, one round): the integrations' cost cannot rot unseen."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("lightning")
pytest.importorskip("transformers")

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "integration_step.py"


def test_the_integration_benchmark_times_every_pair(tmp_path):
    command = [sys.executable, str(SCRIPT), "--tiny", "--rounds", "1", "--steps", "4", "--out", str(tmp_path)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "integration_step.json").read_text())
    pairs = {(r["framework"], r["framework_mode"], r["mixprec_mode"]) for r in result["records"]}
    assert pairs == {
        ("lightning", "32-true", "mixprec fp32"),
        ("lightning", "bf16-mixed", "mixprec mixed_bf16"),
        ("hf", "fp32", "mixprec fp32"),
        ("hf", "bf16=True", "mixprec mixed_bf16"),
    }
    for record in result["records"]:
        assert record["framework_ms"] > 0 and record["mixprec_ms"] > 0 and record["ratio"] > 0
    assert result["size"]["width"] == 32 and result["machine"]
