"""The parameter dtypes a policy set, checked at every update: another framework casting the model
afterwards (Lightning Fabric's ``precision="bf16-true"``, ``model.half()``, a full-bf16 evaluation) would
otherwise silently train different numerics than the policy names, e.g. bf16 weights updated without
FP32 masters under ``mixed_bf16``."""

from __future__ import annotations

from torch import nn

__all__ = ["ParameterDtypes"]


class ParameterDtypes:
    """A snapshot of a model's parameter dtypes; :meth:`check` raises if any changed since.

    A Python loop over the parameters (no device work, no host sync): microseconds per step.
    """

    def __init__(self, model: nn.Module) -> None:
        self._expected = [(name, param, param.dtype) for name, param in model.named_parameters()]

    def check(self) -> None:
        """Raise ValueError naming the first parameter whose dtype is no longer the one the policy set."""
        for name, param, dtype in self._expected:
            if param.dtype != dtype:
                raise ValueError(
                    f"MixedPrecision: parameter {name!r} is now {param.dtype}, but the policy set it to {dtype}: "
                    "something cast the model after MixedPrecision prepared it (another "
                    "framework's precision setting such as Lightning Fabric's precision='bf16-true' or "
                    "'16-true', model.half(), or a full-16-bit evaluation). The update was not applied. Keep "
                    "the framework at full precision (precision='32-true', mixed_precision='no') and let the "
                    "policy set the precision."
                )
