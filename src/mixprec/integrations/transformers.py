"""MixprecTrainer: the Hugging Face ``transformers.Trainer``, training through :class:`mixprec.MixedPrecision`.

    trainer = MixprecTrainer(model=model, args=args, train_dataset=data, policy="o2_bf16")  # was Trainer(...)
    trainer.train()                                       # TrainingArguments keep fp16=False, bf16=False

The Trainer's hooks, mapped onto MixedPrecision (one device, or DDP: one device per process):

    create_optimizer()                the Trainer's optimizer (for pure_bf16 its AdamW is built as mixprec.AdamW);
                                      mp = MixedPrecision(model, optimizer, policy, scaler) casts the model and
                                      makes the FP32 masters (o2) and the loss scaler; the Trainer then holds a
                                      MixprecOptimizer, whose step() is mp.step(); under DDP the model's weights
                                      are rank 0's first, so every rank's masters are too
    create_scheduler()                the Trainer's (or your) scheduler inside a GatedScheduler
    autocast_smart_context_manager()  mp.autocast() around compute_loss, in training and evaluation
    training_step()                   Trainer.training_step's single-device path, with mp.backward(loss) (loss *
                                      scale, then backward) in place of accelerator.backward(loss)
    _clip_grad_norm(), _get_grad_norm()  mp.clip_grad_norm_(max_grad_norm): unscale once, the FP32 norm of the
                                      true gradients, clip; that norm is the logged grad_norm
    optimizer.step()                  MixprecOptimizer.step() = mp.step(): the update, or a skip (inf/NaN) that
                                      leaves weights, masters and optimizer state as they were; the scale adapts
    lr_scheduler.step()               GatedScheduler: passed on only if that update was applied
    _save_scaler(), _load_scaler()    mp.state_dict() (scalers, FP32 masters, counters) in each checkpoint
    log()                             loss_scale and skipped_steps in every training log
    torch_compile=True                Accelerate compiles the model; inductor keeps the policy's 16-bit roundings
    gradient_checkpointing=True       the model's layers checkpoint through their own function, which
                                      MixedPrecision wraps: the recompute runs in the policy's region

The Trainer steps the scheduler unless ``accelerator.optimizer_step_was_skipped``; Accelerate sets that flag
only inside its own GradScaler branch of ``AcceleratedOptimizer.step()``, so mixprec could use it only by
writing Accelerate's private ``_is_overflow`` or by running a second loss scaler. The adapter gates the
scheduler itself instead.

Host syncs: mp.step()'s (see :mod:`mixprec.engine.mixed_precision`), one read per update of whether it was
applied (the scheduler gate), ``mp.stats()`` at each log and the Trainer's own ``grad_norm.item()`` there.
On the CPU all are memory loads.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import transformers
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.utils import DynamoBackend, TorchDynamoPlugin
from accelerate.utils.memory import clear_device_cache
from torch import nn
from transformers.optimization import GreedyLR

import mixprec
from mixprec.compute import dropped_roundings_note
from mixprec.distributed import copy_from_main, world
from mixprec.engine import needs_compensated_optimizer
from mixprec.integrations.adapter_arguments import check_adapter_arguments
from mixprec.integrations.gated_scheduler import GatedScheduler
from mixprec.integrations.transformers_refusals import argument_problem, optim_name, setup_problem
from mixprec.persist import CheckpointError, encode_checkpoint, read_checkpoint_file, write_atomically

__all__ = ["STATE_NAME", "GatedScheduler", "MixprecOptimizer", "MixprecTrainer"]

STATE_NAME = "mixprec_state.safetensors"  # beside the Trainer's optimizer.pt and scheduler.pt in checkpoint-N/
_LEGACY_STATE_NAME = "mixprec_state.pt"  # what earlier versions wrote (torch.save, no checksum); still read
_log = logging.getLogger(__name__)

# Trainer methods this adapter overrides or calls beyond the documented ones; a transformers whose loop does
# not route through them would step behind MixedPrecision's back, so importing the adapter fails instead.
_TRAINER_HOOKS = ("_clip_grad_norm", "_get_grad_norm", "_save_scaler", "_load_scaler", "_prepare_inputs")
_missing = [name for name in _TRAINER_HOOKS if not callable(getattr(transformers.Trainer, name, None))]
if _missing:
    raise ImportError(
        f"mixprec.integrations.transformers maps transformers.Trainer's hooks onto MixedPrecision, and transformers "
        f"{transformers.__version__} has no Trainer.{_missing[0]}; install transformers 5 (tested with 5.17 and 5.24)."
    )
# stepped on evaluation metrics, not after updates: the Trainer never steps them in its update loop
_METRIC_SCHEDULERS = (torch.optim.lr_scheduler.ReduceLROnPlateau, GreedyLR)
_TRAINER_ADAMW = ("adamw_torch", "adamw_torch_fused")  # the Trainer's AdamW, built as mixprec.AdamW for pure_bf16


class MixprecOptimizer(torch.optim.Optimizer):
    """The optimizer the Trainer steps: ``step()`` is MixedPrecision's update; everything else is ``optimizer``'s.

    Like Accelerate's ``AcceleratedOptimizer`` it wraps rather than subclasses the optimizer: ``param_groups``,
    ``state``, ``defaults``, ``state_dict()``, ``load_state_dict()`` and ``zero_grad()`` are the wrapped
    optimizer's (under o2 its parameters are the FP32 masters), so LR schedulers and checkpoints see it.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, step: Callable[[], None]) -> None:  # no super().__init__
        self.optimizer = optimizer
        self._step = step

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, groups: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = groups

    @property
    def state(self) -> Any:
        return self.optimizer.state

    @state.setter
    def state(self, state: Any) -> None:
        self.optimizer.state = state

    @property
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, defaults: dict[str, Any]) -> None:
        self.optimizer.defaults = defaults

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        self.optimizer.add_param_group(param_group)

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state_dict)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def step(self, closure: Callable[[], Any] | None = None) -> None:  # type: ignore[override]
        """``mp.step()``: unscale (if clipping has not), check, update or skip, adjust the scale, zero grads."""
        if closure is not None:
            raise ValueError(
                "MixprecOptimizer.step(closure=...): an optimizer that re-evaluates the loss inside step() "
                "(LBFGS) cannot follow loss scaling and skipped steps; use a first-order optimizer."
            )
        self._step()

    def __repr__(self) -> str:
        return f"MixprecOptimizer({self.optimizer!r})"


class MixprecTrainer(transformers.Trainer):
    """``transformers.Trainer`` under a mixprec policy: the same arguments, plus ``policy`` and ``scaler``.

    When the Trainer creates its optimizer, the adapter builds :class:`mixprec.MixedPrecision` on the model and
    that optimizer; from then on the policy's casts, region, loss scaler, FP32 masters and skip decisions are
    MixedPrecision's. An update whose gradients hold inf or NaN is skipped: no optimizer step, no scheduler
    step, the scale backs off. ``max_grad_norm`` clips the unscaled gradients, and the logged ``grad_norm`` is
    their true norm. Gradient accumulation sums 16-bit gradients in FP32 (o2; under DDP only with
    ``sync_each_batch``, else in the 16-bit ``.grad`` that DDP reduces once). Checkpoints carry
    MixedPrecision's state, so ``train(resume_from_checkpoint=...)`` continues bit for bit. With activation
    checkpointing (``gradient_checkpointing=True``) the layers recompute inside the policy's region, so
    gradients equal those without it (mixprec.checkpoint). Under DDP
    (``torchrun`` or ``accelerate launch``, one device per process) every rank skips the same updates.

    Args:
        *args, **kwargs: those of ``transformers.Trainer`` (``TrainingArguments`` with fp16=False, bf16=False).
        policy: a preset, policy string or :class:`mixprec.Policy` (``auto``: chosen for ``args.device``).
        scaler: a :class:`mixprec.LossScaler`; default: the policy's (dynamic for fp16, none otherwise).

    Raises:
        ValueError (when made, with the fix): fp16/bf16 (or their full_eval) in TrainingArguments, DeepSpeed,
            FSDP, several devices in one process, reentrant activation checkpointing, auto_find_batch_size,
            LOMO or layer-wise optimizers, Accelerate's own mixed precision. At ``train()``: a model that is not
            FP32, an optimizer the policy cannot use, a checkpoint saved under another policy.
    """

    def __init__(
        self,
        model: nn.Module | None = None,
        args: transformers.TrainingArguments | None = None,
        *trainer_args: Any,
        policy: mixprec.Policy | str = "o2_bf16",
        scaler: mixprec.LossScaler | None = None,
        **trainer_kwargs: Any,
    ) -> None:
        self._spec = policy
        # resolved now unless 'auto', which depends on the Trainer's device: a bad policy fails here
        resolved = check_adapter_arguments("MixprecTrainer", policy, scaler)
        if args is not None:  # before the Trainer builds its Accelerator from them: one clear error
            _refuse(argument_problem(args, policy))
        self.scaler = scaler
        self._mp: mixprec.MixedPrecision | None = None
        self._stepper: MixprecOptimizer | None = None
        self._unscaled = False  # the Trainer asked for this update's gradient norm: gradients are unscaled
        self._last_applied = True  # whether the last update was applied (the scheduler's gate)
        self._shown = contextlib.ExitStack()  # o2's gradients shown on the model's parameters for the callbacks
        super().__init__(model, args, *trainer_args, **trainer_kwargs)
        _refuse(setup_problem(self))
        _keep_casts_when_compiled(self.accelerator.state.dynamo_plugin)
        self.policy: mixprec.Policy = resolved or mixprec.get_policy(policy, device=self.args.device)

    def __repr__(self) -> str:
        return f"MixprecTrainer(policy={str(self._spec)!r})"

    # -- setup ------------------------------------------------------------------------------------
    @property
    def mixed_precision(self) -> mixprec.MixedPrecision:
        """The MixedPrecision of this run (e.g. ``.fp32_state_dict()`` for the exact FP32 weights)."""
        return self._require("mixed_precision")

    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        """The Trainer's optimizer, then ``MixedPrecision(model, optimizer, policy, scaler)`` on it."""
        current = self.optimizer.optimizer if isinstance(self.optimizer, AcceleratedOptimizer) else self.optimizer
        if self._stepper is not None and current is self._stepper:
            return self.optimizer  # a later train() on the same trainer: the same run continues
        origin = "you passed (optimizers=...)" if self.optimizer is not None else "the Trainer built"
        if self.optimizer is None and self._builds_compensated_adamw():
            self.optimizer = self._compensated_adamw()
        optimizer = super().create_optimizer(model)
        if origin == "the Trainer built":
            origin += f" (optim={optim_name(self.args)!r})"
        self._mp = self._mixed_precision(optimizer, origin)
        if self.accelerator.state.dynamo_plugin.backend == DynamoBackend.INDUCTOR:
            plan = self._mp.compute_plan  # inductor keeps the emulation's roundings only where it honours the option
            # with a compute_loss_func or a label smoother the Trainer takes the labels away: no loss in the model
            loss_in_model = self.compute_loss_func is None and self.label_smoother is None
            if note := dropped_roundings_note(plan.emulates, plan.dtype, self._mp.device, loss_in_model):
                _log.warning(note)
        self._stepper = MixprecOptimizer(optimizer, self._optimizer_step)
        self._unscaled, self._last_applied = False, True
        self.optimizer = self._stepper
        return self.optimizer

    def _mixed_precision(self, optimizer: torch.optim.Optimizer, origin: str) -> mixprec.MixedPrecision:
        """MixedPrecision on the model and ``optimizer``; its refusals name the trainer and the optimizer."""
        # under DDP, Accelerate wraps the model after this and broadcasts rank 0's weights into it; the masters are
        # made here, so they must be made from rank 0's weights too, or each rank would train its own
        copy_from_main([*self.model.parameters(), *self.model.buffers()])
        try:
            return mixprec.MixedPrecision(
                self.model, optimizer, self.policy, self.scaler, accumulate_in_fp32=self._accumulates_in_fp32()
            )
        except (TypeError, ValueError) as error:
            hint = (
                " With MixprecTrainer: optim='adamw_torch' (built as mixprec.AdamW), or "
                "optimizers=(mixprec.AdamW(model.parameters(), ...), None)."
                if needs_compensated_optimizer(self.policy)
                else ""
            )
            raise ValueError(
                f"{self!r}: MixedPrecision refused the model and the {type(optimizer).__name__} {origin}: {error}{hint}"
            ) from error

    def _accumulates_in_fp32(self) -> bool:
        """o2 with gradient accumulation: each micro-batch's 16-bit gradients are added into FP32 buffers. Under
        DDP only if every micro-batch is all-reduced (``sync_each_batch``): the Trainer's ``no_sync`` reduces
        the last micro-batch's ``.grad`` alone, so gradients moved out of it before would stay this rank's.
        Otherwise they add up in the 16-bit ``.grad``, which DDP reduces once, as without mixprec."""
        if self.args.gradient_accumulation_steps == 1:
            return False
        synced_each = self.accelerator.gradient_state.plugin_kwargs.get("sync_each_batch", False)
        return not world().distributed or bool(synced_each)

    def _builds_compensated_adamw(self) -> bool:
        """pure_bf16 with the Trainer's own AdamW: build it as mixprec.AdamW, which compensates bf16 rounding."""
        return (
            needs_compensated_optimizer(self.policy)
            and self.optimizer_cls_and_kwargs is None
            and optim_name(self.args) in _TRAINER_ADAMW
        )

    def _compensated_adamw(self) -> mixprec.AdamW:
        """mixprec.AdamW with the Trainer's groups (no weight decay for biases and norms) and hyperparameters."""
        decay = set(self.get_decay_parameter_names(self.model))
        trained = [(name, p) for name, p in self.model.named_parameters() if p.requires_grad]
        groups = [
            {"params": [p for name, p in trained if name in decay], "weight_decay": self.args.weight_decay},
            {"params": [p for name, p in trained if name not in decay], "weight_decay": 0.0},
        ]
        return mixprec.AdamW(
            groups,
            lr=self.args.learning_rate,
            betas=(self.args.adam_beta1, self.args.adam_beta2),
            eps=self.args.adam_epsilon,
        )

    def create_scheduler(self, num_training_steps: int, optimizer: torch.optim.Optimizer | None = None) -> Any:
        """The Trainer's scheduler, gated: it does not advance after a skipped update."""
        scheduler = super().create_scheduler(num_training_steps, optimizer)
        if not isinstance(scheduler, (GatedScheduler, *_METRIC_SCHEDULERS)):
            self.lr_scheduler = GatedScheduler(scheduler, self._gate_open)
        return self.lr_scheduler

    def _gate_open(self) -> bool:
        return self._last_applied

    def _require(self, caller: str) -> mixprec.MixedPrecision:
        if self._mp is None:
            raise RuntimeError(
                f"MixprecTrainer.{caller}: there is no MixedPrecision yet; it is built when the Trainer creates "
                "its optimizer (trainer.train(), or trainer.create_optimizer())."
            )
        return self._mp

    # -- the training step ------------------------------------------------------------------------
    def autocast_smart_context_manager(self, cache_enabled: bool | None = True) -> Any:
        """The policy's region around ``compute_loss``: ``mp.autocast()``, or before training (evaluation
        only) ``mixprec.autocast(policy, model)`` on the model as it is."""
        if self._mp is not None:
            return self._mp.autocast()
        return mixprec.autocast(self.policy, self.model)

    def training_step(
        self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch: torch.Tensor | int | None = None
    ) -> torch.Tensor:
        """Trainer.training_step (one device per process), ``mp.backward(loss)`` for ``accelerator.backward``.

        The loss is divided for gradient accumulation exactly as the Trainer does (unless ``compute_loss``
        already normalized it over the accumulated batch); the returned, logged loss is unscaled.
        """
        mp = self._require("training_step")
        model.train()
        if hasattr(self.optimizer, "train") and callable(self.optimizer.train):
            self.optimizer.train()  # schedule-free optimizers
        inputs = self._prepare_inputs(inputs)
        with self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
        del inputs
        every = self.args.torch_empty_cache_steps
        if every is not None and self.state.global_step % every == 0:
            clear_device_cache()
        if not self._loss_is_scaled_for_ga(num_items_in_batch):
            loss = loss / self.current_gradient_accumulation_steps
        mp.backward(loss)
        return loss.detach()

    def _loss_is_scaled_for_ga(self, num_items_in_batch: Any) -> bool:
        """The Trainer's rule: set by the user, or the loss was normalized by num_items_in_batch."""
        if getattr(self, "loss_is_scaled_for_ga", None) is not None:
            return bool(self.loss_is_scaled_for_ga)
        by_items = self.model_accepts_loss_kwargs and num_items_in_batch is not None
        return bool(by_items or self.compute_loss_func is not None)

    def _clip_grad_norm(self, model: nn.Module) -> torch.Tensor:
        """``mp.clip_grad_norm_(max_grad_norm)``: the FP32 norm of the unscaled gradients the optimizer uses."""
        norm = self._require("_clip_grad_norm").clip_grad_norm_(float(self.args.max_grad_norm))
        self._unscaled = True
        return norm

    def _get_grad_norm(self, model: nn.Module, grad_norm: torch.Tensor | None = None) -> torch.Tensor:
        """The true gradient norm (``max_grad_norm=0``: measured by ``mp.clip_grad_norm_(inf)``, no clip)."""
        mp = self._require("_get_grad_norm")
        if grad_norm is None:
            grad_norm = mp.clip_grad_norm_(math.inf)
            self._unscaled = True
        # next: on_pre_optimizer_step. o2 keeps the gradients on the FP32 masters: callbacks that read p.grad there
        # see them on the model's parameters (an edit goes back to the master before the step)
        if _callbacks_read_gradients(self.callback_handler.callbacks):
            self._shown.enter_context(mp.gradients_on_model())
        return grad_norm

    def _optimizer_step(self) -> None:
        """What ``trainer.optimizer.step()`` runs: ``mp.step()``, remembered for the scheduler's gate."""
        mp = self._require("optimizer.step")
        if not self._unscaled:
            raise RuntimeError(
                f"MixprecTrainer: transformers {transformers.__version__} stepped the optimizer without asking for "
                "the gradient norm first (Trainer._clip_grad_norm / _get_grad_norm), so it may have clipped scaled "
                "gradients behind MixedPrecision's back. Its training loop differs from the one this adapter maps "
                "(transformers 5.17 to 5.24); use one of those, or mixprec.MixedPrecision in a loop of your own."
            )
        self._unscaled = False
        self._shown.close()  # the callbacks' edits of the gradients on the model's parameters, to the masters
        self._last_applied = bool(mp.step())  # host sync (free on the CPU): the scheduler's gate

    # -- logs, statistics, checkpoints --------------------------------------------------------------
    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Every training log (the one with ``loss``) also gets ``loss_scale`` and ``skipped_steps``."""
        if self._mp is not None and "loss" in logs:
            stats = self._mp.stats()  # host sync (free on the CPU)
            logs = {**logs, "loss_scale": float(stats.scale), "skipped_steps": stats.skipped_steps}
        super().log(logs, start_time)

    def stats(self) -> mixprec.Stats:
        """``mp.stats()``: scale, step and overflow counts, bytes per parameter. Host sync."""
        return self._require("stats").stats()

    def _save_scaler(self, output_dir: str) -> None:
        """The Trainer's scaler slot of a checkpoint: MixedPrecision's state, in ``STATE_NAME``."""
        super()._save_scaler(output_dir)
        if self._mp is not None and self.args.should_save:
            os.makedirs(output_dir, exist_ok=True)
            # checksummed safetensors, written atomically: a crash leaves the old file or the new one, and a
            # damaged or edited file is refused on resume instead of restoring wrong masters or scale
            data = encode_checkpoint(self.state.global_step, self._mp.state_dict())
            write_atomically(Path(output_dir) / STATE_NAME, data)

    def _load_scaler(self, checkpoint: str | None) -> None:
        """Restore MixedPrecision's state after the Trainer restored the model, optimizer and scheduler."""
        super()._load_scaler(checkpoint)
        if checkpoint is not None:
            self._load_state(checkpoint)

    def _load_state(self, checkpoint: str, keep_counters: bool = False) -> None:
        path, legacy = os.path.join(checkpoint, STATE_NAME), os.path.join(checkpoint, _LEGACY_STATE_NAME)
        if os.path.isfile(path):
            try:
                state = read_checkpoint_file(Path(path))  # verified against its checksum; nothing unpickled
            except CheckpointError as error:
                raise ValueError(
                    f"{self!r}: cannot resume from {checkpoint}: {error}. Resume from an earlier checkpoint-N, or "
                    f"delete {STATE_NAME} to continue with a fresh loss scaler and FP32 masters made from the saved "
                    "weights."
                ) from None
        elif os.path.isfile(legacy):  # an earlier mixprec's file (no checksum): tensors and plain values only
            path = legacy
            device = self.args.device  # "cpu:0" in a process of a CPU DDP run, which torch.load cannot map to
            state = torch.load(path, map_location="cpu" if device.type == "cpu" else device, weights_only=True)
        else:
            _log.warning(
                "%s has no %s (a checkpoint of transformers.Trainer, or saved with save_only_model): MixprecTrainer "
                "continues with a fresh loss scaler and FP32 masters made from the checkpoint's weights.",
                checkpoint,
                STATE_NAME,
            )
            return
        if keep_counters:  # the run's step and skip counts, not the checkpoint's: stats() still counts them all
            state = {**state, "counters": self._require("train").state_dict()["counters"]}
        try:
            self._require("_load_scaler").load_state_dict(state)
        except ValueError as error:
            raise ValueError(f"{self!r}: cannot resume from {path}: {error}") from error

    def train(self, *args: Any, **kwargs: Any) -> Any:
        """``Trainer.train``; with ``load_best_model_at_end``, MixedPrecision's scale and masters are the best
        checkpoint's too, so the masters (``fp32_state_dict()``) match the weights the Trainer loaded; its
        counters stay the run's (``stats()`` counts every update of the run)."""
        output = super().train(*args, **kwargs)
        best = self.state.best_model_checkpoint
        if self.args.load_best_model_at_end and best is not None and os.path.isdir(best) and self._mp is not None:
            self._load_state(best, keep_counters=True)
        return output


# -- refusals -------------------------------------------------------------------------------------
def _refuse(problem: str | None) -> None:
    if problem is not None:
        raise ValueError(f"MixprecTrainer: {problem}")


def _keep_casts_when_compiled(plugin: TorchDynamoPlugin) -> None:
    """``torch_compile=True`` (Accelerate compiles the model in ``prepare``): inductor is told to keep the 16-bit
    roundings of the policy's casts (``emulate_precision_casts``), which it would otherwise fuse away, so the
    compiled model computes what the eager one does, emulated ops included. torch.compile takes a mode or
    options, not both: a ``torch_compile_mode`` is passed as the inductor options it stands for."""
    if plugin.backend != DynamoBackend.INDUCTOR:
        return  # no compile, or a backend that runs the traced ops as they are
    options = dict(plugin.options or {})
    if plugin.mode not in (None, "default"):
        from torch._inductor import list_mode_options  # imports the compiler: only when compiling

        options = {**list_mode_options(plugin.mode), **options}
        plugin.mode = "default"
    plugin.options = {**options, "emulate_precision_casts": True}


def _callbacks_read_gradients(callbacks: list[Any]) -> bool:
    """Whether a callback overrides ``on_pre_optimizer_step``, where it may read ``p.grad`` (under o2 showing the
    gradients costs a 16-bit copy of each, so only then)."""
    base = transformers.TrainerCallback.on_pre_optimizer_step
    return any(type(callback).on_pre_optimizer_step is not base for callback in callbacks)
