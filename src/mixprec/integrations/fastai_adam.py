"""fastai's default optimizer, ``Adam``, as a torch optimizer: what makes ``learn.to_mixprec()`` one line.

A fastai Learner trains with fastai's own ``Optimizer`` class unless told otherwise (``opt_func=Adam`` is the
default, ``vision_learner``'s too), which MixedPrecision cannot drive: it points torch.optim's param groups at
FP32 masters and moves the state with them. ``learn.to_mixprec`` swaps fastai's ``Adam`` (the function itself, or a
``partial`` of it) for :class:`FastaiAdam` inside fastai's ``OptimWrapper``:

- the same hyper-parameters under fastai's names (``mom``, ``sqr_mom``, ``eps``, ``wd``: OptimWrapper maps them
  onto ``betas`` and ``weight_decay``), so ``fit_one_cycle``'s schedules, ``freeze``/``unfreeze`` and
  discriminative learning rates work as before;
- fastai's arithmetic, op for op (weight decay or L2, ``average_grad`` with dampening, ``average_sqr_grad``,
  ``adam_step``'s debiasing): a fit under the ``fp32`` policy equals one under fastai's ``Adam`` bit for bit, with
  one exception: a group frozen after it trained (fit, ``freeze()``, fit) stays put here, where fastai's optimizer,
  which zeroes gradients instead of dropping them, goes on moving it by momentum and weight decay (``fine_tune``
  freezes before its first fit: equal);
- fastai's ``wd_bn_bias=False`` (no weight decay on the norms' parameters and the biases): which parameters skip
  weight decay is read from the wrapper's state (fastai's ``do_wd`` flags) when the callback builds its
  MixedPrecision, and kept by position in the param groups, so it follows o2's masters; without the callback
  (removed after ``to_mixprec``), at the first step.

Other fastai optimizers (``SGD``, ``RAdam``, ``Lamb``, ...) are refused at ``fit`` with the fix: an
``OptimWrapper`` around a torch optimizer.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from typing import Any

import torch
from fastai.basics import OptimWrapper
from fastai.optimizer import Adam, Optimizer

__all__ = ["FastaiAdam", "adopt_fastais_adam", "fastai_adam_in_wrapper"]

# fastai's Adam arguments -> FastaiAdam's (OptimWrapper passes lr through)
_DEFAULTS = {"mom": 0.9, "sqr_mom": 0.99, "eps": 1e-5, "wd": 0.01, "decouple_wd": True}


class FastaiAdam(torch.optim.Optimizer):
    """fastai's ``Adam`` (``decouple_wd=True``: AdamW) as a ``torch.optim`` optimizer, fastai's arithmetic op for op.

    State per parameter under fastai's names: ``grad_avg``, ``sqr_avg`` and ``step`` (a CPU tensor, as torch's
    optimizers keep it: the debiasing is computed on the host, in double, as fastai does)."""

    def __init__(
        self,
        params: Any,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.99),
        eps: float = 1e-5,
        weight_decay: float = 0.01,
        decouple_wd: bool = True,
    ) -> None:
        defaults = {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay, "decouple_wd": decouple_wd}
        super().__init__(params, defaults)
        self._no_decay: frozenset[tuple[int, int]] = frozenset()  # (group, position) of parameters fastai exempts
        # its wrapper's state, where fastai keeps do_wd, until the flags are taken (by the callback or the first step)
        self._fastai_flags: Mapping[torch.Tensor, Mapping[str, Any]] | None = None

    def skip_weight_decay_where(self, flags: Mapping[torch.Tensor, Mapping[str, Any]]) -> None:
        """Take fastai's per-parameter ``do_wd`` flags (an OptimWrapper's ``state``), by position in the groups:
        called while the groups still hold the model's parameters (before o2 puts masters in their place)."""
        self._fastai_flags = None  # taken
        self._no_decay = frozenset(
            (i, j)
            for i, group in enumerate(self.param_groups)
            for j, param in enumerate(group["params"])
            if param in flags and not flags[param].get("do_wd", True)
        )

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._fastai_flags is not None:  # no callback took them: the groups hold the model's own parameters
            self.skip_weight_decay_where(self._fastai_flags)
        for i, group in enumerate(self.param_groups):
            lr, (mom, sqr_mom), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            for j, param in enumerate(group["params"]):
                if param.grad is None:
                    continue
                grad = param.grad
                if wd != 0 and (i, j) not in self._no_decay:
                    if group["decouple_wd"]:
                        param.mul_(1 - lr * wd)  # fastai's weight_decay
                    else:
                        grad.add_(param, alpha=wd)  # fastai's l2_reg (on the gradient, in place)
                state = self.state[param]
                if not state:
                    state["grad_avg"], state["sqr_avg"] = torch.zeros_like(grad), torch.zeros_like(grad)
                    state["step"] = torch.zeros((), dtype=torch.float32)
                state["grad_avg"].mul_(mom).add_(grad, alpha=1 - mom)
                state["sqr_avg"].mul_(sqr_mom).addcmul_(grad, grad, value=1 - sqr_mom)
                state["step"] += 1
                step = int(state["step"])
                debias1 = (1 - mom) * (1 - mom**step) / (1 - mom)  # fastai's debias(mom, 1 - mom, step)
                debias2 = (1 - sqr_mom) * (1 - sqr_mom**step) / (1 - sqr_mom)
                param.addcdiv_(state["grad_avg"], (state["sqr_avg"] / debias2).sqrt() + eps, value=-lr / debias1)
        return loss


def adopt_fastais_adam(learn: Any) -> None:
    """Where ``learn`` would train with fastai's ``Adam``, make it train with :class:`FastaiAdam` instead: its
    ``opt_func``, and an optimizer already built that has not stepped yet (``learn.freeze()`` builds one), rebuilt
    with its freezing. One that has stepped is left, and refused at ``fit``: its state is fastai's."""
    settings = _adam_settings(learn.opt_func)
    if settings is None:
        return
    learn.opt_func = partial(fastai_adam_in_wrapper, **settings)
    built = learn.opt
    if isinstance(built, Optimizer) and not any("grad_avg" in state for state in built.state.values()):
        frozen = built.frozen_idx
        learn.opt = None
        learn.create_opt()
        if frozen:
            learn.opt.freeze_to(frozen)


def fastai_adam_in_wrapper(params: Any, lr: float, **settings: Any) -> OptimWrapper:
    """The Learner's ``opt_func`` after :func:`adopt_fastais_adam`: FastaiAdam in fastai's OptimWrapper, told where
    fastai keeps its ``do_wd`` flags (the wrapper's state, which fastai's ``create_opt`` fills after this)."""
    wrapper = OptimWrapper(params, opt=FastaiAdam, lr=lr, **settings)
    wrapper.opt._fastai_flags = wrapper.state
    return wrapper


def _adam_settings(opt_func: Any) -> dict[str, Any] | None:
    """FastaiAdam's arguments for fastai's ``Adam`` or a keyword ``partial`` of it; None for anything else."""
    keywords: dict[str, Any] = {}
    if isinstance(opt_func, partial) and opt_func.func is Adam and not opt_func.args:
        keywords = dict(opt_func.keywords)
    elif opt_func is not Adam:
        return None
    unknown = set(keywords) - {*_DEFAULTS, "lr"}
    if unknown:
        return None  # not a call this module knows: left to the refusal at fit
    given = {**_DEFAULTS, **keywords}
    settings = {
        "betas": (given["mom"], given["sqr_mom"]),
        "eps": given["eps"],
        "weight_decay": given["wd"],
        "decouple_wd": given["decouple_wd"],
    }
    return {**settings, "lr": keywords["lr"]} if "lr" in keywords else settings
