"""A pytest plugin that keeps only the test suite's CUDA cases (``pytest -p benchmarks.gpu.pytest_cuda``).

``-k cuda`` alone misses cases parametrized with a ``torch.device("cuda")`` object, whose ids pytest
writes as ``device1``; this looks at the parameters' values too. A case is a CUDA case when it is marked
``cuda``, its id names cuda (the ``device`` fixture's ``[cuda]``), or a parameter is a CUDA device.
"""

from __future__ import annotations

import torch

__all__ = ["is_cuda_case"]


def _is_cuda_value(value: object) -> bool:
    if isinstance(value, torch.device):
        return value.type == "cuda"
    return isinstance(value, str) and value.split(":")[0] == "cuda"


def is_cuda_case(item) -> bool:
    if item.get_closest_marker("cuda") is not None or "cuda" in item.name.lower():
        return True
    params = getattr(getattr(item, "callspec", None), "params", {})
    return any(_is_cuda_value(value) for value in params.values())


def pytest_collection_modifyitems(config, items) -> None:
    keep = [item for item in items if is_cuda_case(item)]
    dropped = [item for item in items if not is_cuda_case(item)]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
    items[:] = keep
