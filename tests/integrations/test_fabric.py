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


@pytest.mark.parametrize("policy", ["o2_bf16", "o2_fp16"])
def test_fabric_clip_gradients_after_mp_unscale_clips_the_fp32_masters(policy):
    # fabric.clip_gradients clips the optimizer's parameters, under o2 the FP32 masters, which get their
    # gradients at the unscale: called before mp.unscale_() it finds none and clips nothing (docs/integrations.md)
    import lightning as L
    import torch

    import mixprec

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    mp = mixprec.MixedPrecision(model, optimizer, policy)
    fabric = L.Fabric(accelerator="cpu", devices=1, precision="32-true")
    fabric_model, fabric_optimizer = fabric.setup(model, optimizer)
    masters = [p for group in optimizer.param_groups for p in group["params"]]
    before = [p.detach().clone() for p in masters]
    with mp.autocast():
        loss = fabric_model(torch.randn(16, 8)).float().square().mean()
    mp.backward(loss)
    mp.unscale_()
    norm = fabric.clip_gradients(fabric_model, fabric_optimizer, max_norm=1e-3)
    assert float(norm) > 1e-3  # the true norm, measured on the masters' FP32 gradients
    mp.step()
    update = torch.cat([(p.detach() - b).flatten() for p, b in zip(masters, before, strict=True)]).norm()
    assert update.item() == pytest.approx(1e-3, rel=1e-3)  # SGD at lr 1: the clipped gradient itself
