"""One walker for the nests that torch functions take and models return (tuples, lists, mappings)."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch

__all__ = ["map_floating", "map_tensors"]


def map_floating(value: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """Apply ``fn`` to every floating tensor in a nest of tuples, lists, mappings and dataclasses.

    Containers keep their types: namedtuples, and mappings such as transformers' ModelOutput.
    """
    return map_tensors(value, lambda t: fn(t) if t.is_floating_point() else t)


def map_tensors(value: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """Apply ``fn`` to every tensor in a nest of tuples, lists, mappings and dataclasses (types kept, as above)."""
    if isinstance(value, torch.Tensor):
        return fn(value)
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # namedtuple
        return type(value)(*(map_tensors(v, fn) for v in value))
    if isinstance(value, (tuple, list)):
        return type(value)(map_tensors(v, fn) for v in value)
    if type(value) is dict:  # kwargs: a comprehension, which torch.compile traces (it cannot trace dict.copy)
        return {key: map_tensors(item, fn) for key, item in value.items()}
    if isinstance(value, Mapping):
        out = copy.copy(value)
        for key, item in value.items():
            out[key] = map_tensors(item, fn)  # type: ignore[index]
        return out
    if dataclasses.is_dataclass(value) and not isinstance(value, type):  # a model's output dataclass of its own
        out = copy.copy(value)
        for field in dataclasses.fields(value):
            object.__setattr__(out, field.name, map_tensors(getattr(value, field.name), fn))  # frozen ones too
        return out
    return value
