"""A resume that restored the optimizer but not MixedPrecision's state: said once, before the first step.

A mixprec checkpoint holds the optimizer's state and MixedPrecision's (``mp.state_dict()``: the loss scales, the
counters, o2's masters). A resume that loads the first alone restarts the loss scale at its initial value (2^16),
so the resumed run is not the one saved: it skips updates again to find its scale, with no word. That is what
Accelerate's ``load_state`` does when ``accelerator.register_for_checkpointing(mp)`` was forgotten. (o2's masters
are the master-drift guard's: weights loaded into the model without them are refused at the first update.)

A guard (:mod:`mixprec.engine.guards`), made for policies that scale the loss: torch's ``load_state_dict``
post-hook on the optimizer notes a load of a trained optimizer (non-empty state) into a MixedPrecision whose own
state was not loaded (in either order: Accelerate loads the optimizer first, Lightning MixedPrecision's first);
the first region entry or step with that note warns, and the hook is removed at the first update. No device
work, no host sync.
"""

from __future__ import annotations

import warnings
import weakref
from typing import Any

import torch

__all__ = ["PartialResumeGuard"]


class PartialResumeGuard:
    """Warns when the optimizer's state was loaded before the first update but MixedPrecision's was not."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer_loaded = False
        self.mixprec_loaded = False
        guard = weakref.ref(self)  # the optimizer outlives a MixedPrecision dropped for another: hold it weakly

        def after_optimizer_load(loaded: torch.optim.Optimizer) -> None:
            if (me := guard()) is not None and loaded.state:  # an empty state: a fresh optimizer (Accelerate's
                me.optimizer_loaded = True  # prepare() reloads it to place it on the device)

        self._hook: Any = optimizer.register_load_state_dict_post_hook(after_optimizer_load)

    def restored(self) -> None:
        """``mp.load_state_dict`` ran: the resume carries MixedPrecision's state."""
        self.mixprec_loaded = True

    def before_forward(self, mp: Any) -> None:
        if self.optimizer_loaded and not self.mixprec_loaded:
            self.optimizer_loaded = False  # said once
            scale = mp.scalers[0].get_scale()
            warnings.warn(
                "MixedPrecision: the optimizer's state was loaded (optimizer.load_state_dict, Accelerate's "
                f"load_state) but this MixedPrecision's was not: the loss scale restarts at {scale:g} and the "
                "overflow counters at 0, so the resumed run is not the one saved (it skips updates again to find "
                "its scale). Load it too: mp.load_state_dict(state) with what mp.state_dict() returned at the save; "
                "with Accelerate, call accelerator.register_for_checkpointing(mp) before save_state and load_state.",
                stacklevel=4,
            )

    def before_update(self, mp: Any) -> None:
        if self._hook is None:  # past the first update: nothing left to watch, nothing to do per step
            return
        self.before_forward(mp)
        if mp.at_update_boundary:  # a load from now on is mid-training, with MixedPrecision's state live
            self._hook.remove()
            self._hook = None
            self.mixprec_loaded = True
