"""Nested training state (dicts, lists, tuples, numbers, strings, tensors) as tensors + a JSON skeleton.

State dicts of models, optimizers, schedulers and MixedPrecision mix tensors with plain values and
use int keys and tuples. ``flatten`` splits such a nest into a flat ``{name: tensor}`` map (for
safetensors) and a JSON-able skeleton that records where each tensor goes, which containers were
tuples and which dict keys were ints. ``unflatten`` rebuilds the nest. Nothing is pickled, so loading
can never execute code; anything else (functions, arbitrary objects) is refused when saving.

Example:
    >>> tensors, skeleton = flatten({"step": 3, "betas": (0.9, 0.99), 0: torch.ones(2)})
    >>> sorted(tensors)
    ['t0']
    >>> unflatten(skeleton, tensors)[0]
    tensor([1., 1.])
"""

from __future__ import annotations

import math
from typing import Any

import torch

__all__ = ["flatten", "unflatten"]

_TENSOR, _TUPLE, _DICT, _FLOAT = "__tensor__", "__tuple__", "__dict__", "__float__"


def flatten(obj: Any, prefix: str = "t") -> tuple[dict[str, torch.Tensor], Any]:
    """Split ``obj`` into named tensors and a JSON skeleton; raises TypeError on unsupported values."""
    tensors: dict[str, torch.Tensor] = {}
    seen: dict[int, str] = {}  # shared tensors (tied weights) are stored once

    def walk(value: Any, path: str) -> Any:
        if isinstance(value, torch.Tensor):
            key = seen.get(id(value))
            if key is None:
                key = seen[id(value)] = f"{prefix}{len(tensors)}"
                tensors[key] = value.detach().contiguous().clone()  # own storage: safetensors refuses aliases
            return {_TENSOR: key}
        if isinstance(value, bool) or value is None or isinstance(value, (int, str)):
            return value
        if isinstance(value, float):
            return value if math.isfinite(value) else {_FLOAT: repr(value)}  # JSON has no inf/nan
        if isinstance(value, tuple):
            return {_TUPLE: [walk(v, f"{path}[{i}]") for i, v in enumerate(value)]}
        if isinstance(value, list):
            return [walk(v, f"{path}[{i}]") for i, v in enumerate(value)]
        if isinstance(value, dict):
            if all(isinstance(k, str) and not k.startswith("__") for k in value):
                return {k: walk(v, f"{path}.{k}") for k, v in value.items()}
            for k in value:
                if not isinstance(k, (str, int)) or isinstance(k, bool):
                    raise TypeError(f"cannot save state at {path}: dict key {k!r} (of type {type(k).__name__})")
            return {_DICT: [[k, walk(v, f"{path}[{k!r}]")] for k, v in value.items()]}
        raise TypeError(
            f"cannot save state at {path}: {type(value).__name__} values are not tensors, numbers, strings or "
            "containers of them (checkpoints never pickle objects)"
        )

    return tensors, walk(obj, "state")


def unflatten(skeleton: Any, tensors: dict[str, torch.Tensor]) -> Any:
    """Rebuild what ``flatten`` split; raises ValueError for a missing tensor or a malformed skeleton
    (any shape, type or depth: a damaged file must be refused, never crash the reader)."""
    try:
        return _rebuild(skeleton, tensors)
    except RecursionError:
        raise ValueError("the checkpoint's structure is nested too deeply") from None
    except (TypeError, AttributeError, KeyError, IndexError) as exc:
        raise ValueError(f"the checkpoint's structure is malformed ({type(exc).__name__}: {exc})") from None


def _rebuild(skeleton: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(skeleton, list):
        return [_rebuild(v, tensors) for v in skeleton]
    if isinstance(skeleton, dict):
        if _TENSOR in skeleton:
            key = skeleton[_TENSOR]
            if key not in tensors:
                raise ValueError(f"the checkpoint's tensor {key!r} is missing; the file is incomplete")
            return tensors[key]
        if _TUPLE in skeleton:
            return tuple(_rebuild(v, tensors) for v in skeleton[_TUPLE])
        if _DICT in skeleton:
            return {k: _rebuild(v, tensors) for k, v in skeleton[_DICT]}
        if _FLOAT in skeleton:
            if skeleton[_FLOAT] not in ("inf", "-inf", "nan"):  # what flatten writes for non-finite floats
                raise ValueError(f"the checkpoint's structure is malformed (a float given as {skeleton[_FLOAT]!r})")
            return float(skeleton[_FLOAT])
        return {k: _rebuild(v, tensors) for k, v in skeleton.items()}
    return skeleton
