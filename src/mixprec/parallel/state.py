"""The state of FSDP2-sharded training, whole or as this rank's shards, and loading it back.

:func:`gather_state` is a collective (every rank calls it): the model's and the optimizer's state
dicts, unsharded, on the CPU, on rank 0 (the other ranks receive empty dicts): what a whole-model
file needs. :func:`sharded_state` is this rank's part only, as DTensors (no communication): what a
sharded checkpoint writes, each rank its own. :func:`scatter_state` (a collective) loads either kind
into the sharded model, each rank keeping its own shards.
Parameters and optimizer state are keyed by parameter name (torch.distributed.checkpoint's format).

torch.distributed.checkpoint is imported where used: it imports torch._dynamo, 1.4 s of every start.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["gather_state", "scatter_state", "sharded_state", "tied_names", "with_tied_names"]


def gather_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict[str, Any], dict[str, Any]]:
    """(model state, optimizer state), full and on the CPU on rank 0; empty elsewhere. Collective."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_state_dict(model, optimizer, options=options)


def sharded_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict[str, Any], dict[str, Any]]:
    """(model state, optimizer state) of this rank: sharded tensors as DTensors, sharing their storage.

    An optimizer that has not stepped yet gets its state made by a step with zero gradients and a zero
    learning rate (torch.distributed.checkpoint's way), so that the state has every tensor to load into.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    model_state, optimizer_state = get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=False))
    for alias in tied_names(model):  # one tensor under two names (tied embeddings): kept under its first
        model_state.pop(alias, None)
    return model_state, optimizer_state


def tied_names(model: nn.Module) -> dict[str, str]:
    """``{name: first name}`` for every parameter reachable under a second name."""
    first: dict[int, str] = {}
    tied = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        if id(parameter) in first:
            tied[name] = first[id(parameter)]
        else:
            first[id(parameter)] = name
    return tied


def with_tied_names(model: nn.Module, model_state: dict[str, Any]) -> dict[str, Any]:
    """``model_state`` with the second names of ``model``'s tied parameters back (as :func:`sharded_state`
    left them out), each naming its first name's tensor."""
    tied = {alias: model_state[name] for alias, name in tied_names(model).items() if name in model_state}
    return {**model_state, **tied}


def scatter_state(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    model_state: dict[str, Any],
    optimizer_state: dict[str, Any],
    *,
    full: bool = True,
) -> None:
    """Load state dicts into a sharded model: whole (``full``, as :func:`gather_state` returned them) or
    DTensors (as :func:`sharded_state` did). Collective."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_state_dict

    options = StateDictOptions(full_state_dict=full)
    if not full:  # sharded_state left out the second names of tied parameters
        model_state = with_tied_names(model, model_state)
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
