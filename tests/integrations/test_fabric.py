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
    import lightning as L
    import torch

    import mixprec

    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    optimizer = torch.optim.AdamW(model.parameters())
    mp = mixprec.MixedPrecision(model, optimizer, "mixed_bf16")
    fabric_model, _ = L.Fabric(accelerator="cpu", devices=1, precision="bf16-true").setup(model, optimizer)
    refused = r"something cast the model after MixedPrecision.*precision='32-true'"
    with pytest.raises(ValueError, match=refused), mp.autocast():
        fabric_model(torch.randn(2, 4))
    assert model[0].weight.dtype == torch.bfloat16  # Fabric's cast, refused before any update
