"""The one-off regions made on a model, kept for the next one of the same policy and device.

``with mixprec.autocast(policy, model):`` is often written once per batch (an evaluation loop, the integrations'
validation and prediction regions, code moved from ``torch.autocast``). A region made afresh each time prepares the
policy again (0.4 ms on a 112-module model) and routes new forwards with a new token, and a compiled model, which
guards its modules' forwards, was recompiled at every batch (6 graphs in 6 batches under ``fp8``; dynamo gives up
at its recompile limit and runs the rest eagerly). A closed region is kept instead and entered again while the
model has the same modules, under the same names, on the same device: the same forwards, the same token, prepared
once. It still closes on exit (the model is left as it was, its routing and output cast taken out); entering it again
routes the same objects back.
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable
from typing import Any

import torch
from torch import nn

__all__ = ["KeptRegions", "kept_regions"]

_KEPT = "_mixprec_one_off_regions"
_AT_MOST = 4  # policies alternated on one model (training and evaluation, a teacher's and a student's) each keep one


class KeptRegions:
    """A model's closed one-off regions by (policy, device), each with the model's layout when it was made."""

    def __init__(self) -> None:
        self._kept: dict[Hashable, tuple[tuple, Any]] = {}

    def __deepcopy__(self, memo: dict) -> KeptRegions:
        return KeptRegions()  # a copy of the model makes its own (a region belongs to one model)

    def __reduce__(self) -> tuple:
        return (KeptRegions, ())  # nothing of them is pickled with a whole model

    def take(self, key: Hashable, model: nn.Module) -> Any:
        """The region kept for ``key`` where the model is laid out as it was then, else None."""
        kept = self._kept.get(key)
        if kept is None:
            return None
        if kept[0] != _layout(model):  # a module added, replaced, renamed, or the model moved: prepare again
            del self._kept[key]
            return None
        return kept[1]

    def keep(self, key: Hashable, model: nn.Module, region: Any) -> None:
        """Keep ``region`` for ``key``, the oldest dropped beyond a few."""
        self._kept.pop(key, None)
        self._kept[key] = (_layout(model), region)
        while len(self._kept) > _AT_MOST:
            del self._kept[next(iter(self._kept))]


def kept_regions(model: nn.Module) -> KeptRegions:
    """The model's kept one-off regions (made on first use, in the model's own ``__dict__``, as its seat)."""
    kept = vars(model).get(_KEPT)
    if kept is None:
        kept = vars(model)[_KEPT] = KeptRegions()
    return kept


def _layout(model: nn.Module) -> tuple:
    """What a prepared region depends on: each module by name (the policy's entries match names; the routing holds
    the modules) and the device (the compute plan). A module compares by identity. Not the model itself (the first
    of its named modules, and the one whose ``__dict__`` holds this): a model held by its own ``__dict__`` is freed
    only by the cycle collector."""
    first = next(model.parameters(), None)
    device = first.device if first is not None else torch.device("cpu")
    return (device, tuple(itertools.islice(model.named_modules(), 1, None)))
