"""A guard: the model's weights must still hold their FP32 masters' rounding at every update.

MixedPrecision makes the FP32 masters (o2 policies) from the exact weights, then rounds them into the model;
each update writes the masters back over the model. Weights changed in between would be overwritten, silently:
DistributedDataParallel broadcasting rank 0's weights to ranks that built different ones, a
``model.load_state_dict`` after MixedPrecision was built, or one mid-training (a "best checkpoint" restored
after N updates: the next update brought the masters' weights back).

Before the first update every weight is compared with its master: one host sync (one flag read), agreed
across ranks so that every rank raises together (DDP's broadcast writes no version counter). At every later
update the weights' version counters and data pointers are compared with those recorded after the last copy
from the masters (list compares on the host: no device work, no sync): an in-place write (``load_state_dict``,
``p.copy_``, ``p.mul_`` under no_grad) moves a counter, and ``p.data = x`` moves a pointer; only the moved
weights are compared with their masters (a host sync only then). A write through ``p.data`` in place
(``p.data.fill_(0)``) moves neither and is not seen: ``.data`` is the escape from autograd's bookkeeping, and
seeing it would cost a comparison of every weight at every update. A later drift is found by the ranks that
wrote their weights (all of them, when every rank runs the same code); a rank that alone did raises alone, and
its peers end at the next collective with the lost-peer error.
"""

from __future__ import annotations

from typing import Any

import torch

from mixprec.distributed.ranks import agree_max
from mixprec.master.weights import MasterWeights

__all__ = ["MasterDriftGuard"]


class MasterDriftGuard:
    """Refuses an update where the model's 16-bit weights are no longer the masters' roundings."""

    def __init__(self, masters: MasterWeights) -> None:
        self._masters = masters
        self._checked = False  # every weight compared with its master, once, before the first update

    def before_update(self, mp: Any) -> None:
        if not mp.at_update_boundary:
            return
        masters = self._masters
        if not self._checked:
            drifted = masters.drifted()
            (anywhere,) = agree_max([torch.tensor([float(len(drifted))], device=mp.device)])
            if anywhere.item():  # host sync, once
                raise RuntimeError(_message(mp, masters, drifted, later=False))
            self._checked = True
            return
        if masters.versions is None:  # no update applied yet
            return
        versions = [p._version for p in masters.model_params]
        pointers = list(map(torch.Tensor.data_ptr, masters.model_params))
        if versions == masters.versions and pointers == masters.pointers:
            return
        now, then = zip(versions, pointers, strict=True), zip(masters.versions, masters.pointers, strict=True)
        moved = [i for i, (here, before) in enumerate(zip(now, then, strict=True)) if here != before]
        drifted = [moved[i] for i in masters.drifted(moved)]  # host sync, only when a weight was written
        if drifted:
            raise RuntimeError(_message(mp, masters, drifted, later=True))
        masters.versions, masters.pointers = versions, pointers  # the values the masters round to: nothing lost


def _message(mp: Any, masters: MasterWeights, drifted: list[int], later: bool) -> str:
    names = {id(p): name for name, p in mp.model.named_parameters()}
    where = (
        f"{len(drifted)} of the model's {len(masters)} {mp.policy.param_dtype} parameters (first: "
        f"{names.get(id(masters.model_params[drifted[0]]), '?')!r})"
        if drifted
        else f"another rank's {mp.policy.param_dtype} parameters"
    )
    said = (
        f"MixedPrecision.step(): {where} no longer hold their FP32 masters' rounding: the weights were changed "
        "after MixedPrecision made the masters from them, and this update would write the masters back over them."
    )
    if later:
        return (
            f"{said} They were written in place since the last update (a model.load_state_dict, a copy_ into a "
            "weight): to restore weights mid-training, load them with mp.load_state_dict (a state saved by "
            "mp.state_dict; Accelerate's load_state does with accelerator.register_for_checkpointing(mp)), or build a "
            "new MixedPrecision after loading them into the model."
        )
    return (
        f"{said} Typical causes: DistributedDataParallel broadcast rank 0's weights to ranks that built different "
        "ones (seed the model's initialization, or call mixprec.distributed.copy_from_main(list(model.parameters()))"
        " before MixedPrecision), or a load_state_dict on the model (load the weights before building "
        "MixedPrecision, or use mp.load_state_dict; Accelerate's load_state loads it when "
        "accelerator.register_for_checkpointing(mp) was called before save_state and load_state)."
    )
