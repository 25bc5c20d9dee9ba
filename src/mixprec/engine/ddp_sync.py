"""Whether DistributedDataParallel reduces the backward of the model's last forward: ``accumulate_in_fp32``
moves a micro-batch's gradients out of ``.grad`` only then.

DDP's gradient accumulation (``with ddp.no_sync():`` on every micro-batch but the last) leaves the unreduced
micro-batches' gradients in ``.grad``, and the last backward all-reduces ``.grad`` once: the sum of all of them.
Moved into the FP32 masters before that, the earlier micro-batches would stay this rank's own, never averaged:
the ranks' weights drift apart silently (measured: 4.9e-2 apart after 2 updates of a small MLP). Inside
``no_sync`` the gradients therefore add up in ``.grad`` as without mixprec, and move into FP32 after the reduced
backward; ``accumulate_in_fp32`` sums in FP32 where every micro-batch is reduced.

DDP says which of its modules is running while its forward runs (``_get_active_ddp_module``, what
TorchDynamo reads); a forward hook on the model reads it there, and whether that DDP will reduce (it decides
at the same moment: ``require_backward_grad_sync`` with gradients enabled). Cost: one class attribute read
per forward of the model. DDP's Python reducer (compiled autograd) names no active module: seen as reduced.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

__all__ = ["ReducedBackwardProbe"]


def _ddp_of(module: nn.Module) -> Any:
    """The DDP running ``module``'s forward: the module itself (a MixedPrecision made on the wrapper; its hooks run
    after DDP's forward has ended), else the one whose forward is running, else None."""
    if not torch.distributed.is_available():
        return None
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(module, DistributedDataParallel):
        return module
    active = getattr(DistributedDataParallel, "_get_active_ddp_module", None)
    return active() if active is not None else None


class ReducedBackwardProbe:
    """A forward hook on the model: :meth:`take` tells whether the backward about to run is all-reduced by DDP
    (True outside DDP). Any forward with gradients through a DDP that does not reduce, since the last backward,
    makes it False: a later forward without gradients (a metric pass) or one past the wrapper (``ddp.module``)
    does not set it back, whichever ran last."""

    def __init__(self, model: nn.Module) -> None:
        self.reduced = True
        self._told = False
        self._handle = model.register_forward_hook(self._after_forward)

    def _after_forward(self, module: nn.Module, args: tuple, output: Any) -> None:
        if not torch.is_grad_enabled():  # no backward follows it
            return
        ddp = _ddp_of(module)
        if ddp is not None and not ddp.require_backward_grad_sync:
            self.reduced = False
        if not self.reduced and not self._told:
            self._told = True
            warnings.warn(
                "MixedPrecision(accumulate_in_fp32=True) inside DistributedDataParallel's no_sync(): the "
                "micro-batches' gradients add up in the 16-bit .grad, which DDP all-reduces once at the synced "
                "backward, and move into FP32 from there (moved earlier, they would never be averaged across "
                "ranks). To sum every micro-batch in FP32, reduce each one (no no_sync()).",
                stacklevel=2,
            )

    def take(self) -> bool:
        """Whether the backward now running is reduced; the next one is judged by the forwards after it."""
        reduced, self.reduced = self.reduced, True
        return reduced

    def remove(self) -> None:
        self._handle.remove()
