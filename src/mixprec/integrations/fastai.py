"""MixprecCallback: a fastai callback that trains a Learner through :class:`mixprec.MixedPrecision`.

    learn = Learner(dls, model, loss_func=...)
    learn.to_mixprec("mixed_bf16")             # the one line, beside fastai's to_fp16()
    learn.fine_tune(3)

fastai's default optimizer (its own ``Adam``) is swapped for the same Adam as a torch optimizer
(:mod:`mixprec.integrations.fastai_adam`); any ``OptimWrapper`` around a torch optimizer is used as it is.

fastai's events, mapped onto MixedPrecision (order 10, fastai's ``MixedPrecision``'s):

    before_fit        refusals (another precision callback, a fastai Optimizer other than Adam, a callback whose
                      before_step would never run); GradientClip and GradientAccumulation noted
    before_train      (first of a fit) mp = MixedPrecision(learn.model, learn.opt.opt, policy): casts the
                      model, FP32 masters (o2), the scaler, carried on from the fit before
    before_batch      mp.autocast() in training, mixprec.autocast(policy, model) in validation
    after_loss        the region left
    before_backward   mp.backward(loss_grad), then CancelBackwardException (fastai's own backward skipped)
    before_step       GradientClip's clipping by mp.clip_grad_norm_ (the FP32 norm of the unscaled gradients),
                      mp.step(): update or skip; CancelStepException (fastai's opt.step() skipped)
    after_batch       a skipped update takes its batches back out of ``pct_train`` (every micro-batch of its
                      window under GradientAccumulation): the schedule does not move
    after_fit         mp.release(): the model FP32 again with the masters' values, the optimizer on it

A skipped update moves neither the weights, the masters, the optimizer state nor the hyper-parameter schedule
(``ParamScheduler``, driven by ``pct_train``): the next applied batch uses the hyper-parameters the skipped one
had. Between fits the model is plain FP32 (fine_tune's freeze/unfreeze, learn.save, predict see it so).

Host syncs: mp.step()'s (see :mod:`mixprec.engine.mixed_precision`) and one read per update of whether it was
applied (the schedule's gate); memory loads on the CPU.
"""

from __future__ import annotations

import contextlib
import copy
import warnings
from pathlib import Path
from typing import Any

import torch

try:
    from fastai.basics import Callback, CancelBackwardException, CancelStepException, Learner, OptimWrapper, patch
    from fastai.callback.fp16 import MixedPrecision as FastaiMixedPrecision
    from fastai.callback.fp16 import NonNativeMixedPrecision
    from fastai.callback.schedule import LRFinder
    from fastai.callback.training import GradientAccumulation, GradientClip
except (ImportError, OSError) as error:  # a torchvision built for another torch fails with OSError or ImportError
    raise ImportError(
        f"mixprec.integrations.fastai needs fastai's core without a broken torchvision ({error}). Install it "
        "as docs/integrations.md says: pip install 'mixprec[fastai]' && pip install --no-deps 'fastai>=2.8' "
        "(fastai's torchvision requirement would pull a CUDA build next to a CPU torch)."
    ) from error

import mixprec
from mixprec.integrations.adapter_arguments import check_adapter_arguments
from mixprec.integrations.fastai_adam import FastaiAdam, adopt_fastais_adam
from mixprec.persist import CheckpointError, encode_checkpoint, read_checkpoint_file, write_atomically
from mixprec.policy import EXPORT_DTYPES, export_policy
from mixprec.regions import cast_module

__all__ = ["MixprecCallback"]

SAVE_SUFFIX = ".mixprec.safetensors"  # learn.save(name) under the callback: models/name.mixprec.safetensors


class MixprecCallback(Callback):
    """Train a fastai Learner under a mixprec policy: ``learn.to_mixprec("o2_bf16")`` adds one.

    Args:
        policy: a preset, policy string or :class:`mixprec.Policy` (``auto``: chosen for the model's device).
        scaler: a :class:`mixprec.LossScaler`; default: the policy's (dynamic for fp16, none otherwise).

    Refused at ``fit`` with the fix in the message: a second precision callback (fastai's ``to_fp16()`` /
    ``to_bf16()``, another MixprecCallback), fastai's own ``Optimizer`` (pass ``opt_func=partial(OptimWrapper,
    opt=torch.optim.AdamW)``), a callback with a ``before_step`` after this one's (order > 10: the update is
    this callback's, so it would never run), loading weights in the middle of a fit.
    """

    order = FastaiMixedPrecision.order  # 10: after GradientAccumulation (6), before GradientClip (11)

    def __init__(self, policy: mixprec.Policy | str = "auto", scaler: mixprec.LossScaler | None = None) -> None:
        check_adapter_arguments("MixprecCallback", policy, scaler)  # a bad policy fails here, not at fit
        self.policy_spec, self.scaler = policy, scaler
        self.mp: mixprec.MixedPrecision | None = None  # during a fit's training, from its first batch
        self.carried: dict[str, Any] | None = None  # scalers and counters of the fits before
        self.clip: tuple[float, float] | None = None  # GradientClip's (max_norm, norm_type), applied by mp
        self.grad_norm: torch.Tensor | None = None  # the last clipped update's FP32 norm, unscaled
        self._region = contextlib.ExitStack()
        self._skipped = False  # this batch's update was skipped
        self._stepped = False  # this batch ended a window: mp.step() ran (applied or skipped)
        self._window = 0  # training batches since the last mp.step(): GradientAccumulation cancels the others
        self._lag = 0.0  # pct_train taken back for skipped updates in this fit
        self._resumed_lag: float | None = None  # a loaded save's, for a fit resumed with start_epoch
        self._before_lr_find: dict[str, Any] | None = None  # what lr_find's sweep must leave as it found it

    def __repr__(self) -> str:
        return f"MixprecCallback(policy={str(self.policy_spec)!r})"

    # -- a fit ------------------------------------------------------------------------------------
    def before_fit(self) -> None:
        vars(self.learn)[_FITTING] = self  # found by Learner.fit's cleanup after an error, even if removed by then
        self._check_callbacks()
        self.clip = None
        for cb in self.learn.cbs:
            if isinstance(cb, GradientClip):
                self.clip = (float(cb.max_norm), float(cb.norm_type))
                warnings.warn(
                    f"MixprecCallback: GradientClip(max_norm={cb.max_norm}, norm_type={cb.norm_type}) is applied by "
                    "mixprec (MixedPrecision.clip_grad_norm_): the FP32 norm of the unscaled gradients the optimizer "
                    "uses, FP32 masters' under o2. GradientClip's own before_step does not run.",
                    stacklevel=2,
                )
        self._snapshot_for_lr_find()
        resumed = any(type(cb).__name__ == "SkipToEpoch" for cb in self.learn.cbs)
        self._lag = self._resumed_lag if resumed and self._resumed_lag is not None else 0.0
        self._window = 0  # GradientAccumulation counts from 0 at each fit
        self._resumed_lag = None

    def before_train(self) -> None:
        if self.mp is None:
            self.mp = self._build()
        self.learn.pct_train -= self._lag  # TrainEvalCallback (order -10) set it from the epoch alone

    def before_batch(self) -> None:
        self._skipped = self._stepped = False
        if self.training and self.mp is not None:
            self._region.enter_context(self.mp.autocast())
        else:  # validation, get_preds, validate() before any fit
            self._region.enter_context(mixprec.autocast(self._policy(), self.learn.model))

    def after_loss(self) -> None:
        self._region.close()

    def before_backward(self) -> None:
        self.mp.backward(self.learn.loss_grad)
        raise CancelBackwardException  # fastai's own loss_grad.backward() would backpropagate it a second time

    def before_step(self) -> None:
        if self.clip is not None:
            self.grad_norm = self.mp.clip_grad_norm_(*self.clip)
        self._stepped = True
        self._skipped = not self.mp.step()  # host sync (free on the CPU): the schedule's gate
        raise CancelStepException  # mp.step() stepped the optimizer (or skipped); fastai's opt.step() must not

    def after_batch(self) -> None:
        self._region.close()  # a batch cancelled before after_loss
        if not self.training:
            return
        self._window += 1
        if not self._stepped:  # GradientAccumulation cancelled the step: the window goes on
            return
        if self._skipped:  # TrainEvalCallback (order -10) advanced pct_train once a batch: take the window back
            step = self._window / (self.learn.n_iter * self.learn.n_epoch)
            self.learn.pct_train -= step
            self._lag += step
        self._window = 0

    def after_fit(self) -> None:
        self._region.close()
        self._hand_back()
        self._restore_after_lr_find()

    def after_cancel_fit(self) -> None:
        self._hand_back()
        self._restore_after_lr_find()

    def abandon(self) -> None:
        """After a fit, however it ended: the region left, the model handed back, an lr_find sweep's weights
        undone (nothing left to do after after_fit)."""
        self._region.close()
        self._hand_back()
        self._restore_after_lr_find()

    def _snapshot_for_lr_find(self) -> None:
        """lr_find restores the model and optimizer from the .pth file it saves, which learn.save under this
        callback writes elsewhere (its check for the file fails, and the sweep's weights stayed): kept here instead,
        with this callback's scale and counters, which the sweep's skipped steps would move."""
        if not any(isinstance(cb, LRFinder) for cb in self.learn.cbs):
            self._before_lr_find = None
            return
        opt = getattr(self.learn, "opt", None)
        self._before_lr_find = {
            "model": {k: v.detach().clone() for k, v in self.learn.model.state_dict().items()},
            "opt": copy.deepcopy(opt.state_dict()) if opt is not None else None,
            "carried": copy.deepcopy(self.carried),
            "lag": self._lag,
        }

    def _restore_after_lr_find(self) -> None:
        saved, self._before_lr_find = self._before_lr_find, None
        if saved is None:
            return
        self.learn.model.load_state_dict(saved["model"])
        if saved["opt"] is not None and getattr(self.learn, "opt", None) is not None:
            self.learn.opt.load_state_dict(saved["opt"])
        self.carried, self._lag = saved["carried"], saved["lag"]

    # -- state ------------------------------------------------------------------------------------
    def mixprec_state(self) -> dict[str, Any]:
        """MixedPrecision's state to carry, without the masters (the weights are the model's, FP32, which learn.save
        saves; the next fit's masters are made from them)."""
        if self.mp is not None:
            return self.mp.state_dict(masters=False)  # host sync
        return dict(self.carried) if self.carried is not None else {}

    def load_mixprec_state(self, state: dict[str, Any], pct_lag: float) -> None:
        if self.mp is not None:
            raise RuntimeError(
                "learn.load during a fit under MixprecCallback: the FP32 masters and the scale of the running "
                "fit would be replaced under it. Load before fit, or after it."
            )
        self.carried = state or None
        self._resumed_lag = pct_lag

    @property
    def fp32_model_state(self) -> dict[str, torch.Tensor]:
        """The model's weights in FP32: the exact masters during a fit under o2, the model's own otherwise."""
        return self.mp.fp32_state_dict() if self.mp is not None else self.learn.model.state_dict()

    # -- helpers ----------------------------------------------------------------------------------
    def _policy(self) -> mixprec.Policy:
        if self.mp is not None:
            return self.mp.policy
        device = next(self.learn.model.parameters()).device
        return mixprec.get_policy(self.policy_spec, device=device)

    def _build(self) -> mixprec.MixedPrecision:
        optimizer = _torch_optimizer(self.learn.opt)
        if isinstance(optimizer, FastaiAdam):  # fastai's do_wd flags, while the groups hold the model's parameters
            optimizer.skip_weight_decay_where(self.learn.opt.state)
        accumulates = any(isinstance(cb, GradientAccumulation) for cb in self.learn.cbs)
        mp = mixprec.MixedPrecision(
            self.learn.model, optimizer, self.policy_spec, self.scaler, accumulate_in_fp32=accumulates
        )
        if self.carried:  # the fits before: their scale and counters; the masters are this model's weights now
            mp.load_state_dict(self.carried, masters=False)
        return mp

    def _hand_back(self) -> None:
        if self.mp is None:
            return
        self.mp.zero_grad()  # a fit cancelled mid-step: its gradients are not an update
        self.carried = self.mp.release()  # FP32 parameters with the masters' values; the optimizer back on them
        self.mp = None

    def _check_callbacks(self) -> None:
        cbs = list(self.learn.cbs)
        others = [cb for cb in cbs if isinstance(cb, (FastaiMixedPrecision, NonNativeMixedPrecision))]
        if others or sum(isinstance(cb, MixprecCallback) for cb in cbs) > 1:
            found = ", ".join(type(cb).__name__ for cb in cbs if isinstance(cb, (*map(type, others), MixprecCallback)))
            raise ValueError(
                f"MixprecCallback: two precision systems on one Learner ({found}); each would scale the loss and "
                "step the optimizer. Keep one: learn.to_fp32() removes fastai's, learn.remove_cb(MixprecCallback) "
                "mixprec's."
            )
        for cb in cbs:
            order = getattr(cb, "order", 0)
            if callable(getattr(cb, "before_step", None)) and order > self.order and not isinstance(cb, GradientClip):
                raise ValueError(
                    f"MixprecCallback: {type(cb).__name__} has a before_step at order {order}, after this callback's "
                    f"update (order {self.order}), so it would never run. Give it an order below {self.order} (it "
                    "then sees this step's gradients before unscaling), or use GradientClip, which mixprec applies "
                    "to the unscaled FP32 gradients."
                )


def _torch_optimizer(opt: Any) -> torch.optim.Optimizer:
    """The torch optimizer inside fastai's OptimWrapper; fastai's own Optimizer class is refused (its Adam was
    swapped by to_mixprec, unless it had stepped before)."""
    inner = getattr(opt, "opt", None) if isinstance(opt, OptimWrapper) else None
    if not isinstance(inner, torch.optim.Optimizer):
        raise ValueError(
            f"MixprecCallback: the Learner's optimizer is fastai's {type(opt).__name__}, not a torch.optim "
            "optimizer, which MixedPrecision needs (FP32 masters, skipped steps, its state in checkpoints). "
            "learn.to_mixprec() swaps fastai's default Adam for the same Adam as a torch optimizer when it is called "
            "before that optimizer's first step; for another fastai optimizer build the Learner with "
            "opt_func=partial(OptimWrapper, opt=torch.optim.AdamW) (or the torch optimizer you want), or "
            "mixprec.AdamW for pure_bf16."
        )
    return inner


def _attached(learn: Learner) -> MixprecCallback | None:
    found = [cb for cb in learn.cbs if isinstance(cb, MixprecCallback)]
    return found[0] if found else None


# -- the Learner's methods, fastai's @patch convention ----------------------------------------------
@patch
def to_mixprec(self: Learner, policy: mixprec.Policy | str = "auto", scaler: mixprec.LossScaler | None = None):
    """Train this Learner under a mixprec policy (``"mixed_bf16"``, ``"o2_fp16"``, ...); returns the Learner."""
    if any(isinstance(cb, (FastaiMixedPrecision, NonNativeMixedPrecision)) for cb in self.cbs):
        raise ValueError(
            "learn.to_mixprec: the Learner already trains under fastai's to_fp16()/to_bf16(); two precision "
            "systems would both scale the loss and step the optimizer. Call learn.to_fp32() first."
        )
    if (attached := _attached(self)) is not None:
        self.remove_cb(attached)  # a new policy replaces the old one, as to_fp16() twice does not stack
    callback = MixprecCallback(policy, scaler)  # its arguments checked before the Learner changes
    adopt_fastais_adam(self)  # fastai's default optimizer, as a torch optimizer
    return self.add_cb(callback)


_fastai_fit = Learner.fit
_FITTING = "_mixprec_fitting"  # the Learner's attribute holding the callback of the fit under way


@patch
def fit(self: Learner, *args, **kwargs):
    """fastai's fit; under MixprecCallback, a fit ended by an exception other than fastai's Cancel ones (a Ctrl-C
    in a notebook, an error in a callback: fastai then calls no after_fit) still leaves the region and hands the
    model back in FP32. Before, the process went on computing in bf16 (a plain ``a @ b`` returned bf16) and an o2
    model stayed bf16."""
    try:
        return _fastai_fit(self, *args, **kwargs)
    finally:
        # the callback this fit's before_fit saw: one given to this fit alone (fit(..., cbs=[MixprecCallback()]))
        # is removed before this runs; none where the fit ended before it (nothing entered, nothing to undo)
        cb = vars(self).pop(_FITTING, None)
        if cb is not None:
            learn, cb.learn = cb.learn, self
            cb.abandon()
            cb.learn = learn


_fastai_save, _fastai_load = Learner.save, Learner.load


@patch
def save(self: Learner, file, with_opt: bool = True, **kwargs):
    """Under MixprecCallback: the FP32 weights (the masters under o2), the optimizer and mixprec's scale and
    counters, in one checksummed file written atomically (``models/<file>.mixprec.safetensors``); fastai's
    own ``.pth`` otherwise."""
    cb = _attached(self)
    if cb is None:
        return _fastai_save(self, file, with_opt=with_opt, **kwargs)
    if kwargs:
        raise TypeError(f"learn.save under MixprecCallback: arguments for torch.save are not used: {sorted(kwargs)}.")
    path = _state_path(self, file)
    path.parent.mkdir(parents=True, exist_ok=True)
    opt = getattr(self, "opt", None)
    state = {
        "model": cb.fp32_model_state,
        "opt": opt.state_dict() if with_opt and opt is not None else {},
        "mixprec": cb.mixprec_state(),
        "pct_lag": cb._lag,
    }
    write_atomically(path, encode_checkpoint(int(getattr(self, "train_iter", 0)), state))
    return path


@patch
def load(self: Learner, file, device=None, with_opt: bool = True, strict: bool = True, **kwargs):
    """A file learn.save wrote under MixprecCallback, verified against its checksum (nothing unpickled), or
    fastai's own ``.pth``."""
    path = _state_path(self, file)
    if not path.exists():
        return _fastai_load(self, file, device=device, with_opt=with_opt, strict=strict, **kwargs)
    cb = _attached(self)
    try:
        state = read_checkpoint_file(path)
    except CheckpointError as error:
        raise CheckpointError(f"learn.load({file!r}): {error}") from error
    if cb is not None:
        cb.load_mixprec_state(state["mixprec"], float(state.get("pct_lag", 0.0)))
    model_state = state["model"]
    self.model.load_state_dict(model_state, strict=strict)
    if with_opt and state["opt"]:
        if self.opt is None:
            self.create_opt()
        self.opt.load_state_dict(state["opt"])
    if device is not None:
        self.model.to(device)
    elif hasattr(self.dls, "device"):
        self.model.to(self.dls.device)
    return self


_fastai_export = Learner.export


@patch
def export(self: Learner, fname="export.pkl", **kwargs):
    """Under MixprecCallback with a 16-bit policy: fastai's export of the Learner with its model at the policy's
    export precision (parameters and compute in bf16 or fp16, outputs FP32, in FP32 what training kept there, the
    normalization layers at least: :func:`mixprec.policy.export_policy`), and the callback set to compute in it
    when the file is loaded (``load_learner``). This Learner keeps its FP32 model. Otherwise fastai's own."""
    cb = _attached(self)
    policy = cb._policy() if cb is not None else None
    dtype = mixprec.get_format(policy.compute_dtype).name if policy is not None else None
    if dtype not in EXPORT_DTYPES:  # FP32 compute: fastai's own export
        return _fastai_export(self, fname, **kwargs)
    if cb.mp is not None:
        raise RuntimeError("learn.export during a fit under MixprecCallback: export after fit, from the FP32 model.")
    exported = export_policy(policy, dtype)
    weights = {name: value.clone() for name, value in self.model.state_dict().items()}
    # fastai's export makes a new optimizer and loads this state into it while the model is 16-bit, which casts
    # the moments to 16 bits (the next fit crashed, or under o2 trained on rounded moments): kept to load back.
    # The tensors themselves, no copy: the loading casts copies of them
    opt = getattr(self, "opt", None)
    opt_state = opt.state_dict() if opt is not None else None
    spec = cb.policy_spec
    cast_module(self.model, exported)
    cb.policy_spec = exported
    try:
        return _fastai_export(self, fname, **kwargs)
    finally:
        cb.policy_spec = spec
        cast_module(self.model, mixprec.get_policy("fp32"))
        self.model.load_state_dict(weights)  # the exact FP32 values, not their 16-bit rounding
        if opt_state is not None and self.opt is not None:
            self.opt.load_state_dict(opt_state)


def _state_path(learn: Learner, file: Any) -> Path:
    file = Path(file)
    folder = file.parent if file.is_absolute() else Path(learn.path) / learn.model_dir / file.parent
    return folder / (file.name + SAVE_SUFFIX)
