"""MixedPrecision's saved state: what ``state_dict()`` holds, and the refusals of state from another run."""

from __future__ import annotations

from typing import Any

from mixprec.policy.policy import Policy

__all__ = ["STATE_KEYS", "check_saved_state"]

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
    if state["policy"] != str(policy):
        raise ValueError(
            f"{where}: the state was saved under policy {state['policy']!r}, this run uses {str(policy)!r}; resume "
            "with the same policy."
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
