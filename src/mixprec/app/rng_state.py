"""Every global random state a training step may draw from (torch, CUDA, Python, NumPy), as tensors and
plain values that a safetensors checkpoint stores without pickling, and back."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

__all__ = ["get_rng_state", "set_rng_state"]


def get_rng_state() -> dict[str, Any]:
    """The torch, CUDA (every device), Python and NumPy generators' states."""
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": _numpy_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what :func:`get_rng_state` returned (CUDA's states only where CUDA is present)."""
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(_numpy_rng_from(state["numpy"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _numpy_rng_state() -> dict[str, Any]:
    name, keys, position, has_gauss, cached = np.random.get_state()
    return {
        "name": name,
        "keys": torch.from_numpy(keys.astype(np.int64)),  # uint32 words, widened: torch has no uint32 storage here
        "position": int(position),
        "has_gauss": int(has_gauss),
        "cached_gaussian": float(cached),
    }


def _numpy_rng_from(state: dict[str, Any]) -> tuple:
    keys = state["keys"].numpy().astype(np.uint32)
    return state["name"], keys, state["position"], state["has_gauss"], state["cached_gaussian"]
