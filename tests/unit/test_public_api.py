"""docs/api.md lists the whole public API, and every listed name exists."""

import importlib
import re
from pathlib import Path

import pytest

API_DOC = Path(__file__).resolve().parents[2] / "docs" / "api.md"
# The library's public packages; the application and the adapters are built on them (tests/unit/test_layers.py).
LIBRARY = [
    "mixprec",
    "mixprec.numerics",
    "mixprec.compute",
    "mixprec.policy",
    "mixprec.scaling",
    "mixprec.master",
    "mixprec.distributed",
    "mixprec.regions",
    "mixprec.regions.fp8",
    "mixprec.parallel",
    "mixprec.persist",
    "mixprec.engine",
    "mixprec.doctor",
]
PACKAGES = [*LIBRARY, "mixprec.app", "mixprec.integrations.gated_scheduler"]
# Adapters, each checked where its framework is installed (importing one imports the framework).
ADAPTERS = {
    "mixprec.integrations.lightning": "lightning",
    "mixprec.integrations.transformers": "transformers",
    "mixprec.integrations.fastai": "fastai",
}


@pytest.mark.parametrize("package", PACKAGES + list(ADAPTERS))
def test_every_public_name_is_documented_and_exists(package):
    if package in ADAPTERS:
        pytest.importorskip(ADAPTERS[package])
    module = importlib.import_module(package)
    documented = set(re.findall(r"`([A-Za-z_][A-Za-z0-9_]*)`", API_DOC.read_text()))
    missing = [name for name in module.__all__ if name not in documented]
    assert not missing, f"add these names of {package} to docs/api.md: {missing}"
    for name in module.__all__:
        assert getattr(module, name) is not None
    assert f"`{package}`" in API_DOC.read_text(), f"docs/api.md has no section or row for {package}"
