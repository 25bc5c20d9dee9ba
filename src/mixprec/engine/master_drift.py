"""A guard: the model's weights must still hold their FP32 masters' rounding at the first update.

MixedPrecision makes the FP32 masters (o2 policies) from the exact weights, then rounds them into the model;
each update writes the masters back over the model. Weights changed in between would be overwritten, silently:
DistributedDataParallel broadcasting rank 0's weights to ranks that built different ones, or a
``model.load_state_dict`` after MixedPrecision was built. Checked once, before the first update: one host sync
(one flag read), agreed across ranks so that every rank raises together.
"""

from __future__ import annotations

from typing import Any

import torch

from mixprec.distributed.ranks import agree_max
from mixprec.master.weights import MasterWeights

__all__ = ["MasterDriftGuard"]


class MasterDriftGuard:
    """Refuses the first update where the model's 16-bit weights are no longer the masters' roundings."""

    def __init__(self, masters: MasterWeights) -> None:
        self._masters = masters
        self._checked = False  # once: after the first update the masters are the weights' source

    def before_update(self, mp: Any) -> None:
        if self._checked or not mp.at_update_boundary:
            return
        masters = self._masters
        drifted = masters.drifted()
        (anywhere,) = agree_max([torch.tensor([float(len(drifted))], device=mp.device)])
        if anywhere.item():  # host sync, once
            names = {id(p): name for name, p in mp.model.named_parameters()}
            where = (
                f"{len(drifted)} of the model's {len(masters)} {mp.policy.param_dtype} parameters (first: "
                f"{names.get(id(masters.model_params[drifted[0]]), '?')!r})"
                if drifted
                else f"another rank's {mp.policy.param_dtype} parameters"
            )
            raise RuntimeError(
                f"MixedPrecision.step(): {where} no longer hold their FP32 masters' rounding: the weights were changed "
                "after MixedPrecision made the masters from them, and this update would write the masters back over "
                "them. Typical causes: DistributedDataParallel broadcast rank 0's weights to ranks that built "
                "different ones (seed the model's initialization, or call mixprec.distributed.copy_from_main("
                "list(model.parameters())) before MixedPrecision), or a load_state_dict on the model (load the "
                "weights before building MixedPrecision, or use mp.load_state_dict)."
            )
        self._checked = True
