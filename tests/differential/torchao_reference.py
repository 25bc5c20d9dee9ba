"""torchao as a reference for the differential tests: the dev extra's release, 0.18, imported quietly (it warns of
its CUDA kernels' library on a CPU build); a test module that calls :func:`torchao_modules` is skipped without it
or on another release, whose float8 and MX APIs move."""

from __future__ import annotations

import contextlib
import importlib
import warnings
from collections.abc import Iterator
from types import ModuleType

import pytest

RELEASE = "0.18."


@contextlib.contextmanager
def quietly() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def torchao_modules(*names: str) -> list[ModuleType]:
    """The modules ``names`` of torchao 0.18; the calling test module skipped where it is missing or another."""
    with quietly():
        torchao = pytest.importorskip("torchao")
        if not torchao.__version__.startswith(RELEASE):
            pytest.skip(f"written against torchao {RELEASE}x; this is {torchao.__version__}", allow_module_level=True)
        return [importlib.import_module(name) for name in names]
