"""MixedPrecision's saved state: what ``state_dict()`` holds, and the refusals of state from another run."""

from __future__ import annotations

import warnings
from typing import Any

from mixprec.checks import whole_number
from mixprec.policy.parse import RUN_OPTIONS, resumes_under
from mixprec.policy.policy import Policy

__all__ = ["STATE_KEYS", "check_saved_state", "warn_mid_window"]

STATE_KEYS = {"policy", "scalers", "masters", "counters", "micro_step", "accumulation_steps", "fp8"}


def check_saved_state(state: Any, policy: Policy, num_scalers: int, accumulation_steps: int, has_masters: bool) -> None:
    """Raise ValueError when ``state`` is not what ``state_dict()`` returned for this policy and these settings
    (an older state without ``fp8`` is accepted)."""
    where = "MixedPrecision.load_state_dict"
    if not isinstance(state, dict) or set(state) | {"fp8"} != STATE_KEYS:
        got = sorted(state) if isinstance(state, dict) else type(state).__name__
        raise ValueError(
            f"{where}: expected keys {sorted(STATE_KEYS)}, received {got}; pass what MixedPrecision.state_dict() "
            "returned."
        )
    if not isinstance(state["scalers"], list) or not isinstance(state["counters"], dict):
        raise ValueError(
            f"{where}: 'scalers' must be a list and 'counters' a dict, as state_dict() returns them; received "
            f"{type(state['scalers']).__name__} and {type(state['counters']).__name__}."
        )
    whole_number(state["micro_step"], f"{where}: 'micro_step'", minimum=0)
    whole_number(state["accumulation_steps"], f"{where}: 'accumulation_steps'")
    if not resumes_under(state["policy"], policy):
        raise ValueError(
            f"{where}: the state was saved under policy {state['policy']!r}, this run uses {str(policy)!r}; resume "
            f"with the same policy (the FP8 recipe's {', '.join(RUN_OPTIONS[:-1])} and {RUN_OPTIONS[-1]} may differ)."
        )
    if len(state["scalers"]) != num_scalers:
        raise ValueError(
            f"{where}: the state has {len(state['scalers'])} loss scalers, this run has {num_scalers} (num_losses); "
            "resume with the same num_losses."
        )
    if state["accumulation_steps"] != accumulation_steps:
        raise ValueError(
            f"{where}: saved with accumulation_steps={state['accumulation_steps']}, this run uses {accumulation_steps}."
        )
    if state["masters"] and not has_masters:
        raise ValueError(f"{where}: the state holds master weights, this policy keeps none.")


def warn_mid_window(micro_step: int, accumulation_steps: int, *, saving: bool) -> None:
    """The state saved (``saving``) or loaded holds no gradients of an unfinished accumulation window: say so."""
    if not micro_step:
        return
    if saving:
        message = (
            f"MixedPrecision.state_dict() in the middle of an accumulation window ({micro_step} of "
            f"{accumulation_steps} micro-batches done): their gradients are not saved, so a run resumed from this "
            "state starts the window again without them. Checkpoint right after an update (when mp.step() returned "
            "update_step=True)."
        )
    else:
        message = (
            f"MixedPrecision.load_state_dict: the state was saved after {micro_step} of {accumulation_steps} "
            "micro-batches of an accumulation window, without their gradients: the window starts again here, and "
            "those micro-batches do not count in the next update."
        )
    warnings.warn(message, stacklevel=3)  # at the caller of state_dict() / load_state_dict()
