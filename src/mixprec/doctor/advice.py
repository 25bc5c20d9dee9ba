"""``diagnose``: run a few FP32 steps with the range hooks on and say what 16 and 8 bits would do.

Per format it reports the share of gradient values (activation and weight gradients) that would be
lost, rounded to zero, without loss scaling, and the loss scale it recommends. Both count the gradients
that a mixed-precision run computes in 16 bits, found by one extra forward and backward pass under
mixed_fp16 (norm and embedding weights keep FP32 gradients there, so their size cannot overflow).
The scale is the smallest power of two 2**k (k >= 0) at which
at least ``keep`` of those non-zero gradient values are at or above the format's smallest subnormal,
provided the largest of them times 2**k still stays below the format's overflow threshold. Where no
scale does both, the largest scale that does not overflow is given and ``reaches_keep`` is False. It
names the modules whose activations overflow each format (where the overflow starts, then every
module it reaches), and recommends a policy with a reason for each part.

The model is not changed: no optimizer step is taken, and its gradients are restored afterwards.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from mixprec.compute.nest import map_floating
from mixprec.doctor.report import DoctorReport, Histogram
from mixprec.doctor.watch import DEFAULT_FORMATS, RangeWatch
from mixprec.numerics.finite import magnitudes_not_finite, max_magnitudes
from mixprec.numerics.formats import get_format

__all__ = ["Diagnosis", "FormatAdvice", "diagnose", "recommend_scale"]


@dataclass(frozen=True)
class FormatAdvice:
    """What training with this format's gradients and activations would meet."""

    format: str
    gradient_values: int  # non-zero finite gradient values recorded (activation + weight gradients)
    lost_without_scaling: float  # fraction of them that round to zero at scale 1
    activation_grads_lost: float
    weight_grads_lost: float
    gradient_amax: float
    recommended_scale: float
    kept_with_scale: float
    reaches_keep: bool
    activations_overflow: tuple[str, ...]  # forward: every module whose outputs overflow, in order
    overflow_starts_in: tuple[str, ...]  # forward: modules whose outputs overflow although their inputs fit
    overflow_reaches: tuple[str, ...]  # forward: the outermost modules whose inputs or outputs overflow
    activation_grads_overflow: tuple[str, ...]  # backward, unscaled
    scope: str  # which gradients the loss-scale figures count


@dataclass(frozen=True)
class Diagnosis:
    """The doctor's findings: statistics, advice per format and a recommended policy with reasons."""

    report: DoctorReport
    keep: float
    formats: dict[str, FormatAdvice]
    policy: str
    loss_scale: float | None
    reasons: tuple[str, ...]
    # where the FP32 run made inf or NaN when its loss was non-finite at every recorded step: modules in the order
    # their outputs were made, then "loss"; no precision policy trains such a model (the recommendation is fp32)
    fp32_nonfinite: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {
            "policy": self.policy,
            "loss_scale": self.loss_scale,
            "reasons": list(self.reasons),
            "fp32_nonfinite": list(self.fp32_nonfinite),
            "keep": self.keep,
            "formats": {name: asdict(advice) for name, advice in self.formats.items()},
            "report": self.report.to_dict(),
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, default=lambda v: None)


def recommend_scale(histogram: Histogram, amax: float, fmt: str, keep: float) -> tuple[int, float, bool]:
    """(k, kept fraction, reaches keep) for the loss scale 2**k; see the module docstring."""
    spec = get_format(fmt)
    smallest = round(math.log2(spec.min_subnormal))
    fits = [k for k in range(-128, 129) if amax == 0 or math.ldexp(amax, k) < spec.overflow_threshold]
    if not fits:
        return 0, histogram.fraction_at_least(smallest), False
    largest = max(fits)
    for k in range(min(0, largest), largest + 1):
        kept = histogram.fraction_at_least(smallest - k)
        if kept >= keep:
            return k, kept, True
    return largest, histogram.fraction_at_least(smallest - largest), False


def diagnose(
    model: nn.Module,
    batches: Iterable[Any],
    loss_fn: Callable[[Any, Any], torch.Tensor],
    steps: int = 10,
    formats: Iterable[str] = DEFAULT_FORMATS,
    keep: float = 0.999,
    bf16_supported: bool = True,
) -> Diagnosis:
    """Run ``steps`` forward and backward passes in FP32 with the range hooks on; advise.

    Args:
        model: an FP32 model (left unchanged).
        batches: an iterable of ``(inputs, targets)``; ``inputs`` may be a tensor or a tuple of them.
        loss_fn: ``loss_fn(model_output, targets)`` returning a scalar loss.
        steps: batches to run (stops early if ``batches`` runs out).
        formats: formats to analyse; fp16 is always included (the policy advice is about it).
        keep: fraction of non-zero gradient values the recommended loss scale must keep in range.
        bf16_supported: whether the device computes bf16 (for the advice when fp16 cannot work).

    Raises:
        ValueError: ``steps`` < 1, ``keep`` outside (0, 1], or no batch at all.
    """
    _check_model_and_loss(model, loss_fn)
    _check_run_arguments(batches, steps, formats, keep)
    formats = (formats,) if isinstance(formats, str) else formats  # one name, not its characters
    names = tuple(dict.fromkeys(["fp16", *(get_format(f, argument="formats").name for f in formats)]))
    saved_grads = {p: p.grad for p in model.parameters()}
    was_training = model.training
    model.train()
    watch = RangeWatch(model, formats=names)
    try:
        with watch:
            first, nonfinite_losses, nonfinite_grads = _record(model, batches, loss_fn, watch, steps)
        scope = _sixteen_bit_gradients(model, first, loss_fn) if first is not None else None
    finally:
        for p, grad in saved_grads.items():
            p.grad = grad
        model.train(was_training)
    if watch.steps == 0:
        raise ValueError("diagnose(batches=...): received no batch; pass an iterable of (inputs, targets).")
    report = watch.report()
    advice = {fmt: _format_advice(report, fmt, keep, scope) for fmt in names}
    # judged by the loss: a module's inf output can be meant (a mask of -inf that the loss leaves out)
    where = (*report.nonfinite_outputs(), "loss")
    if nonfinite_losses == watch.steps:
        return Diagnosis(report, keep, advice, "fp32", None, (_broken_in_fp32(where, watch.steps),), where)
    backward = (*report.nonfinite_gradients(), "gradients")  # a finite loss, inf/NaN made by the backward pass
    if nonfinite_losses + nonfinite_grads == watch.steps:
        why = _gradients_broken_in_fp32(backward, nonfinite_grads, watch.steps)
        return Diagnosis(report, keep, advice, "fp32", None, (why,), backward)
    policy, loss_scale, reasons = _recommend_policy(advice, keep, bf16_supported)
    if nonfinite_losses:
        reasons = (*reasons, _some_steps_broken(where, nonfinite_losses, watch.steps))
    if nonfinite_grads:
        reasons = (*reasons, _some_steps_broken(backward, nonfinite_grads, watch.steps, "gradients"))
    return Diagnosis(report, keep, advice, policy, loss_scale, reasons)


def _first_place(nonfinite: tuple[str, ...]) -> str:
    """Where the first inf or NaN was made: a module ("" is the model itself), else the loss (or, for the backward
    pass, the gradients)."""
    if nonfinite in (("loss",), ("gradients",)):
        return f"the {nonfinite[0]}"
    return f"{nonfinite[0] or 'the model'}"


def _some_steps_broken(nonfinite: tuple[str, ...], broken: int, steps: int, what: str = "loss") -> str:
    made = "a non-finite loss" if what == "loss" else "a finite loss but inf or NaN gradients"
    return (
        f"{broken} of {steps} recorded steps had {made} already in FP32 (first inf or NaN in "
        f"{_first_place(nonfinite)}{'' if what == 'loss' else ', the gradient of its output'}): "
        "those batches are skipped whatever the precision; check the data"
    )


def _gradients_broken_in_fp32(nonfinite: tuple[str, ...], broken: int, steps: int) -> str:
    first = (
        f"the gradient of {nonfinite[0] or 'the model'}'s output (made where that output is used)"
        if len(nonfinite) > 1
        else "the gradients"
    )
    return (
        f"the model's gradients are inf or NaN already in FP32 ({broken} of {steps} recorded step(s) with a finite "
        f"loss, every other step's loss non-finite); the first the backward pass reached: {first}: "
        "no precision policy trains it (every update would be skipped). Fix the model (a sqrt, log or division at "
        "0, whose derivative is infinite there), then run the doctor again (mixprec.NonFiniteTracer names the "
        "first module that makes a non-finite gradient)"
    )


def _broken_in_fp32(nonfinite: tuple[str, ...], steps: int) -> str:
    return (
        f"the model makes inf or NaN already in FP32, in every one of {steps} recorded step(s), starting in "
        f"{_first_place(nonfinite)} "
        f"({len(nonfinite)} place(s) in all): no precision policy trains it (every update would be skipped). "
        "Fix the model, its initialization or its inputs, then run the doctor again (in a training loop, "
        "mixprec.NonFiniteTracer names the first module that makes a non-finite value)"
    )


def _check_run_arguments(batches: Any, steps: Any, formats: Any, keep: Any) -> None:
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"diagnose(steps=...): received {steps!r}; use a positive number of batches.")
    if not isinstance(keep, (int, float)) or isinstance(keep, bool) or not 0 < keep <= 1:
        raise ValueError(f"diagnose(keep=...): received {keep!r}; use a fraction in (0, 1], e.g. 0.999.")
    for name, value in (("batches", batches), ("formats", formats)):
        if not isinstance(value, Iterable):
            raise TypeError(f"diagnose({name}=...) needs an iterable; received {type(value).__name__}.")


def _check_model_and_loss(model: Any, loss_fn: Any) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"diagnose(model=...) needs an nn.Module; received {type(model).__name__}.")
    lowered = next((n for n, p in model.named_parameters() if p.is_floating_point() and p.dtype != torch.float32), None)
    if lowered is not None:
        raise ValueError(
            f"diagnose(model=...) records an FP32 model, to say what 16 bits would do to it; parameter {lowered!r} "
            f"is {model.get_parameter(lowered).dtype}. Diagnose the model before casting it (or MixedPrecision)."
        )
    if not callable(loss_fn):
        raise TypeError(
            f"diagnose(loss_fn=...) needs a callable loss_fn(output, targets) returning a scalar loss; received "
            f"{type(loss_fn).__name__}."
        )


def _record(model: nn.Module, batches: Iterable[Any], loss_fn: Callable, watch: RangeWatch, steps: int) -> tuple:
    """FP32 forward and backward passes over up to ``steps`` batches, recorded by ``watch``; returns the first
    batch (None if there was none), how many losses were non-finite, and how many of the finite ones had inf or
    NaN gradients (two host syncs per batch)."""
    first, nonfinite_losses, nonfinite_grads = None, 0, 0
    for batch in batches:
        if watch.steps >= steps:
            break
        inputs, targets = _inputs_and_targets(batch)
        first = batch if first is None else first
        for p in model.parameters():
            p.grad = None
        output = model(*inputs) if isinstance(inputs, (tuple, list)) else model(inputs)
        loss = loss_fn(output, targets)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise ValueError(f"diagnose(loss_fn=...) must return a one-element loss tensor; it returned {shape}.")
        finite = bool(torch.isfinite(loss).all())
        nonfinite_losses += not finite
        loss.backward()
        if finite:
            grads = [p.grad for p in model.parameters() if p.grad is not None]
            nonfinite_grads += bool(grads) and bool(magnitudes_not_finite(max_magnitudes(grads, loss.device)))
        watch.step()
    return first, nonfinite_losses, nonfinite_grads


def _inputs_and_targets(batch: Any) -> tuple[Any, Any]:
    if not isinstance(batch, (tuple, list)) or len(batch) < 2:
        raise ValueError(
            f"diagnose(batches=...): received a batch of type {type(batch).__name__}; each batch must be "
            "(inputs, targets). Map dict batches first: ((b['input_ids'], b['labels']) for b in loader)."
        )
    return batch[0], batch[1]


def _sixteen_bit_gradients(model: nn.Module, batch: Any, loss_fn: Callable) -> frozenset[tuple[str, str]] | None:
    """Which (module, phase) gradients are 16-bit under mixed_fp16: one forward and backward in its
    region. Activation gradients count where they arrive as fp16; a module's weight gradients where its
    output is fp16 (its GEMM computed them in fp16), unless the weight is shared with another module.
    Norms and embeddings keep FP32 gradients."""
    from mixprec.regions.autocast import autocast

    names = {module: name for name, module in model.named_modules()}
    uses: dict[int, int] = {}
    for module in names:
        for param in module.parameters(recurse=False):
            uses[id(param)] = uses.get(id(param), 0) + 1
    # a tied weight (lm_head = embedding) sums its uses' gradients in FP32; its hook sees only the sum
    shared = {module for module in names if any(uses[id(p)] > 1 for p in module.parameters(recurse=False))}
    found: set[tuple[str, str]] = set()
    handles = []

    def on_output(module: nn.Module, args: tuple, output: Any) -> None:
        name = names[module]
        tensors: list[torch.Tensor] = []
        map_floating(output, lambda t: tensors.append(t) or t)
        for tensor in tensors:
            trainable = any(p.requires_grad for p in module.parameters(recurse=False))
            if tensor.dtype == torch.float16 and trainable and module not in shared:
                found.add((name, "weight_grad"))
            if tensor.requires_grad:
                tensor.register_hook(
                    lambda g, name=name: found.add((name, "backward")) if g.dtype == torch.float16 else None
                )

    for module in names:
        handles.append(module.register_forward_hook(on_output))
    try:
        inputs, targets = batch[0], batch[1]
        with autocast("mixed_fp16", model):
            output = model(*inputs) if isinstance(inputs, (tuple, list)) else model(inputs)
            loss = loss_fn(output, targets)
        loss.backward()
    except (RuntimeError, ValueError, TypeError):
        return None  # the model cannot run under fp16 autocast here: judge every gradient
    finally:
        for handle in handles:
            handle.remove()
        for p in model.parameters():
            p.grad = None
    return frozenset(found) or None


def _format_advice(
    report: DoctorReport, fmt: str, keep: float, scope: frozenset[tuple[str, str]] | None
) -> FormatAdvice:
    activation = report.totals("backward", modules=_names(scope, "backward"))
    weight = report.totals("weight_grad", modules=_names(scope, "weight_grad"))
    parts = [t for t in (activation, weight) if t is not None]
    histogram = parts[0].histogram if parts else Histogram(0, ())
    for part in parts[1:]:
        histogram = histogram + part.histogram
    amax = max((t.amax for t in parts), default=0.0)
    k, kept, reached = recommend_scale(histogram, amax, fmt, keep)
    nonzero = histogram.total

    def lost(total) -> float:  # among the non-zero values, which the histogram counts
        return 0.0 if total is None else total.formats[fmt].underflow * total.values / max(total.histogram.total, 1)

    under = sum(t.formats[fmt].underflow * t.values for t in parts)
    return FormatAdvice(
        format=fmt,
        gradient_values=nonzero,
        lost_without_scaling=under / max(nonzero, 1),
        activation_grads_lost=lost(activation),
        weight_grads_lost=lost(weight),
        gradient_amax=amax,
        recommended_scale=math.ldexp(1.0, k),
        kept_with_scale=kept,
        reaches_keep=reached,
        activations_overflow=tuple(s.module for s in report.overflowing(fmt, "forward")),
        overflow_starts_in=tuple(report.overflow_origins(fmt)),
        overflow_reaches=tuple(report.overflow_reach(fmt)),
        activation_grads_overflow=tuple(s.module for s in report.overflowing(fmt, "backward")),
        scope="gradients computed in 16 bits under mixed_fp16" if scope is not None else "every gradient",
    )


def _names(scope: frozenset[tuple[str, str]] | None, phase: str) -> set[str] | None:
    return None if scope is None else {name for name, p in scope if p == phase}


def _pct(x: float, apart_from: float | None = None) -> str:
    """A share in percent, with enough digits that only an exact 100% reads "100%" (0.99998: "99.998%"), and that
    it reads differently from ``apart_from`` where they differ (99.897% kept against a 99.9% target, not 99.9%)."""
    digits = 3
    text = f"{100 * x:.{digits}g}"
    while digits < 12 and (
        (text == "100" and x < 1) or (apart_from not in (None, x) and text == f"{100 * apart_from:.{digits}g}")
    ):
        digits += 1
        text = f"{100 * x:.{digits}g}"
    return f"{text}%"


def _recommend_policy(
    advice: dict[str, FormatAdvice], keep: float, bf16_supported: bool
) -> tuple[str, float | None, tuple[str, ...]]:
    fp16 = advice["fp16"]
    limit = get_format("fp16").max
    if fp16.overflow_starts_in or fp16.activations_overflow:
        starts = fp16.overflow_starts_in or fp16.activations_overflow
        reasons = [
            f"activations overflow fp16 (largest finite {limit:g}) starting in {', '.join(starts)}; "
            f"{len(fp16.activations_overflow)} module(s) overflow in all",
        ]
        # every module the overflow reaches, its consumers included: the origin alone in FP32 would hand its
        # too-large output to the next 16-bit op. The model itself ("") cannot be named: then all of it is FP32
        reached = fp16.overflow_reaches or starts
        names = "" if "" in reached else "+".join(reached)
        in_fp32 = f"base=mixed_fp16,names={names}" if names else "fp32"
        if bf16_supported:
            reasons.append("bf16 has FP32's exponent range: mixed_bf16 needs no loss scale")
            reasons.append(f"to stay in fp16 instead, keep every module the overflow reaches in FP32: {in_fp32}")
            if names:  # bf16's range where fp16's is too small, at 16-bit speed
                reasons.append(f"or compute just those in bf16: base=mixed_fp16,bf16_names={names}")
            return "mixed_bf16", None, tuple(reasons)
        reasons.append("this device has no bf16: keep every module the overflow reaches in FP32")
        return in_fp32, fp16.recommended_scale if names else None, tuple(reasons)
    scale_text = f"2^{round(math.log2(fp16.recommended_scale))}"
    reasons = [
        f"no activation overflows fp16; without scaling {_pct(fp16.lost_without_scaling)} of non-zero gradient "
        f"values underflow to zero (activation gradients {_pct(fp16.activation_grads_lost)}, weight gradients "
        f"{_pct(fp16.weight_grads_lost)})",
    ]
    if fp16.recommended_scale < 1:
        reasons.append(
            f"the largest gradient, {fp16.gradient_amax:.3g}, overflows fp16 (largest finite {limit:g}) unscaled: "
            "the scale must shrink the gradients"
        )
    if fp16.reaches_keep:
        reasons.append(
            f"loss scale {scale_text} keeps {_pct(fp16.kept_with_scale, apart_from=keep)} of them (target "
            f"{_pct(keep)}) while the "
            f"largest gradient, {fp16.gradient_amax:.3g}, times the scale stays below {limit:g}"
        )
        return "mixed_fp16", fp16.recommended_scale, tuple(reasons)
    reasons.append(
        f"no loss scale keeps {_pct(keep)}: at {scale_text}, the largest without overflow, "
        f"{_pct(fp16.kept_with_scale, apart_from=keep)} are kept"
    )
    if bf16_supported:
        reasons.append("bf16 keeps FP32's exponent range: use mixed_bf16")
        return "mixed_bf16", None, tuple(reasons)
    return "mixed_fp16", fp16.recommended_scale, tuple(reasons)
