"""MixprecPrecision: a Lightning precision plugin that trains through :class:`mixprec.MixedPrecision`.

    trainer = L.Trainer(plugins=[MixprecPrecision("o2_bf16")])  # the one line added
    trainer.fit(model)                                          # the LightningModule is unchanged

Lightning's hooks, mapped onto MixedPrecision (automatic optimization, one optimizer; one device, DDP, or
FSDP2 through ModelParallelStrategy with ``mixprec.fully_shard`` in ``configure_model``):

    connect(model, [optimizer], schedulers)  mp = MixedPrecision(model, optimizer, policy, scaler): casts the
                                             model, makes FP32 masters (o2) and the loss scaler; wraps every
                                             per-step LR scheduler in a GatedScheduler; under DDP with
                                             16-bit parameters (o2, pure), DDP again around the cast model
    train_step_context()                     mp.autocast() around training_step
    forward_context() (val, test, predict)   mixprec.autocast(policy, model)
    backward(loss)                           mp.backward(loss): loss * scale, then backward
    optimizer_step(optimizer, closure)       closure() (training_step, zero_grad, backward); mp.unscale_();
                                             on_before_optimizer_step and gradient clipping, on the true
                                             gradients; mp.step(): update or skip, adjust the scale; log
                                             mixprec/loss_scale and mixprec/skipped_steps
    clip_grad_by_norm(optimizer, value)      mp.clip_grad_norm_(value): FP32 norm of the unscaled gradients
    state_dict() / load_state_dict()         mp.state_dict() (scalers, FP32 masters, counters) in checkpoints

Lightning steps LR schedulers itself after the optimizer step; a GatedScheduler's ``step()`` does nothing
when that update was skipped (inf/NaN gradients), so the schedule counts applied updates only.

Host syncs: mp.step()'s (see :mod:`mixprec.engine.mixed_precision`), then one read per update of whether it
was applied (the scheduler gate) and, with ``log_stats``, ``mp.stats()``; all are memory loads on the CPU.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import GradClipAlgorithmType, rank_zero_warn
from torch import nn

import mixprec
from mixprec.checks import flag
from mixprec.compute import dropped_roundings_note
from mixprec.integrations.adapter_arguments import check_adapter_arguments
from mixprec.integrations.gated_scheduler import GatedScheduler
from mixprec.parallel import is_sharded

__all__ = ["GatedScheduler", "MixprecPrecision"]

_LIGHTNING_DTYPE_NAMES = {torch.float16: "16", torch.bfloat16: "bf16"}


class MixprecPrecision(Precision):
    """Train a LightningModule under a mixprec policy: ``L.Trainer(plugins=[MixprecPrecision("o2_bf16")])``.

    At setup (``connect``) the plugin builds :class:`mixprec.MixedPrecision` on the LightningModule and
    the optimizer of ``configure_optimizers``; from then on the policy's casts, region, loss scaler, FP32
    masters and skip decisions are MixedPrecision's. An update whose gradients hold inf or NaN is skipped:
    no optimizer step, no per-step scheduler step, the scale backs off. Gradient clipping
    (``gradient_clip_val``) sees the unscaled gradients. Checkpoints carry MixedPrecision's state, so a
    resumed run continues bit for bit.

    Args:
        policy: a preset, policy string or :class:`mixprec.Policy` (``auto``: chosen for the model's device).
        scaler: a :class:`mixprec.LossScaler`; default: the policy's (dynamic for fp16, none otherwise).
        log_stats: log ``mixprec/loss_scale`` and ``mixprec/skipped_steps`` at the updates Lightning logs
            (every ``log_every_n_steps``), with ``LightningModule.log``: the loggers and
            ``trainer.callback_metrics`` see them.
        fp32_after_fit: at the end of ``fit`` hand the LightningModule back in FP32, its parameters holding the
            masters' exact values (:meth:`mixprec.MixedPrecision.release`), so that evaluation, saving or another
            fit after it see a plain FP32 module; a second ``fit`` continues the scale and counters. False: the
            module stays in the policy's dtypes (o2: 16-bit, the masters in ``mixed_precision``).
        allow_optimizer_step_override: train a LightningModule that overrides ``optimizer_step`` (refused by
            default: a learning rate set there from ``trainer.global_step``, as Lightning's warm-up recipe does,
            moves on skipped updates, which the plugin cannot hold). True where the override changes no
            hyper-parameter (it must still call ``optimizer.step(closure=...)``).

    Raises (at ``trainer.fit``, with the fix in the message):
        ValueError: several optimizers, manual optimization, an overridden ``LightningModule.backward`` (or
            ``optimizer_step``, without ``allow_optimizer_step_override``),
            FSDPStrategy (FSDP1) or DeepSpeed, ModelParallelStrategy with tensor parallelism or an unsharded
            model,
            a per-step LR scheduler with ``frequency`` > 1, LBFGS, a model that is not FP32, or an
            optimizer the policy cannot use (``pure_bf16`` needs ``mixprec.AdamW``).
    """

    def __init__(
        self,
        policy: mixprec.Policy | str = "auto",
        scaler: mixprec.LossScaler | None = None,
        *,
        log_stats: bool = True,
        fp32_after_fit: bool = True,
        allow_optimizer_step_override: bool = False,
    ) -> None:
        self._spec = policy
        # resolved now unless 'auto', which depends on the model's device: a bad policy fails here
        self.policy: mixprec.Policy | None = check_adapter_arguments("MixprecPrecision", policy, scaler)
        self.scaler = scaler
        self.log_stats = flag(log_stats, "MixprecPrecision(log_stats=...)")
        self.fp32_after_fit = flag(fp32_after_fit, "MixprecPrecision(fp32_after_fit=...)")
        self.allow_optimizer_step_override = flag(
            allow_optimizer_step_override, "MixprecPrecision(allow_optimizer_step_override=...)"
        )
        self._mp: mixprec.MixedPrecision | None = None
        self._carried: dict[str, Any] | None = None  # a released fit's state, without masters: the next one's start
        self._shown = contextlib.ExitStack()  # o2's gradients shown on the module's parameters, while hooks run
        self._show_gradients = False  # whether user hooks may read p.grad before the update (set at connect)
        self._module: nn.Module | None = None
        self._fitting = False
        self._backward_pending = False  # a backward since the last update: there is something to step
        self._last_applied = True  # whether the last update was applied (the schedulers' gate)
        if self.policy is not None:
            self.precision = _lightning_precision(self.policy)

    def __repr__(self) -> str:
        return f"MixprecPrecision(policy={str(self._spec)!r})"

    # -- setup ------------------------------------------------------------------------------------
    @property
    def mixed_precision(self) -> mixprec.MixedPrecision:
        """The MixedPrecision of this fit (e.g. ``.fp32_state_dict()`` for the exact FP32 weights)."""
        return self._require("mixed_precision")

    def connect(self, model: nn.Module, optimizers: list[torch.optim.Optimizer], lr_schedulers: list[Any]) -> tuple:
        """Build MixedPrecision on the model and its one optimizer; gate the per-step LR schedulers.

        Outside ``fit`` (``validate``/``test``/``predict``) the model is evaluated in the policy's region
        with its parameters left as they are, so a later ``fit`` still builds exact FP32 masters from them.
        """
        module = _lightning_module(model)
        self._module = module
        self._fitting = module.trainer.state.fn == TrainerFn.FITTING
        if not self._fitting:
            self.policy = mixprec.get_policy(self._spec, device=_device_of(module))
            self.precision = _lightning_precision(self.policy)
            return model, optimizers, lr_schedulers
        _check_trainable(module, optimizers, self.allow_optimizer_step_override)
        _check_model_parallel(module)
        for config in lr_schedulers:
            _check_gateable(config)
        try:
            self._mp = mixprec.MixedPrecision(
                model, optimizers[0], self._spec, self.scaler, accumulate_in_fp32=_accumulates_in_fp32(module)
            )
        except (TypeError, ValueError) as error:
            cast = any(p.dtype != torch.float32 for p in module.parameters()) and not is_sharded(module)
            hint = (
                " (a previous fit under an o2 or pure policy casts the LightningModule in place: fit a freshly "
                "built one; trainer.fit(fresh_module, ckpt_path=...) resumes that fit)"
                if cast
                else ""
            )
            raise ValueError(
                f"{self!r}: MixedPrecision refused the LightningModule and the {type(optimizers[0]).__name__} "
                f"that configure_optimizers returned: {error}{hint}"
            ) from error
        if self._carried is not None:  # a fit before this one, handed back in FP32: its scale and counters go on
            self._mp.load_state_dict(self._carried, masters=False)
        if note := _compiled_roundings_note(module, self._mp):
            rank_zero_warn(note)
        model = _rewrap_ddp(model, module)  # o2/pure under strategy="ddp": buckets for 16-bit gradients
        self.policy = self._mp.policy
        self.precision = _lightning_precision(self.policy)
        self._last_applied, self._backward_pending = True, False
        self._show_gradients = _hooks_read_gradients(module)  # the module and the callbacks of this fit
        gated = [_gated(config, self._gate_open) for config in lr_schedulers]
        return model, optimizers, gated

    def fully_shard(self, module: nn.Module, *, mesh: Any = None, **options: Any) -> nn.Module:
        """``mixprec.fully_shard(module, policy, mesh=mesh, **options)`` with this plugin's policy, for
        ``configure_model`` under ModelParallelStrategy::

            def configure_model(self):
                self.trainer.precision_plugin.fully_shard(self.model, mesh=self.device_mesh["data_parallel"])

        ``auto`` is resolved for the mesh's device type (the module may still be on the meta device).
        ``options``: ``reduce_dtype``, ``units`` (see :func:`mixprec.fully_shard`).
        """
        device = torch.device(mesh.device_type) if mesh is not None else _device_of(module)
        policy = self.policy if self.policy is not None else mixprec.get_policy(self._spec, device=device)
        return mixprec.fully_shard(module, policy, mesh=mesh, **options)

    def _gate_open(self) -> bool:
        return self._last_applied

    def _require(self, caller: str) -> mixprec.MixedPrecision:
        if self._mp is None:
            raise RuntimeError(
                f"MixprecPrecision.{caller}: the plugin has no MixedPrecision yet; it builds one when "
                "Lightning connects it to the model and optimizer (trainer.fit)."
            )
        return self._mp

    # -- the training step ------------------------------------------------------------------------
    @contextlib.contextmanager
    def train_step_context(self) -> Iterator[None]:
        with self._require("train_step_context").autocast():
            yield

    @contextlib.contextmanager
    def forward_context(self) -> Iterator[None]:
        if self.policy is None or self._module is None:
            raise RuntimeError("MixprecPrecision.forward_context before Lightning connected the plugin to the model.")
        with mixprec.autocast(self.policy, self._module):
            yield

    def backward(self, tensor: torch.Tensor, model: Any, optimizer: Any, *args: Any, **kwargs: Any) -> None:
        """``mp.backward(loss)``: the scaled loss's backward (LightningModule.backward is not called)."""
        retain_graph = kwargs.pop("retain_graph", None)
        if args or kwargs:
            raise TypeError(
                f"MixprecPrecision.backward: received arguments MixedPrecision.backward does not take: {args} {kwargs}."
            )
        self._require("backward").backward(tensor, retain_graph=retain_graph)
        self._backward_pending = True

    def optimizer_step(self, optimizer: Any, model: Any, closure: Callable[[], Any], **kwargs: Any) -> Any:
        """Run the closure, unscale, let Lightning's hooks and clipping see the true gradients, then
        ``mp.step()``: the update, or a skip that leaves weights, optimizer and schedulers as they were."""
        mp = self._require("optimizer_step")
        if optimizer is not mp.optimizer:
            raise ValueError(
                "MixprecPrecision.optimizer_step: received an optimizer other than the one MixedPrecision wraps; "
                "the plugin trains the single optimizer of configure_optimizers."
            )
        if kwargs:
            raise TypeError(f"MixprecPrecision.optimizer_step: optimizer.step() arguments are not supported: {kwargs}.")
        closure_result = closure()
        if not self._backward_pending:  # training_step returned None: no gradients, nothing to update
            self._after_closure(model, optimizer)
            self._last_applied = False  # nor a schedule step (the gate kept the last update's verdict)
            return closure_result
        mp.unscale_(on_model=False)  # Lightning clips the optimizer's gradients (o2: the masters)
        # o2 keeps the gradients on the FP32 masters: hooks that read p.grad see them on the module's parameters
        if self._show_gradients:
            self._shown.enter_context(mp.gradients_on_model())
        with self._shown:  # closed by clip_gradients already where Lightning clips
            self._after_closure(model, optimizer)  # on_before_optimizer_step, then clip_gradients
        self._backward_pending = False
        self._last_applied = bool(mp.step())  # host sync (free on the CPU): the schedulers' gate
        # at Lightning's logging cadence (log_every_n_steps), as its own monitors log: module.log costs
        # about a millisecond a call, a tenth of a small model's step
        if self.log_stats and getattr(getattr(model.trainer, "_logger_connector", None), "should_update_logs", True):
            self._log_stats(model)
        return closure_result

    def clip_gradients(
        self, optimizer: Any, clip_val: float = 0.0, gradient_clip_algorithm: Any = GradClipAlgorithmType.NORM
    ) -> None:
        """Lightning's clipping (norm or value) of this update's unscaled gradients; none after a
        training_step that returned None."""
        self._shown.close()  # gradients a hook edited on the module's parameters go to the masters first (o2)
        if self._backward_pending:
            super().clip_gradients(optimizer, clip_val, gradient_clip_algorithm)

    def clip_grad_by_norm(self, optimizer: Any, clip_val: float) -> None:
        """``mp.clip_grad_norm_``: the FP32 norm of the unscaled gradients the optimizer will use."""
        self._require("clip_grad_by_norm").clip_grad_norm_(float(clip_val))

    def _log_stats(self, module: pl.LightningModule) -> None:
        stats = self._require("stats").stats()  # host sync (free on the CPU)
        for name, value in (("mixprec/loss_scale", stats.scale), ("mixprec/skipped_steps", stats.skipped_steps)):
            module.log(name, float(value), on_step=True, on_epoch=False, batch_size=1)

    def stats(self) -> mixprec.Stats:
        """``mp.stats()``: scale, step and overflow counts, bytes per parameter. Host sync."""
        return self._require("stats").stats()

    # -- checkpoints ------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """MixedPrecision's state (scalers, FP32 masters, counters); empty before ``fit``. After a fit handed the
        module back in FP32, the state without masters (the module's weights are the exact values)."""
        if self._mp is not None and self._mp.released:
            return self._carried
        return self._mp.state_dict() if self._mp is not None else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore MixedPrecision's state when fitting; ignored when only evaluating (the model's own
        weights are then the policy's rounding of the masters)."""
        if self._fitting and self._mp is not None:
            # without masters: saved after a fit that handed the module back, whose FP32 weights are the masters
            self._mp.load_state_dict(state_dict, masters="masters" in state_dict)

    def teardown(self) -> None:
        """The end of a fit (and of validate, test, predict): with ``fp32_after_fit``, the fit's module handed back
        in FP32 with the masters' values (Lightning has moved it to the CPU by now: the values follow it)."""
        super().teardown()
        if self.fp32_after_fit and self._fitting and self._mp is not None and not self._mp.released:
            self._mp.zero_grad()  # a fit that ended in an exception mid-step: its gradients are not an update
            self._carried = self._mp.release()


# -- checks and helpers ---------------------------------------------------------------------------
def _accumulates_in_fp32(module: pl.LightningModule) -> bool:
    """o2 with ``accumulate_grad_batches`` > 1: each micro-batch's 16-bit gradients are added into FP32 buffers,
    not rounded to 16 bits at each addition (MixedPrecision ignores it for policies without FP32 masters). One
    process only: under DDP Lightning's ``no_sync`` reduces the last micro-batch's ``.grad`` alone, so
    gradients moved out of it before would stay this rank's; there they add up in ``.grad``, reduced once."""
    trainer = module.trainer
    return trainer.accumulate_grad_batches > 1 and trainer.world_size == 1


def _hooks_read_gradients(module: pl.LightningModule) -> bool:
    """Whether user code runs between the unscale and the update, where it may read ``p.grad``:
    ``on_before_optimizer_step`` or ``configure_gradient_clipping`` overridden, in the module or a callback.
    Without one the gradients are not shown (under o2 that costs a 16-bit copy of each)."""
    hooks = [(module, pl.LightningModule, "on_before_optimizer_step")]
    hooks.append((module, pl.LightningModule, "configure_gradient_clipping"))
    hooks += [(callback, pl.Callback, "on_before_optimizer_step") for callback in module.trainer.callbacks]
    return any(getattr(type(owner), name) is not getattr(base, name) for owner, base, name in hooks)


def _lightning_precision(policy: mixprec.Policy) -> str:
    """The nearest of Lightning's precision names, for ``trainer.precision`` (informational only)."""
    if policy.compute_dtype not in _LIGHTNING_DTYPE_NAMES:
        return "32-true"
    if policy.is_pure:  # pure_bf16: no FP32 copy anywhere
        return f"{_LIGHTNING_DTYPE_NAMES[policy.param_dtype]}-true"
    return f"{_LIGHTNING_DTYPE_NAMES[policy.compute_dtype]}-mixed"


def _device_of(module: nn.Module) -> torch.device:
    first = next(module.parameters(), None)
    return first.device if first is not None else torch.device("cpu")


def _lightning_module(model: nn.Module) -> pl.LightningModule:
    """The LightningModule, also inside DDP (``strategy="ddp"``)."""
    if isinstance(model, pl.LightningModule):
        return model
    inner = getattr(model, "module", None)
    if isinstance(model, nn.parallel.DistributedDataParallel) and isinstance(inner, pl.LightningModule):
        return inner
    raise ValueError(
        f"MixprecPrecision runs on one device, under strategy='ddp' or under ModelParallelStrategy (FSDP2); the "
        f"strategy wrapped the model in {type(model).__name__}. FSDPStrategy (FSDP1) and DeepSpeed are not "
        "supported: for sharding, use ModelParallelStrategy and mixprec.fully_shard in configure_model "
        "(docs/integrations.md)."
    )


def _compiled_roundings_note(module: pl.LightningModule, mp: mixprec.MixedPrecision) -> str | None:
    """The warning for a LightningModule compiled by inductor (``trainer.fit(torch.compile(model))``) that
    would lose the 16-bit roundings of the policy's emulated ops; None where nothing is lost.

    Lightning keeps the compile context (``from_compiled``); its backend and inductor options are read from
    torch.compile's wrapper (private attributes: where they cannot be read, inductor with unknown options
    is assumed, the default backend)."""
    context = getattr(module, "_compiler_ctx", None)
    plan = mp.compute_plan
    if not context or not plan.emulates:
        return None
    wrapper = getattr(getattr(context.get("dynamo_ctx"), "callback", None), "_torchdynamo_orig_backend", None)
    backend = getattr(wrapper, "_torchdynamo_orig_backend", None)
    if getattr(backend, "__name__", "inductor") != "inductor":
        return None  # eager, aot_eager, ...: the traced casts run as they are
    options = getattr(backend, "config", None)
    if isinstance(options, dict) and not options.get("emulate_precision_casts"):
        name = mixprec.get_format(plan.dtype).name
        return (
            "MixprecPrecision: the LightningModule was compiled by inductor without emulate_precision_casts, "
            f"which fuses away the roundings of the policy's emulated {name} ops: they would compute in FP32 "
            "(closer to FP32 than the run they emulate, with fewer loss-scale overflows). Compile with "
            "torch.compile(model, options={'emulate_precision_casts': True})."
        )
    return dropped_roundings_note(plan.emulates, plan.dtype, mp.device)


def _rewrap_ddp(old: nn.Module, module: pl.LightningModule) -> nn.Module:
    """DDP again around a module whose parameters MixedPrecision cast to 16 bits: DDP builds its gradient
    buckets per dtype when it wraps, so the FP32 wrapper Lightning made cannot take 16-bit gradients.

    The strategy wraps it with its own arguments and hooks; the old wrapper's autograd hooks are removed
    (they would be inert anyway: a reducer only acts after its own wrapper's forward).
    """
    if not isinstance(old, nn.parallel.DistributedDataParallel) or all(
        p.dtype == torch.float32 for p in module.parameters()
    ):
        return old
    remove_hooks = getattr(old, "_remove_autograd_hooks", None)
    if remove_hooks is not None:
        remove_hooks()
    strategy = module.trainer.strategy
    strategy.model = module
    strategy.configure_ddp()  # DDPStrategy: DistributedDataParallel(module, **its kwargs), comm hooks
    return strategy.model


def _check_trainable(
    module: pl.LightningModule, optimizers: list[torch.optim.Optimizer], allow_optimizer_step_override: bool = False
) -> None:
    """Refuse, with the fix, what the plugin cannot train correctly."""
    problem = None
    if len(optimizers) > 1:
        problem = (
            f"configure_optimizers returned {len(optimizers)} optimizers; MixprecPrecision trains one. "
            "Put the parameters in one optimizer (one param group each, if they need their own settings)."
        )
    elif not module.automatic_optimization:
        problem = (
            "the LightningModule uses manual optimization (automatic_optimization=False); MixprecPrecision "
            "drives Lightning's automatic optimization. Use automatic optimization, or call "
            "mixprec.MixedPrecision yourself in training_step without the plugin."
        )
    elif type(module).backward is not pl.LightningModule.backward:
        problem = (
            f"{type(module).__name__} overrides LightningModule.backward; the plugin runs the backward pass "
            "itself (mp.backward: loss * scale, then backward), so the override would be skipped. Remove it."
        )
    elif type(module).optimizer_step is not pl.LightningModule.optimizer_step and not allow_optimizer_step_override:
        problem = (
            f"{type(module).__name__} overrides LightningModule.optimizer_step. A learning rate set there from "
            "trainer.global_step (Lightning's warm-up recipe) moves on skipped updates, which global_step counts, "
            "and the plugin cannot hold it. Put the schedule in configure_optimizers as a per-step LR scheduler "
            "(held on a skipped update), or, where the override changes no hyper-parameter, pass "
            "MixprecPrecision(..., allow_optimizer_step_override=True)."
        )
    if problem is not None:
        raise ValueError(f"MixprecPrecision: {problem}")


def _check_model_parallel(module: pl.LightningModule) -> None:
    """Under ModelParallelStrategy (FSDP2), data parallelism only, sharded by mixprec.fully_shard.

    Tensor parallelism splits single weights across ranks in ways the gradient norm and the overflow
    check do not follow; a model left unsharded would train apart on every rank (the strategy adds no
    gradient averaging of its own).
    """
    strategy = module.trainer.strategy
    if not isinstance(strategy, ModelParallelStrategy):
        return
    mesh = strategy.device_mesh
    fix = (
        "shard the model in configure_model with mixprec.fully_shard(self.model, policy, "
        'mesh=self.device_mesh["data_parallel"]), the same policy as the plugin\'s'
    )
    if mesh["tensor_parallel"].size() > 1:
        raise ValueError(
            f"MixprecPrecision: ModelParallelStrategy with tensor_parallel_size={mesh['tensor_parallel'].size()}; "
            "the plugin trains data-parallel FSDP2 models only. Use ModelParallelStrategy(data_parallel_size="
            f"{mesh.size()}, tensor_parallel_size=1) and {fix}."
        )
    if mesh["data_parallel"].size() > 1 and not is_sharded(module):
        raise ValueError(
            f"MixprecPrecision: under ModelParallelStrategy on {mesh.size()} processes the LightningModule's "
            "parameters are not sharded, so nothing would average their gradients and every rank would train "
            f"its own model; {fix}."
        )


def _check_gateable(config: Any) -> None:
    """A per-step scheduler stepped every ``frequency`` > 1 batches cannot skip exactly the skipped updates."""
    if config.interval == "step" and config.frequency != 1:
        raise ValueError(
            f"MixprecPrecision: the LR scheduler {type(config.scheduler).__name__} steps every "
            f"{config.frequency} batches (interval='step', frequency={config.frequency}); a skipped update "
            "could then not be kept out of the schedule (every policy skips an update whose gradients hold inf or "
            "NaN, bf16 and FP32 included). Use frequency=1 with a schedule stretched "
            f"{config.frequency}x (e.g. StepLR step_size x {config.frequency})."
        )


def _gated(config: Any, applied: Callable[[], bool]) -> Any:
    """The same scheduler configuration, its scheduler gated if Lightning steps it after every update."""
    if config.interval != "step":
        return config  # stepped per epoch: a skipped update does not change what an epoch is
    return dataclasses.replace(config, scheduler=GatedScheduler(config.scheduler, applied))
