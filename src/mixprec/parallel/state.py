"""Whole-model checkpoints of FSDP2-sharded training: gather the shards to one file, scatter them back.

:func:`gather_state` is a collective (every rank calls it): the model's and the optimizer's state
dicts, unsharded, on the CPU, on rank 0 (the other ranks receive empty dicts and write nothing).
The file is then an ordinary mixprec checkpoint, written once, atomically, by rank 0.
:func:`scatter_state` (also a collective) loads it on every rank, each keeping its own shards; every
rank reads the file, so on several machines the run folder must be on a shared file system.
Parameters and optimizer state are keyed by parameter name (torch.distributed.checkpoint's format).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

__all__ = ["gather_state", "scatter_state"]


def gather_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict[str, Any], dict[str, Any]]:
    """(model state, optimizer state), full and on the CPU on rank 0; empty elsewhere. Collective."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_state_dict(model, optimizer, options=options)


def scatter_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, model_state: dict[str, Any], optimizer_state: dict[str, Any]
) -> None:
    """Load full state dicts (as :func:`gather_state` returned them) into a sharded model. Collective."""
    options = StateDictOptions(full_state_dict=True)
    if optimizer_state.get("state"):
        set_state_dict(
            model, optimizer, model_state_dict=model_state, optim_state_dict=optimizer_state, options=options
        )
        return
    # an optimizer without per-parameter state (plain SGD): torch.distributed.checkpoint cannot place
    # an empty state on a device, and there is none to place; only the groups' settings (lr, ...) load
    set_model_state_dict(model, model_state, options=options)
    saved_groups = optimizer_state.get("param_groups", [])
    if len(saved_groups) != len(optimizer.param_groups):
        raise ValueError(
            f"the checkpoint's optimizer has {len(saved_groups)} parameter groups, this one "
            f"{len(optimizer.param_groups)}; resume with the same optimizer."
        )
    for group, saved in zip(optimizer.param_groups, saved_groups, strict=True):
        group.update({key: value for key, value in saved.items() if key != "params"})
