"""The loss-scaler protocol: every scaler, "no scaling" included, is driven the same way.

    loss = scaler.scale(loss)               # loss * S
    loss.backward()
    found_inf = scaler.unscale_(grads)      # grads * (1/S) in place; 1.0 on device if any is inf/NaN
    ...skip the optimizer step where found_inf is set...
    scaler.update(found_inf)                # adjust S on device (dynamic scalers only)

Code that uses a scaler never branches on whether scaling is on. The scale lives on the gradients'
device as a 1-element fp32 tensor; only ``get_scale()`` and ``state_dict()`` read it on the host.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from mixprec.numerics.finite import Grouped, unscale_and_check_

__all__ = ["LossScaler", "check_state_type", "device_of"]


class LossScaler(ABC):
    """Base class: holds the scale tensor; subclasses decide how it changes."""

    def __init__(self, init_scale: float) -> None:
        self._init_scale = float(init_scale)
        self._scale: torch.Tensor | None = None  # created on the device of the first loss or gradients
        self._reciprocal: tuple[torch.Tensor, int, torch.Tensor] | None = None  # (scale, its version, 1 / scale)

    # -- the scale ---------------------------------------------------------------------------
    def _scale_on(self, device: torch.device) -> torch.Tensor:
        if self._scale is None:
            self._scale = torch.full((1,), self._init_scale, dtype=torch.float32, device=device)
            self._init_state(device)
        return self._scale

    def _init_state(self, device: torch.device) -> None:  # noqa: B027  (optional hook, not abstract)
        """Create any further on-device state (dynamic scalers' trackers)."""

    @property
    def scale_tensor(self) -> torch.Tensor | None:
        """The current scale on its device (None before first use); reading it does not sync."""
        return self._scale

    @property
    def fixed_scale(self) -> float | None:
        """The scale where it can never change (no scaling: 1.0), known on the host with no read; else None."""
        return None

    def get_scale(self) -> float:
        """The current scale as a Python float. Host sync: reads the device tensor."""
        return float(self._scale.item()) if self._scale is not None else self._init_scale

    # -- the protocol --------------------------------------------------------------------------
    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss * scale``, in the loss's dtype (autograd carries the factor into every gradient)."""
        return self._checked(loss) * self._scale_on(loss.device).to(loss.dtype)

    def _checked(self, value: torch.Tensor, argument: str = "scale(loss=...)") -> torch.Tensor:
        """``value`` if it is a tensor; else TypeError naming the method's ``argument``."""
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{type(self).__name__}.{argument} needs a torch.Tensor; received {type(value).__name__}.")
        return value

    def unscale_(self, grads: Sequence[torch.Tensor] | Grouped) -> torch.Tensor:
        """Divide ``grads`` by the scale in place, in one fused pass per device and dtype (``grads`` may come
        grouped by (device, dtype) already: :func:`mixprec.numerics.unscale_and_check_`).

        Returns a 1-element fp32 tensor on the scale's device: 1.0 when any gradient is inf or NaN.
        The reciprocal is computed in fp64, as GradScaler does: fp32 division can be inexact.
        """
        scale = self._scale_on(device_of(grads))
        cached = self._reciprocal
        # kept while the scale tensor is unchanged (every write to it is in place and bumps its version): a
        # static scale's reciprocal is computed once, not three launches a step
        if cached is None or cached[0] is not scale or cached[1] != scale._version:
            cached = self._reciprocal = (scale, scale._version, scale.double().reciprocal().float())
        return unscale_and_check_(grads, cached[2])

    def unscale_checked_(self, grads: Sequence[torch.Tensor] | Grouped) -> tuple[torch.Tensor, torch.Tensor | None]:
        """:meth:`unscale_`'s flag, and the gradients' max magnitudes where the check read them
        (:func:`mixprec.numerics.max_magnitudes`; None where it did not): they tell an inf from a NaN with no
        further pass over the gradients. What MixedPrecision calls: here :meth:`unscale_` (a subclass's own
        included) and no magnitudes."""
        return self.unscale_(grads), None

    @abstractmethod
    def update(self, found_inf: torch.Tensor) -> None:
        """Adjust the scale after a step; ``found_inf`` is what ``unscale_`` returned."""

    def is_floor(self, scale: float) -> bool:
        """Whether ``scale`` is as low as this scaler goes, so an overflow there is not cured by scaling."""
        return True

    # -- state -------------------------------------------------------------------------------
    @abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """Every field, with public names; plain Python numbers."""

    @abstractmethod
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict`` returned; unknown or missing keys are errors."""

    def _check_keys(self, state: dict[str, Any], expected: set[str]) -> None:
        if not isinstance(state, dict):
            raise TypeError(
                f"{type(self).__name__}.load_state_dict(state=...) needs a dict; received {type(state).__name__}."
            )
        missing, unknown = expected - state.keys(), state.keys() - expected
        if missing or unknown:
            raise ValueError(
                f"{type(self).__name__}.load_state_dict: the state does not match this scaler "
                f"(missing {sorted(missing)}, unknown {sorted(unknown)}); was it saved from another scaler type?"
            )

    def _load_scale(self, scale: float) -> None:
        self._init_scale = float(scale)
        if self._scale is not None:
            self._scale.fill_(self._init_scale)


def check_state_type(scaler: LossScaler, state: dict[str, Any], expected: str) -> None:
    if state["type"] != expected:
        raise ValueError(
            f"{type(scaler).__name__}.load_state_dict: the state is from a {state['type']!r} scaler, "
            f"this one is {expected!r}; build the matching scaler before loading."
        )


def device_of(grads: Sequence[torch.Tensor] | Grouped) -> torch.device:
    """The first gradient's device (the CPU for none): where the scale and the found-inf flag live."""
    if not isinstance(grads, (Sequence, Mapping)) or isinstance(grads, str):  # every unscale passes here first
        raise TypeError(
            f"unscale_(grads=...) needs a list of gradient tensors (or them grouped by device and dtype); received "
            f"{type(grads).__name__}."
        )
    if isinstance(grads, Mapping):  # keyed by (device, dtype)
        return next(iter(grads), (torch.device("cpu"),))[0]
    return grads[0].device if grads else torch.device("cpu")
