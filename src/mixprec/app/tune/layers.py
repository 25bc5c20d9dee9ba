"""The GEMM layers a tune decides on: their training shapes, and which formats each may take, with the reasons.

The shapes come from one FP32 forward of a training batch (hooks on every layer FP8 can compute:
:mod:`mixprec.regions.fp8.gemm_layers`). The formats come from the doctor's statistics on a few training batches:

- a layer whose outputs or inputs overflow the base policy's 16-bit format (fp16's 65504) stays FP32: the
  16-bit compute would turn them into inf;
- a layer whose FP8 output error (current tensorwise scaling, against bf16) is an outlier among the model's
  layers (past ``outlier`` times their lower quartile, the doctor's FP8 advice) or whose values saturate e4m3
  stays out of FP8;
- every other layer may take FP32, the 16-bit compute or FP8; the search then decides by cost and by trial.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from mixprec.app.tune.cost import GemmShape
from mixprec.doctor import diagnose, fp8_recipe_report
from mixprec.numerics import get_format
from mixprec.regions.fp8 import select_gemm_layers

__all__ = ["LayerChoice", "gemm_shapes", "layer_choices"]


@dataclass(frozen=True)
class LayerChoice:
    """One GEMM layer: its shape, the formats it may take, why any other is out, and its FP8 error."""

    name: str
    shape: GemmShape
    formats: tuple[str, ...]
    reasons: dict[str, str] = field(default_factory=dict)  # a format left out -> why
    fp8_error: float = 0.0  # relative output error under FP8 against bf16 (the doctor's); the search's order


def gemm_shapes(model: nn.Module, inputs: Any, forward: Callable[[nn.Module, Any], Any]) -> dict[str, GemmShape]:
    """Each FP8-capable GEMM layer's training product, from one FP32 forward of ``inputs`` without gradients (a
    layer called several times adds its rows)."""
    rows: dict[str, int] = {}
    layers = {name: (module, operands) for name, module, operands in select_gemm_layers(model, keep=()).fp8}
    handles = []
    for name, (module, operands) in layers.items():

        def count(mod: nn.Module, args: tuple, name: str = name, operands=operands) -> None:
            k = operands(mod)[0].shape[-1]
            rows[name] = rows.get(name, 0) + args[0].numel() // k

        handles.append(module.register_forward_pre_hook(count))
    try:
        with torch.no_grad():
            forward(model, inputs)
    finally:
        for handle in handles:
            handle.remove()
    shapes = {}
    for name, m in rows.items():
        module, operands = layers[name]
        out_features, in_features = operands(module)[0].shape[-2:]
        shapes[name] = GemmShape(m, int(in_features), int(out_features))
    return shapes


def layer_choices(
    model: nn.Module,
    batches: Iterable[Any],
    loss_fn: Callable,
    shapes: dict[str, GemmShape],
    sixteen: str,
    steps: int = 4,
    outlier: float = 4.0,
) -> dict[str, LayerChoice]:
    """Each layer's allowed formats from the doctor's statistics over ``steps`` of ``batches`` ((inputs, targets)
    pairs): ``sixteen`` is the base policy's 16-bit format (bf16 or fp16)."""
    batches = list(itertools.islice(batches, steps))
    report = diagnose(model, iter(batches), loss_fn, steps=steps, formats=[sixteen, "fp8_e4m3"]).report
    fp8 = fp8_recipe_report(model, (x for x, _ in batches), lambda m, x: m(x), steps, ("tensorwise",), outlier)
    top = get_format(sixteen).max
    choices = {}
    for name, shape in shapes.items():
        reasons, formats = {}, ["fp32", "16", "fp8"]
        stats = _forward_stats(report, name)
        reach = max(stats.amax, stats.input_amax or 0.0) if stats is not None else 0.0
        if stats is not None and (stats.overflows(sixteen) or reach > top):
            reasons["16"] = f"its values reach {reach:.3g}, past {sixteen}'s largest {top:.6g}: kept in FP32"
            reasons["fp8"] = reasons["16"]
            formats = ["fp32"]
        fit = fp8.fit(name, "tensorwise") if name in fp8.layers else None
        if "fp8" in formats and fit is not None:
            if name in fp8.keep["tensorwise"]:
                reasons["fp8"] = (
                    f"its FP8 output error {100 * fit.error:.2f}% is past {outlier:g}x the layers' lower quartile "
                    "(the doctor's FP8 advice)"
                )
            elif fit.saturated > 0:
                reasons["fp8"] = f"{100 * fit.saturated:.3f}% of its values saturate e4m3"
            if "fp8" in reasons:
                formats.remove("fp8")
        error = fit.error if fit is not None else 0.0
        choices[name] = LayerChoice(name, shape, tuple(formats), reasons, error)
    return choices


def _forward_stats(report: Any, name: str) -> Any:
    try:
        return report.get(name, "forward")
    except KeyError:  # a layer the recorded batches never reached
        return None
