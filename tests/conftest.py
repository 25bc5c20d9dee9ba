import json
import os
import tempfile

import pytest
import torch

# The kernel probe's per-machine cache: one fresh folder per test session (CLI subprocesses inherit it),
# so the suite measures this machine once and never reads or writes the user's own cache.
os.environ["MIXPREC_CACHE_DIR"] = tempfile.mkdtemp(prefix="mixprec-test-cache-")

# Under pytest-xdist every worker, and every process a test starts, computes on one thread: workers times
# threads then match the cores scripts/test.sh runs on, instead of each worker's threads contending for all.
if "PYTEST_XDIST_WORKER" in os.environ:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(params=DEVICES)
def device(request) -> str:
    """Every device this machine has: CPU always, CUDA where present."""
    return request.param


@pytest.fixture
def kernel_cache(tmp_path, monkeypatch):
    """Seed the kernel probe's cache with given choices, as if this machine had measured them:
    ``kernel_cache(torch.bfloat16, attention="gemm")`` (families not named: native); one cache per test,
    each call adding its dtype's entry."""
    from mixprec.compute.kernels import CACHE_VERSION, FAMILIES, machine_key

    folder = tmp_path / "kernel-cache"
    folder.mkdir()
    monkeypatch.setenv("MIXPREC_CACHE_DIR", str(folder))
    entries = {}

    def seed(dtype: torch.dtype, timings_ms: dict | None = None, **choices: str) -> None:
        chosen = {family: choices.get(family, "native") for family in FAMILIES}
        entries[machine_key(dtype)] = {"choices": chosen, "timings_ms": timings_ms or {}}
        (folder / "kernels.json").write_text(json.dumps({"version": CACHE_VERSION, "entries": entries}))

    return seed


@pytest.fixture
def train_mlp():
    """``train_mlp(policy, steps, samples, classes)``: a seeded Linear(16, 64)-GELU-Linear(64, 16) trained by
    MixedPrecision and AdamW(lr=1e-2) on one fixed batch of ``samples`` with labels below ``classes``; returns
    the MixedPrecision and the loss at each step."""
    import mixprec

    def train(policy: str, steps: int, samples: int, classes: int):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 16))
        mp = mixprec.MixedPrecision(model, torch.optim.AdamW(model.parameters(), lr=1e-2), policy)
        gen = torch.Generator().manual_seed(0)
        x, y = torch.randn(samples, 16, generator=gen), torch.randint(0, classes, (samples,), generator=gen)
        losses = []
        for _ in range(steps):
            with mp.autocast():
                loss = torch.nn.functional.cross_entropy(model(x), y)
            mp.backward(loss)
            mp.step()
            losses.append(loss.item())
        return mp, losses

    return train
