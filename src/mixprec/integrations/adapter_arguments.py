"""What every adapter checks when it is made: its policy and its loss scaler, refused by the adapter's name."""

from __future__ import annotations

from typing import Any

import mixprec

__all__ = ["check_adapter_arguments", "is_auto"]


def is_auto(policy: Any) -> bool:
    """``"auto"``: a policy chosen for the device the framework trains on, known only then."""
    return isinstance(policy, str) and policy.strip().lower() == "auto"


def check_adapter_arguments(adapter: str, policy: Any, scaler: Any) -> mixprec.Policy | None:
    """``policy`` resolved now unless ``auto`` (None then), so that a bad one fails when the adapter is made; a
    ``scaler`` that is neither a :class:`mixprec.LossScaler` nor None refused, naming ``adapter``."""
    resolved = None if is_auto(policy) else mixprec.get_policy(policy, argument=f"{adapter}(policy=...)")
    if scaler is not None and not isinstance(scaler, mixprec.LossScaler):
        raise TypeError(
            f"{adapter}(scaler=...) needs a mixprec.LossScaler or None; received {scaler!r} "
            f"(of type {type(scaler).__name__})."
        )
    return resolved
