"""MixedPrecision: the one object a training loop talks to (policy + loss scaler + master weights).

    mp = mixprec.MixedPrecision(model, optimizer, policy="mixed_fp16")
    for x, y in loader:
        with mp.autocast():
            loss = loss_fn(model(x), y)
        mp.backward(loss)                  # loss * scale, then backward
        mp.clip_grad_norm_(1.0)            # optional; unscales first, returns the true norm
        mp.step()                          # unscale, check, update or skip, adjust the scale, zero grads

Host syncs, all of them:
    - step() reads the found-inf flags once (every loss's in one ``.tolist()``) to decide the skip, unless
      the optimizer is a fused one that takes ``found_inf`` itself (``torch.optim.Adam/AdamW/SGD(fused=True)``)
      on an accelerator. On the CPU the read is a memory load.
    - ``bool(step_result)``, ``step_scheduler()``, ``stats()`` and ``state_dict()`` read device values.
    - the first update with FP32 masters (o2) reads one flag: whether the model's parameters still hold the
      masters' rounding (a DDP broadcast or a load_state_dict since MixedPrecision was made is refused).
    - ``mixprec.AdamW`` reads its step count (a CPU tensor) for FP32 parameters, as ``torch.optim.AdamW`` does.
    - FSDP2-sharded gradients still pending (a loss scale): the pending-gradient guard compares their local
      shards' norms with those after the backward, once at each check (next backward, unscale, step), as their
      foreach edits move no version counter (:mod:`~mixprec.engine.pending_grads`).
    - pure_bf16 built on FP32 weights: ``mixprec.AdamW`` reads two integers per parameter (a fingerprint of its
      16-bit values) when MixedPrecision is made and again at the parameter's first update, to take the
      rounding residual only for weights not written since.
On the CPU, where a read is a memory load, the statistics also read a flag where gradients are unscaled
outside step() (``unscale_()``, ``clip_grad_norm_()``, a backward() after another loss's), so that only
overflowing gradients pay for telling inf from NaN; elsewhere that check runs on the device.
In a torch.distributed run step() also all-reduces the found-inf flags (max over ranks) before deciding,
so every rank skips the same steps; that is a collective, not a host sync. With FSDP2-sharded parameters
(:func:`mixprec.fully_shard`) each rank unscales and checks its own shards, and clip_grad_norm_ sums the
shards' norms across ranks (one more all-reduce); a skipped step (every step, where a fused optimizer skips
on the device) all-reduces two more numbers, whether some rank's shards held an inf or a NaN, so that every
rank's statistics describe the step as a whole.
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple

import torch
from torch import nn

from mixprec.checks import flag, shown
from mixprec.distributed.ranks import agree_max, local, shard_groups
from mixprec.engine.call_order import CallOrder, check_loss, refuse_direct_steps
from mixprec.engine.ddp_sync import ReducedBackwardProbe
from mixprec.engine.grad_norm import total_norm
from mixprec.engine.guards import GuardList, registered_guards
from mixprec.engine.master_drift import MasterDriftGuard
from mixprec.engine.overflow_log import FoundInf, OverflowLog
from mixprec.engine.parameter_guard import ParameterGuard
from mixprec.engine.partial_resume import PartialResumeGuard
from mixprec.engine.pending_grads import GradSnapshot, PendingGradsGuard
from mixprec.engine.saved_state import check_saved_state, warn_mid_window
from mixprec.engine.setup import (
    check_arguments,
    check_model_and_optimizer,
    check_sharding,
    record_cast,
    rounding_residuals,
    scalers_for,
)
from mixprec.engine.stats import Stats, model_state_bytes
from mixprec.engine.step_result import StepResult
from mixprec.master.weights import MasterWeights, release_masters
from mixprec.numerics import get_format, max_magnitudes
from mixprec.parallel.fsdp import is_sharded
from mixprec.policy.parse import get_policy
from mixprec.policy.policy import Policy
from mixprec.regions.autocast import Region
from mixprec.regions.casting import cast_module
from mixprec.regions.plan import ComputePlan, tf32_matmuls, warn_without_fp8_layers, with_gemm_layers
from mixprec.regions.prepare import Prepared, prepare
from mixprec.scaling.base import LossScaler
from mixprec.scaling.static import NoOpLossScaler

__all__ = ["MixedPrecision", "StepResult"]

_GRAD = operator.attrgetter("grad")


class OptimizerView(NamedTuple):
    """What MixedPrecision derives from its optimizer's parameters, kept while their number stays."""

    count: int  # how many parameters the optimizer held
    with_gradients: tuple[torch.Tensor, ...]  # the model's parameters and the optimizer's, each once
    kind: tuple[torch.device, torch.dtype] | None  # their one device and dtype, if they share one
    outside: tuple[torch.Tensor, ...]  # the model's parameters no optimizer holds (o2's 16-bit ones, frozen ones)
    # sharded models: per optimizer parameter, the process groups its shards add up over (clip_grad_norm_'s norm)
    shard_groups: tuple[tuple, ...] | None = None


class MixedPrecision:
    """Mixed-precision training for ``model`` and ``optimizer`` under ``policy``.

    On construction: prepares the policy on the model's device (:func:`mixprec.prepare`: resolved and checked
    once); for ``o2_*`` policies creates FP32 master copies of the parameters it lowers and points the
    optimizer at them; casts the model; picks the default scaler (dynamic for fp16, none otherwise); puts the
    step's guards on one list (:mod:`mixprec.engine.guards`).

    Args:
        model: the model, with FP32 parameters, on its training device.
        optimizer: any ``torch.optim`` optimizer built on ``model``'s parameters (for ``pure_bf16``:
            ``mixprec.AdamW``, whose compensated updates stand in for master weights).
        policy: a Policy, preset or policy string (default ``auto``), or :func:`mixprec.prepare`'s value.
        scaler: a LossScaler, or a list of ``num_losses`` of them; default per policy.
        accumulation_steps: micro-batches per update; ``backward`` divides each loss by this.
        accumulate_in_fp32: keep gradients in FP32 buffers across micro-batches (o2 policies).
        num_losses: backward passes per step with a scaler each (like Apex's ``num_losses``).
        history: how many recent overflow steps ``stats()`` lists.

    Raises:
        ValueError: the model has parameters that are not FP32 where the policy needs exact FP32 weights
            (16-bit ones are accepted only where the policy stores them so and keeps no FP32 master: the
            cast would give the same bits); a policy without FP32 masters gets a plain optimizer; a
            sharded model was not sharded for this policy.
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        policy: Policy | str | Prepared = "auto",
        scaler: LossScaler | Sequence[LossScaler] | None = None,
        *,
        accumulation_steps: int = 1,
        accumulate_in_fp32: bool = False,
        num_losses: int = 1,
        history: int = 32,
    ) -> None:
        check_arguments(model, optimizer, accumulation_steps, accumulate_in_fp32, num_losses, history)
        # every check of the policy on this model, before anything is cast
        prepared = prepare(model, policy, caller="MixedPrecision")
        self.policy, self.device, self._plan = prepared.policy, prepared.device, prepared.plan
        self.model, self.optimizer = model, optimizer
        self.sharded = is_sharded(model)  # FSDP2: the model was sharded for this policy, casts included
        if self.sharded:
            check_sharding(model, self.policy)
        self.accumulation_steps, self.num_losses = accumulation_steps, num_losses
        self.scalers = scalers_for(scaler, num_losses, self.policy)

        trained = {id(p) for group in optimizer.param_groups for p in group["params"]}
        mastered = [p for p in prepared.lowered if id(p) in trained] if self.policy.keeps_fp32_masters else []
        check_model_and_optimizer(model, optimizer, self.policy, list(prepared.lowered), mastered)
        # made before the cast, from the exact values; sharded o2 models need none: their FP32 shards are the
        # masters, which FSDP2 gathers in 16 bits
        self.masters = MasterWeights(optimizer, mastered) if mastered and not self.sharded else None
        residuals = rounding_residuals(optimizer, model, self.policy, prepared.lowered, trained, self.sharded)
        if not self.sharded:
            cast_module(model, self.policy)
            if self.masters is not None:  # a second MixedPrecision on this model is refused by name
                record_cast(model, self.policy)
        if residuals:  # pure_bf16: p + compensation starts at the exact FP32 weight, not at its rounding
            optimizer.start_from(residuals)
        self._region = Region(prepared)  # prepared once: entering it only enters contexts
        if self._region.fp8 is not None:
            warn_without_fp8_layers(self._region.fp8.selection)
        self.accumulate_in_fp32 = accumulate_in_fp32 and self.masters is not None
        # inside DDP's no_sync the gradients must stay in .grad for the one all-reduce (engine/ddp_sync.py)
        self._reduced = ReducedBackwardProbe(model) if self.accumulate_in_fp32 else None
        self._order = CallOrder(accumulation_steps)
        self._step_hook = refuse_direct_steps(optimizer, self._order)
        self._log = OverflowLog(self.scalers, history, self.device)  # what stats() and the log lines report
        self._guards = self._make_guards()
        # what follows from the optimizer's parameters alone, looked at again when their number changes
        self._optimizer_view = OptimizerView(-1, (), None, ())
        self._view(self._optimizer_params())
        self._last_loss: torch.Tensor | None = None
        self._last: StepResult | None = None
        self._grads_carry_scale = False  # the last backward's gradients are multiplied by a loss scale
        self._new_window()

    def _make_guards(self) -> GuardList:
        """The checks that protect the step (:mod:`mixprec.engine.guards`), in the order they run."""
        parameters = ParameterGuard(self.model, self.sharded)  # as the policy set them
        # the model's parameters without walking its modules each step (280 us a step on BERT)
        self._parameters = parameters.parameters
        drift = [MasterDriftGuard(self.masters)] if self.masters is not None else []
        scaled = not all(isinstance(scaler, NoOpLossScaler) for scaler in self.scalers)
        self._resume = PartialResumeGuard(self.optimizer) if scaled else None  # the scale is what a resume loses
        resume = [self._resume] if self._resume is not None else []
        guards = [parameters, PendingGradsGuard(MixedPrecision._with_gradients), *registered_guards(), *drift, *resume]
        return GuardList(guards)

    def _with_gradients(self) -> tuple[torch.Tensor, ...]:
        """The tensors gradients land on: the model's parameters and the optimizer's (o2's masters), each once."""
        return self._view(self._optimizer_params()).with_gradients

    def _view(self, optimized: list[torch.Tensor]) -> OptimizerView:
        """What follows from the optimizer's parameters alone, made again only when their number changes (a
        parameter group added), not at every step."""
        if len(optimized) != self._optimizer_view.count:
            kinds = {(p.device, p.dtype) for p in optimized}
            held = set(map(id, optimized))
            self._optimizer_view = OptimizerView(
                len(optimized),
                tuple(dict.fromkeys([*self._parameters, *optimized])),
                kinds.pop() if len(kinds) == 1 else None,
                tuple(p for p in self._parameters if id(p) not in held),
                tuple(map(shard_groups, optimized)) if self.sharded else None,  # placements: fixed with the parameter
            )
        return self._optimizer_view

    # -- the training step -----------------------------------------------------------------------
    @contextlib.contextmanager
    def autocast(self) -> Iterator[Policy]:
        """The policy's low-precision region for this model (see :func:`mixprec.autocast`)."""
        self._order.check_open("autocast()")
        self._guards.before_forward(self)
        self._order.on_forward()
        with self._region.enter() as policy:
            yield policy

    @property
    def compute_plan(self) -> ComputePlan:
        """How the policy computes on this device (native or emulated), and why; under an FP8 recipe also which
        GEMM layers run FP8 and which were kept, each with its reason, speed decisions included as made so far."""
        if self._region.fp8 is None:
            return self._plan
        return with_gemm_layers(self._plan, self._region.fp8.selection)

    @property
    def micro_step(self) -> int:
        """Micro-batches of the current accumulation window already stepped: 0 right after an update, the
        moment to save a checkpoint (the window's gradients are not part of one)."""
        return self._order.micro_step

    @property
    def last_step(self) -> StepResult | None:
        """What the last ``step()`` returned (truthy when it applied an update), None before the first."""
        return self._last

    @property
    def at_update_boundary(self) -> bool:
        """True when the next ``step()`` applies an update (always, without gradient accumulation)."""
        return self._order.at_update_boundary

    def backward(self, loss: torch.Tensor, loss_id: int = 0, retain_graph: bool | None = None) -> None:
        """``(loss / accumulation_steps * scale).backward()`` with the scaler of ``loss_id``.

        ``retain_graph`` as in ``Tensor.backward``: needed when several losses share one forward graph.
        With several losses, the previous backward's gradients are first unscaled by their own loss's scaler
        into FP32 sums, so that no two scales mix; with one loss, gradients add up at their scale until the
        window's end, where they are unscaled once, in place.
        """
        check_loss(loss, loss_id, self.num_losses)
        if retain_graph is not None:  # checked before the call order counts a backward
            flag(retain_graph, "MixedPrecision.backward(retain_graph=...) (or None)")
        self._order.check_backward()
        self._guards.before_gradients(self)
        self._order.on_backward()
        if self._scaled_by is not None and self.num_losses > 1:
            self._unscale_scaled(into_sums=True)
        self._scaled_by = loss_id
        self._last_loss = loss.detach()  # to tell an underflow (all-zero gradients, a non-zero loss) at step()
        if self.accumulation_steps > 1:
            loss = loss / self.accumulation_steps
        # tf32: the backward's matmuls too, not only the region's forward (float32_matmul_precision is global)
        with tf32_matmuls(self.device.type) if self.policy.allow_tf32 else contextlib.nullcontext():
            self.scalers[loss_id].scale(loss).backward(retain_graph=retain_graph)
        if self.accumulate_in_fp32 and self._reduced.take():
            self.masters.grads_to_masters()
        self._grads_carry_scale = not isinstance(self.scalers[loss_id], NoOpLossScaler)
        self._guards.after_backward(self)

    def _optimizer_params(self) -> list[torch.Tensor]:
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def _optimizer_grads(self) -> list[torch.Tensor]:
        """This rank's gradients of the optimizer's parameters (the local shards of sharded ones)."""
        return [local(p.grad) for p in self._optimizer_params() if p.grad is not None]

    def _shard_groups(self) -> list[tuple]:
        """For each of :meth:`_optimizer_grads`, the process groups its parts add up over (sharded models; read
        from the parameters' placements once, not at every clip)."""
        optimized = self._optimizer_params()
        groups = self._view(optimized).shard_groups
        return [group for param, group in zip(optimized, groups, strict=True) if param.grad is not None]

    def unscale_(self, on_model: bool | None = None) -> None:
        """Divide this step's gradients by the loss scale, in place; then they are the update's, to read or change
        until ``step()``, as after ``GradScaler.unscale_``.

        Under o2 policies they live on the FP32 masters (the optimizer's parameters). ``on_model`` shows them on
        the model's parameters too, rounded to their dtype, until ``step()``: code written for
        ``model.parameters()`` (torch's ``clip_grad_norm_``, a norm logger) then sees every gradient, and an edit
        there reaches the master at ``step()`` (without them, such a clip found only the FP32-kept layers'
        gradients and clipped those alone). The default (None) shows them where the model's dtype has FP32's
        range (bf16: ``o2_bf16``), not in fp16 (``o2_fp16``), where unscaled gradients below 6e-8 would read as 0
        and torch's norm of them past 65504 as inf (a clip by 0): there clip with :meth:`clip_grad_norm_` or edit
        the optimizer's. True shows them in any dtype; False never (no 16-bit copy).
        """
        if on_model is not None:
            flag(on_model, "MixedPrecision.unscale_(on_model=...) (or None)")
        self._unscale_now("unscale_()")
        if self.masters is not None and (on_model or (on_model is None and self._model_holds_fp32_range)):
            self._shown = self.masters.expose_grads()
        elif self.masters is not None:  # not shown: an edit that reaches only the FP32-kept layers is refused
            masters = set(map(id, self.masters.masters))
            kept = [p for p in self._optimizer_params() if id(p) not in masters]
            self._unshown = (GradSnapshot(self.masters.masters), GradSnapshot(kept))

    def _refuse_edits_beside_the_masters(self) -> None:
        """After an unscale_() that showed nothing on the model (o2_fp16): an edit of the optimizer's gradients that
        reached the FP32-kept layers' (the norms, their own optimizer parameters) and none of the masters' is the
        mark of torch's clip over ``model.parameters()``, which found no other gradient there: refused before the
        update, the window dropped, as a clip of scaled gradients is."""
        (masters, kept), self._unshown = self._unshown, None
        with_grads = any(m.grad is not None for m in self.masters.masters)
        if with_grads and kept.changed() is not None and masters.changed() is None:
            self.zero_grad()
            raise RuntimeError(
                "MixedPrecision: after mp.unscale_() under an fp16 o2 policy, the gradients of the FP32-kept layers "
                "were changed and none of the 16-bit layers', whose gradients live on the FP32 masters (fp16 cannot "
                "hold them unscaled): torch.nn.utils.clip_grad_norm_(model.parameters(), ...) finds only the "
                "former, measures their norm alone and clips them alone. Nothing was applied, and this window's "
                "gradients were dropped. Clip with mp.clip_grad_norm_(max_norm), or the optimizer's parameters "
                "(mp.optimizer.param_groups), or call mp.unscale_(on_model=True) to edit fp16 copies on the model."
            )

    @property
    def _model_holds_fp32_range(self) -> bool:
        return get_format(self.policy.param_dtype).exponent_bits >= get_format(torch.float32).exponent_bits

    def _collect_shown(self, keep_shown: bool = False) -> None:
        """Gradients shown on the model (o2, :meth:`unscale_`, :meth:`gradients_on_model`): edits to the masters,
        where an edit that made one inf or NaN skips the update as an overflow would."""
        if self._shown is not None:
            kept, edited = self.masters.collect_grads(self._shown, keep_shown)
            self._shown = kept if keep_shown else None
            if edited:
                self._skip_if_not_finite(max_magnitudes(edited, self.device).max())

    def _unscale_now(self, caller: str, check: bool = True) -> None:
        """unscale_() and clip_grad_norm_()'s unscale: the call order, the guards, then the unscale (``check``:
        with the finite check; clip_grad_norm_'s norm checks them instead, where nothing is to be divided)."""
        self._order.check_unscale(caller)
        self._guards.before_gradients(self)
        self._order.on_unscale()
        self._unscale(check=check)

    def _unscale(self, classify_later: bool = False, check: bool = True) -> None:
        """At the window's end, unscale the last loss's gradients: in place (with one loss, the window's only
        unscale, no copy), or into the FP32 sums of the losses before, which then become the gradients."""
        self._unscale_scaled(into_sums=bool(self._sums), classify_later=classify_later, check=check)
        for param, grad in self._sums.values():
            param.grad = grad if param.dtype == torch.float32 else grad.to(param.dtype)
        self._sums = {}

    def _unscale_scaled(self, into_sums: bool, classify_later: bool = False, check: bool = True) -> None:
        """Unscale the gradients in ``.grad`` (the masters' for o2) with the scaler of the loss that made them,
        in place, or into FP32 sums that gradients of another scale can join; note the loss's found-inf flag.

        The statistics tell an overflow's inf from NaN right after, before clipping or summing can turn one into
        the other; ``classify_later``: step()'s own unscale, whose flags step() reads next (free then)."""
        loss_id, self._scaled_by = self._scaled_by, None
        self._grads_carry_scale = False
        if not check:  # nothing to divide, and the norm clip_grad_norm_ takes next flags them (_skip_if_not_finite)
            return
        if self.masters is not None:
            self.masters.grads_to_masters()
        optimized = self._optimizer_params()
        if into_sums:
            params = [p for p in optimized if p.grad is not None]
            grads = [p.grad.float() for p in params]  # float(): a copy of 16-bit ones only
        else:
            grads = [grad for grad in map(_GRAD, optimized) if grad is not None]  # read in C
        unscaled = [local(g) for g in grads] if self.sharded else grads
        found, magnitudes = self.scalers[loss_id].unscale_checked_(self._grouped(optimized, unscaled, into_sums))
        before = self._found[loss_id]
        self._found[loss_id] = found if before is None else torch.maximum(before, found)  # 0 or 1, as fused steps need
        if classify_later:
            self._unclassified = (unscaled, found, magnitudes)
        else:
            self._log.classify(unscaled, found, magnitudes=magnitudes)
        if into_sums:
            for param, grad in zip(params, grads, strict=True):
                if id(param) in self._sums:
                    self._sums[id(param)][1].add_(grad)
                else:
                    self._sums[id(param)] = (param, grad)
                param.grad = None

    def _grouped(self, optimized: list[torch.Tensor], grads: list[torch.Tensor], fp32: bool) -> Any:
        """``grads`` keyed by their one (device, dtype) where the optimizer's parameters share one (a gradient has
        its parameter's): grouping them tensor by tensor cost 0.4 us each per step. ``fp32``: FP32 copies."""
        key = self._view(optimized).kind
        # several groups, DTensor shards (grouped one by one), or no gradient left (an optimizer.zero_grad())
        if key is None or self.sharded or not grads:
            return grads
        return {(key[0], torch.float32 if fp32 else key[1]): grads}

    @contextlib.contextmanager
    def gradients_on_model(self) -> Iterator[None]:
        """Inside, user code that reads the model's ``p.grad`` sees this update's unscaled gradients, under every
        policy: o2 keeps them on the FP32 masters, so they are shown on the 16-bit parameters rounded to their dtype,
        and an edit there (a clip of the user's own, in place or by replacement) goes back to the master on exit.
        Other policies' gradients are on the model already. Call it after ``unscale_()``."""
        if self.masters is None:
            yield
            return
        if not self._order.unscaled:
            raise RuntimeError("gradients_on_model() before unscale_(): the gradients still carry the loss scale.")
        by_unscale = self._shown is not None  # shown since unscale_(): still shown after the block, until step()
        if not by_unscale:
            self._shown = self.masters.expose_grads()
        try:
            yield
        finally:
            self._collect_shown(keep_shown=by_unscale)

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Unscale if needed, then clip the gradients' total norm to ``max_norm``; returns the true norm.

        The norm is computed in FP32 from the unscaled gradients the optimizer will use, with
        ``torch.nn.utils.clip_grad_norm_``'s formula; ``max_norm=math.inf`` measures it without clipping.
        When clipping (a finite ``max_norm``), a non-finite norm makes step() skip the update, as an overflow
        does: non-finite gradients, or finite ones whose squares sum past FP32's range (norms from about
        1.8e19), which clipping would multiply by 0 and the optimizer would still apply (momentum, weight
        decay). No host sync.
        """
        if not isinstance(max_norm, (int, float)) or isinstance(max_norm, bool) or not max_norm > 0:
            # a negative max_norm would flip every gradient's sign (torch's clip_grad_norm_ takes it)
            raise ValueError(
                f"MixedPrecision.clip_grad_norm_(max_norm=...) needs a positive number (math.inf: measure the norm "
                f"without clipping); received {max_norm!r}."
            )
        if not isinstance(norm_type, (int, float)) or isinstance(norm_type, bool) or not norm_type > 0:
            raise ValueError(
                "MixedPrecision.clip_grad_norm_(norm_type=...) needs a positive number (2.0: the Euclidean norm; "
                f"math.inf: the largest magnitude); received {shown(norm_type)}."
            )
        # with nothing to divide (no loss scale, one loss, no FP32 masters), the norm's own pass is the finite check
        by_norm = not self._order.unscaled and max_norm != float("inf") and self._norm_checks_gradients
        if not self._order.unscaled:
            self._unscale_now("clip_grad_norm_()", check=not by_norm)
        was_shown = self._shown is not None  # since unscale_() (o2): their edits first, then shown again clipped
        self._collect_shown()
        grads = self._optimizer_grads()
        if not grads:
            return torch.zeros((), device=self.device)
        groups = self._shard_groups() if self.sharded else None
        total = total_norm(grads, norm_type, self.device, groups)
        if max_norm != float("inf"):  # measuring alone changes nothing: non-finite gradients skip anyway
            self._skip_if_not_finite(total, checks_gradients=by_norm)
            coefficient = (float(max_norm) / (total + 1e-6)).clamp(max=1.0)
            torch._foreach_mul_(grads, coefficient)
        if was_shown:
            self._shown = self.masters.expose_grads()
        return total

    @property
    def _norm_checks_gradients(self) -> bool:
        """Whether clip_grad_norm_'s norm can stand for the finite check: one loss whose scaler divides by nothing,
        gradients on the model's own (unsharded) parameters."""
        return self.num_losses == 1 and self.masters is None and not self.sharded and self.scalers[0].fixed_scale == 1.0

    def _skip_if_not_finite(self, norm: torch.Tensor, checks_gradients: bool = False) -> None:
        """A non-finite gradient norm is an overflow: every loss of this window gets its found-inf flag.

        ``checks_gradients``: the norm stands for the finite check (nothing was divided, one loss), so it sets that
        loss's flag and the statistics' inf-or-NaN, before clipping can turn one into the other: a NaN makes the norm
        NaN, an inf makes it inf (squares past FP32's range too: skipped, as clipping would skip them)."""
        not_finite = (~torch.isfinite(norm)).float().reshape(1)
        if checks_gradients:
            self._found[0] = not_finite
            self._log.classify([], not_finite, magnitudes=norm.reshape(1))
            return
        self._found = [flag if flag is None else torch.maximum(flag, not_finite) for flag in self._found]

    def step(self) -> StepResult:
        """Finish the step: guards, unscale (if not done), check, apply the update or skip it, adjust the scale,
        zero grads.

        Inside an accumulation window only counts the micro-batch. Returns a StepResult, truthy when the
        update was applied; parameters, masters and optimizer state are untouched by a skipped step.
        """
        self._order.check_step()
        self._collect_shown()  # gradients unscale_() showed on the model (o2): their edits, to the masters
        if self._unshown is not None:
            self._refuse_edits_beside_the_masters()
        self._guards.before_update(self)  # before anything changes
        already_unscaled = self._order.unscaled
        if not self._order.on_step():
            self._last = StepResult(False, False)
            return self._last
        if not already_unscaled:
            self._unscale(classify_later=True)
        found = self._found_inf()
        self._log.watch_underflow(self._optimizer_grads, self._last_loss)  # only after a scale collapse
        self._update_or_skip(found)
        scales_before = self._log.scales()
        for scaler, overflowed in zip(self.scalers, found.per_loss, strict=True):
            scaler.update(overflowed)
        if (fp8 := self._region.fp8) is not None:  # a skipped update's amaxes leave the delayed histories
            fp8.end_window(found.found, self._loss_scale_change(scales_before) if fp8.keeps_histories else None)
        self._zero_grad()
        self._log.record(found, scales_before)
        self._last = StepResult(True, found.found)
        return self._last

    def _loss_scale_change(self, scales_before: list[torch.Tensor | float]) -> torch.Tensor | float | None:
        """The loss scale now over ``scales_before`` (on the device: no host sync), for the FP8 gradient histories;
        None where the scale cannot change, or where several losses' scales meet in the same gradients."""
        if len(self.scalers) != 1:
            return None
        scaler = self.scalers[0]
        if scaler.fixed_scale is not None or scaler.scale_tensor is None:
            return None
        return (scaler.scale_tensor / scales_before[0]).reshape(())

    def _found_inf(self) -> FoundInf:
        """Every loss's found-inf flag, the maximum over ranks, read on the host once (not at all where a
        fused optimizer takes the flag itself); the statistics then tell an overflow's inf from NaN."""
        per_loss = self._found
        if any(flag is None for flag in per_loss):  # a loss without gradients in this window
            zero = torch.zeros(1, dtype=torch.float32, device=self.device)
            per_loss = [zero if flag is None else flag for flag in per_loss]
        per_loss = agree_max(per_loss)
        host = None
        if not self._skips_on_device:
            # host sync, once: every loss's flag in one read, which decides the skip (free on the CPU)
            flags = per_loss[0] if len(per_loss) == 1 else torch.cat(per_loss)  # one loss: no concatenation
            host = [flag != 0 for flag in flags.tolist()]
        if self._unclassified is not None:
            grads, found, magnitudes = self._unclassified
            self._log.classify(grads, found, None if host is None else any(host), magnitudes)
            self._unclassified = None
        if self.sharded and (host is None or any(host)):  # the same on every rank: the flags are agreed
            self._log.agree_kinds()  # a shard's NaN is every rank's skip (DDP replicas agree already)
        return FoundInf(per_loss, host)

    @property
    def _skips_on_device(self) -> bool:
        """A fused optimizer (``torch.optim.AdamW(fused=True)`` etc.) on an accelerator takes ``found_inf``."""
        return getattr(self.optimizer, "_step_supports_amp_scaling", False) and self.device.type != "cpu"

    def _update_or_skip(self, flags: FoundInf) -> None:
        """The optimizer step unless a gradient overflowed, then the masters rounded into the model."""
        if flags.host is None:  # the fused optimizer skips on the device; no sync
            self.optimizer.grad_scale = None  # gradients are already unscaled
            self.optimizer.found_inf = flags.found.reshape(())  # 0-d, as GradScaler's: it is subtracted from steps
            try:
                self.optimizer.step()
            finally:
                del self.optimizer.grad_scale, self.optimizer.found_inf
        elif not any(flags.host):
            self.optimizer.step()
        else:
            return
        if self.masters is not None:
            self.masters.copy_to_model()  # after a skip on the device: unchanged masters, the same values

    def _zero_grad(self) -> None:
        self._collect_shown()  # released from the model with the window (a zero_grad() after unscale_())
        self.optimizer.zero_grad(set_to_none=True)
        # the model's parameters no optimizer holds: theirs too (the view of the last unscale; parameter groups
        # added since only shrink that set, so an older view clears a few gradients twice, never too few)
        for param in self._optimizer_view.outside:
            param.grad = None
        self._new_window()

    def _new_window(self) -> None:
        """No gradients yet in this update window."""
        self._scaled_by: int | None = None  # the loss whose gradients, at its scale, are in .grad
        self._found: list[torch.Tensor | None] = [None] * self.num_losses  # each loss's found-inf flag
        self._sums: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # unscaled FP32 sums, by id(param)
        # step()'s gradients, flag and magnitudes (None where the check did not read them), until its flag is read
        self._unclassified: tuple[list[torch.Tensor], torch.Tensor, torch.Tensor | None] | None = None
        self._grads_carry_scale = False
        self._shown: list[tuple[int, torch.Tensor, int]] | None = None  # o2 gradients shown on the model
        self._unshown: tuple[GradSnapshot, GradSnapshot] | None = None  # or not (fp16): masters', kept ones'

    def zero_grad(self) -> None:
        """Drop this window's gradients without stepping (e.g. to skip a bad batch)."""
        self._zero_grad()
        self._order.reset()
        self._log.forget_window()

    def step_scheduler(self, scheduler: Any) -> bool:
        """Step ``scheduler`` only if the last ``step()`` applied an update; returns whether it did.

        A skipped step must not advance the learning-rate schedule. Host sync (reads the skip flag).
        """
        if self._last is None:
            raise RuntimeError("step_scheduler() before any step(): call it once after each mp.step().")
        if not hasattr(scheduler, "step") or isinstance(scheduler, torch.optim.Optimizer):
            raise TypeError(
                f"step_scheduler(scheduler=...) needs an LR scheduler; received {type(scheduler).__name__}."
            )
        if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
            raise TypeError(
                "step_scheduler(scheduler=...): ReduceLROnPlateau steps on a validation metric, once an evaluation, "
                "not once an update, so a skipped update does not concern it: call scheduler.step(metric) yourself."
            )
        if self._last:
            scheduler.step()
            return True
        return False

    # -- reporting and state ---------------------------------------------------------------------
    def stats(self) -> Stats:
        """Scale, step and overflow counts, and bytes of model state per parameter. Host sync."""
        masters = self.masters.state() if self.masters is not None else []
        scales = tuple(s.get_scale() for s in self.scalers)
        return Stats(
            policy=str(self.policy),
            scale=scales[0],
            scales=scales,
            **self._log.counts(),
            bytes_per_param=model_state_bytes(self.model, masters, self.optimizer, self.accumulate_in_fp32),
        )

    def fp32_state_dict(self) -> dict[str, torch.Tensor]:
        """The model's state dict in FP32, with the exact master values where the model holds rounded copies.

        This is the model to evaluate as the FP32 reference or to export; ``model.state_dict()`` under an
        o2 policy holds the bf16/fp16 roundings.
        """
        exact = dict(zip(map(id, self.masters.model_params), self.masters.state(), strict=True)) if self.masters else {}
        named = self.model.named_parameters(remove_duplicate=False)  # tied weights under every name
        by_name = {name: exact.get(id(param), param.detach()) for name, param in named}
        return {
            name: by_name.get(name, value).float() if value.is_floating_point() else value
            for name, value in self.model.state_dict().items()
        }

    def state_dict(self, *, masters: bool = True) -> dict[str, Any]:
        """Scalers, master weights and counters (the optimizer and model save their own). Host sync.

        Save after an update: in the middle of an accumulation window the gradients accumulated so far are not
        part of the state (a warning says so), and a run resumed from it starts the window again without them.
        ``masters=False``: without them, for ``load_state_dict(state, masters=False)`` where the model's own
        weights are the exact values (after :meth:`release`, or saved separately in FP32).
        """
        warn_mid_window(self._order.micro_step, self.accumulation_steps, saving=True)
        state = {
            "policy": str(self.policy),
            **self._small_state(),
            "micro_step": self._order.micro_step,
            "accumulation_steps": self.accumulation_steps,
        }
        if masters:
            state["masters"] = [m.clone() for m in self.masters.state()] if self.masters is not None else []
        return state

    def _small_state(self) -> dict[str, Any]:
        """The state but the masters: scalers, counters, FP8 scale states (host sync: the scales)."""
        return {
            "scalers": [s.state_dict() for s in self.scalers],
            "counters": self._log.state_dict(),
            "fp8": self._region.fp8.state_dict() if self._region.fp8 is not None else {},
        }

    def _load_small_state(self, state: dict[str, Any]) -> None:
        for scaler, scaler_state in zip(self.scalers, state["scalers"], strict=True):
            scaler.load_state_dict(scaler_state)
        self._log.load_state_dict(state["counters"])
        if self._region.fp8 is not None:
            self._region.fp8.load_state_dict(state.get("fp8", {}))

    @property
    def released(self) -> bool:
        """Whether :meth:`release` handed the model and optimizer back (every training call is refused since)."""
        return self._order.released

    def release(self) -> dict[str, Any]:
        """Hand the model and optimizer back: under o2 the model's parameters FP32 again, holding the masters'
        exact values, and the optimizer's groups and state on them; the output cast and FP8 routing removed.

        For a framework whose runs outlive one fit (fastai's ``fine_tune``, a second ``trainer.fit``), or to
        evaluate or save the trained model as plain FP32. Returns this MixedPrecision's state without masters
        (``state_dict(masters=False)``): a new MixedPrecision on the same model and optimizer continues where this
        one stopped with ``load_state_dict(returned, masters=False)``. pure_bf16's parameters stay 16-bit: they
        are the weights (no FP32 copy exists). This MixedPrecision refuses every call afterwards. Call it at an
        update boundary.
        """
        self._order.check_open("release()")
        if self._order.micro_step or self._order.backward_since_step:
            raise RuntimeError(
                "release() with gradients of an unfinished step: call step() (or zero_grad()) first, so that no "
                "gradient is dropped or left scaled on the parameters."
            )
        state = self.state_dict(masters=False)
        self._order.released = True
        self._step_hook.remove()
        if self._reduced is not None:
            self._reduced.remove()
        self._region.close()
        if self.masters is not None:
            release_masters(self.masters, self.optimizer)
            cast_module(self.model, get_policy("fp32"))  # parameters without masters and buffers: widened
            self.masters = None
        self._optimizer_view = OptimizerView(-1, (), None, ())
        return state

    def load_state_dict(self, state: dict[str, Any], *, masters: bool = True) -> None:
        """Restore what ``state_dict()`` returned; refuses state from another policy or model.

        ``masters=False``: keep this MixedPrecision's masters (made from the model's weights as they are now) and
        take the rest, scalers, counters and FP8 state: a run continued after ``release()``, or whose FP32 weights
        were loaded into the model separately; ``state`` may then leave its ``masters`` out.
        """
        if not masters:
            state = {**state, "masters": [m.clone() for m in self.masters.state()] if self.masters is not None else []}
        check_saved_state(state, self.policy, len(self.scalers), self.accumulation_steps, self.masters is not None)
        if self.masters is not None:
            self.masters.check_state(state["masters"])
        # a state refused part way (a scaler's, the FP8 layers') leaves this one as it was: the small parts put
        # back, the masters (checked above) written last
        before = self._small_state()
        try:
            self._load_small_state(state)
        except BaseException:
            self._load_small_state(before)
            raise
        if self.masters is not None:
            self.masters.load_state(state["masters"])
        warn_mid_window(int(state["micro_step"]), self.accumulation_steps, saving=False)
        self._order.micro_step = 0
        if self._resume is not None:
            self._resume.restored()
