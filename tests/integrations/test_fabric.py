"""mixprec inside a Lightning Fabric loop: the example skips the injected overflow, and a Fabric
precision that casts the model after MixedPrecision prepared it is refused with the fix."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("lightning")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "fabric_example.py"


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(EXAMPLE), *args], capture_output=True, text=True, timeout=180)


def test_the_example_skips_the_injected_overflow():
    done = _run("--policy", "mixed_fp16")
    assert done.returncode == 0, done.stderr[-3000:]
    assert re.search(r"8 steps, 1 skipped, scale 32768, loss \d", done.stdout), done.stdout  # halved once


def test_fabric_casting_the_model_is_refused_with_the_fix():
    done = _run("--fabric-precision", "bf16-true")
    assert done.returncode != 0
    assert "something cast the model after MixedPrecision prepared it" in done.stderr
    assert "precision='32-true'" in done.stderr
