"""What ``MixedPrecision.step()`` returns."""

from __future__ import annotations

import torch

__all__ = ["StepResult"]


class StepResult:
    """What ``step()`` did. ``bool(result)`` is True when the update was applied (may sync the host)."""

    def __init__(self, update_step: bool, found: torch.Tensor | bool) -> None:
        self.update_step = update_step  # False inside an accumulation window: nothing was attempted
        self._found = found

    def __bool__(self) -> bool:
        if not self.update_step:
            return False
        found = self._found.item() if isinstance(self._found, torch.Tensor) else self._found  # host sync
        return not found

    @property
    def applied(self) -> bool:
        return bool(self)

    def __repr__(self) -> str:
        return f"StepResult(applied={bool(self)})" if self.update_step else "StepResult(accumulating)"
