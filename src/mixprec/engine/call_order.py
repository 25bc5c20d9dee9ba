"""The order of calls in a training step, as a small state machine with errors that say why.

    autocast() -> backward() [-> unscale_() / clip_grad_norm_()] -> step()

Per update window (``accumulation_steps`` micro-batches): every micro-batch needs a backward() before
its step(); unscale_() at most once, at the window's last micro-batch; a backward() after a step()
needs a new forward pass under autocast() first.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

__all__ = ["CallOrder", "check_loss", "refuse_direct_steps"]


def check_loss(loss: Any, loss_id: Any, num_losses: int) -> None:
    """backward()'s arguments: a one-element loss that requires gradients, and the id of one of the losses."""
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise ValueError(f"backward(loss=...) needs a one-element loss tensor; received {shape}. Reduce it first.")
    if isinstance(loss_id, bool) or not isinstance(loss_id, int) or not 0 <= loss_id < num_losses:
        raise ValueError(f"backward(loss_id=...) must be in 0..{num_losses - 1}; received {loss_id!r}.")
    if not loss.requires_grad:
        raise ValueError(
            "backward(loss=...): the loss does not require gradients, so there is nothing to train: the model "
            "has no trainable parameters (none with requires_grad=True reached the loss), or the loss was "
            "computed under torch.no_grad() or detached."
        )


class CallOrder:
    def __init__(self, accumulation_steps: int) -> None:
        self.accumulation_steps = accumulation_steps
        self.micro_step = 0  # micro-batches finished in the current window
        self.backward_since_step = False
        self.forward_since_step = True  # the first backward may use a forward made before MixedPrecision
        self.unscaled = False
        self.released = False  # release() handed the model and optimizer back: no call is valid any more

    @property
    def at_update_boundary(self) -> bool:
        """True when the next step() applies an update (the window's last micro-batch)."""
        return self.micro_step + 1 >= self.accumulation_steps

    def on_forward(self) -> None:
        self.forward_since_step = True

    def check_open(self, caller: str) -> None:
        if self.released:
            raise RuntimeError(
                f"{caller} after release(): this MixedPrecision handed its model and optimizer back in FP32. "
                "Build a new MixedPrecision on them (load_state_dict(old.state_dict()) continues the run)."
            )

    # Each call is checked (check_*: raises, changes nothing) before the step's guards run, and recorded (on_*)
    # after them: a call refused for its order leaves every guard as it was.
    def check_backward(self) -> None:
        self.check_open("backward()")
        if self.unscaled:
            raise RuntimeError(
                "backward() after unscale_()/clip_grad_norm_(): this step's gradients are already unscaled, so "
                "new gradients would be mixed with them at another scale. Call step() first."
            )
        if not self.forward_since_step:
            raise RuntimeError(
                "backward() after step() without a new forward pass: compute a new loss under "
                "mp.autocast() first (the previous loss belongs to weights that step() has changed)."
            )

    def on_backward(self) -> None:
        self.backward_since_step = True

    def check_optimizer_step(self) -> None:
        """The optimizer stepped by someone else than step() (a hook on the optimizer runs this first)."""
        if self.backward_since_step:
            raise RuntimeError(
                "optimizer.step() called directly after mp.backward(): it would apply the gradients as they are "
                "(multiplied by the loss scale, 2^16 at first, under fp16), and mp.step() would then apply a "
                "second update. Nothing was applied. Call mp.step() alone: it unscales, checks and steps the "
                "optimizer itself."
            )

    def check_unscale(self, caller: str) -> None:
        self.check_open(caller)
        if not self.backward_since_step:
            raise RuntimeError(f"{caller} before backward(): there are no gradients for this step to unscale.")
        if self.unscaled:
            raise RuntimeError(
                f"{caller}: unscale_() has already been called since the last step(); gradients are unscaled "
                "once per update. clip_grad_norm_() unscales by itself, so call it instead of, not after, unscale_()."
            )
        if not self.at_update_boundary:
            raise RuntimeError(
                f"{caller} in the middle of an accumulation window (micro-batch {self.micro_step + 1} of "
                f"{self.accumulation_steps}): call it only when mp.at_update_boundary is True."
            )

    def on_unscale(self) -> None:
        self.unscaled = True

    def check_step(self) -> None:
        self.check_open("step()")
        if not self.backward_since_step:
            raise RuntimeError(
                "step() without backward() since the last step(): each step() needs the gradients of a new "
                "loss passed to mp.backward(loss), which scales it. Was step() called twice, or the loss "
                "backpropagated by another backward (loss.backward(), fabric.backward(), accelerator.backward())? "
                "Call mp.backward(loss) instead, with the framework's own precision off (Fabric: "
                "precision='32-true'; Accelerate: mixed_precision='no')."
            )

    def on_step(self) -> bool:
        """Record a step() call (checked already); returns True when it completes an update window."""
        self.micro_step += 1
        self.backward_since_step = False
        self.forward_since_step = False
        if self.micro_step < self.accumulation_steps:
            return False
        self.micro_step = 0
        self.unscaled = False
        return True

    def reset(self) -> None:
        """Forget the current window (after zero_grad())."""
        self.micro_step = 0
        self.backward_since_step = False
        self.unscaled = False


def refuse_direct_steps(optimizer: torch.optim.Optimizer, order: CallOrder) -> torch.utils.hooks.RemovableHandle:
    """An ``optimizer.step()`` of the user's between ``mp.backward()`` and ``mp.step()`` is refused before it
    applies anything (torch's step pre-hook; step() itself steps the optimizer once the window is recorded). The
    hook holds the call order weakly: a MixedPrecision dropped for a new one on the same optimizer says nothing."""
    order_ref = weakref.ref(order)

    def before_optimizer_step(*_: Any) -> None:
        order = order_ref()
        if order is not None:
            order.check_optimizer_step()

    return optimizer.register_step_pre_hook(before_optimizer_step)
