"""The layers a tune decides on: their training shapes, and which formats each may take, with the reasons.

Three families: the GEMM layers (every layer FP8 can compute, :mod:`mixprec.regions.fp8.gemm_layers`), the
convolutions (torch's Conv1d/2d/3d, transposed ones left to the base) and the attention (the model's calls of
``F.scaled_dot_product_attention``, one entry named ``ATTENTION``: a policy computes them all in FP32 or none),
which take FP32 or 16 bits. The shapes come from one FP32 forward of a training batch (hooks on those layers, a
torch function mode for the attention calls: self-attention of one shape; a mask is not timed). The formats come
from the doctor's statistics on a few training batches:

- a layer whose outputs or inputs overflow the base policy's 16-bit format (fp16's 65504) leaves it: the 16-bit
  compute would turn them into inf. It takes FP32, or, in an fp16 base where bf16 can run, bf16 (``bf16_names``:
  FP32's exponent range at 16-bit speed) unless its values overflow bf16 too; the cost model picks between them;
- a layer whose FP8 output error (current tensorwise scaling, against bf16) is an outlier among the model's
  layers (past ``outlier`` times their lower quartile, the doctor's FP8 advice) or whose values saturate e4m3
  stays out of FP8;
- every other GEMM layer may take FP32, the 16-bit compute or FP8, a convolution FP32 or the 16 bits; the search
  then decides by cost and by trial.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from mixprec.app.tune.cost import ATTENTION_OP, BF16, AttentionShape, ConvShape, GemmShape, LayerShape
from mixprec.doctor import diagnose, fp8_recipe_report
from mixprec.numerics import get_format
from mixprec.regions.fp8 import select_gemm_layers

__all__ = ["ATTENTION", "LayerChoice", "layer_choices", "layer_shapes"]


@dataclass(frozen=True)
class LayerChoice:
    """One layer: its shape, the formats it may take, why any other is out, and its FP8 error."""

    name: str
    shape: LayerShape
    formats: tuple[str, ...]
    reasons: dict[str, str] = field(default_factory=dict)  # a format left out -> why
    fp8_error: float = 0.0  # relative output error under FP8 against bf16 (the doctor's); the search's order


ATTENTION = f"{ATTENTION_OP}()"  # the attention's name among the layers: no module can be named so


def layer_shapes(
    model: nn.Module,
    inputs: Any,
    forward: Callable[[nn.Module, Any], Any],
    progress: Callable[[str], None] = lambda message: None,
) -> dict[str, LayerShape]:
    """Each GEMM layer's training product, each convolution's input and the attention calls (as ``ATTENTION``),
    from one FP32 forward of ``inputs`` without gradients (a layer called several times adds its rows, or its
    samples at the same size); attention the cost model cannot stand for is left out, said to ``progress``."""
    shapes: dict[str, LayerShape] = {}
    # A model that is itself one layer (its name is ""): a policy cannot name it (names= takes names), and the
    # uniform policies the search compares stand for it (a "names=" policy was written before 2026-11-28)
    layers = [(name, operands) for name, _, operands in select_gemm_layers(model, keep=()).fp8 if name]
    hooks = {name: _gemm_hook(name, operands, shapes) for name, operands in layers}
    convolutions = {
        name: module
        for name, module in model.named_modules()
        if isinstance(module, nn.modules.conv._ConvNd) and not module.transposed and name and name not in hooks
    }
    hooks.update({name: _conv_hook(name, shapes) for name in convolutions})
    modules = dict(model.named_modules())
    handles = [modules[name].register_forward_pre_hook(hook) for name, hook in hooks.items()]
    try:
        with torch.no_grad(), _AttentionCalls() as attention:
            forward(model, inputs)
    finally:
        for handle in handles:
            handle.remove()
    shape, why_not = attention.shape()
    if shape is not None:
        shapes[ATTENTION] = shape
    elif why_not:
        progress(f"tune: attention not searched: {why_not}")
    return shapes


class _AttentionCalls(TorchFunctionMode):
    """The shapes of the ``F.scaled_dot_product_attention`` calls of a forward: (query, key, causal, masked)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[tuple[int, ...], tuple[int, ...], bool, bool]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            named = dict(zip(("query", "key", "value", "attn_mask", "dropout_p", "is_causal"), args, strict=False))
            named.update(kwargs)
            query, key = named["query"], named["key"]
            masked = named.get("attn_mask") is not None
            self.calls.append((tuple(query.shape), tuple(key.shape), bool(named.get("is_causal", False)), masked))
        return func(*args, **kwargs)

    def shape(self) -> tuple[AttentionShape | None, str]:
        """One shape for all the calls, or None and why (none: no reason to give)."""
        if not self.calls:
            return None, ""
        kinds = set(self.calls)
        query, key, causal, _ = self.calls[0]
        if len(kinds) > 1:
            return None, f"its {len(self.calls)} calls have {len(kinds)} shapes (the cost model takes one)"
        if len(query) != 4 or query != key:
            return None, f"query {query} and key {key}: the cost model times batched self-attention"
        batch, heads, length, head_dim = query
        return AttentionShape(len(self.calls), batch, heads, length, head_dim, causal), ""


def _gemm_hook(name: str, operands: Callable, shapes: dict[str, LayerShape]) -> Callable:
    def count(module: nn.Module, args: tuple) -> None:
        out_features, in_features = (int(v) for v in operands(module)[0].shape[-2:])
        before = shapes.get(name)
        rows = args[0].numel() // in_features + (before.m if isinstance(before, GemmShape) else 0)
        shapes[name] = GemmShape(rows, in_features, out_features)

    return count


def _conv_hook(name: str, shapes: dict[str, LayerShape]) -> Callable:
    def record(module: nn.Module, args: tuple) -> None:
        x = args[0] if args[0].dim() == len(module.kernel_size) + 2 else args[0].unsqueeze(0)  # unbatched input
        shape, before = ConvShape.of(module, x), shapes.get(name)
        if before is None:
            shapes[name] = shape
        elif before.size == shape.size:  # called again at the same size: its samples add
            shapes[name] = replace(before, batch=before.batch + shape.batch)

    return record


def layer_choices(
    model: nn.Module,
    batches: Iterable[Any],
    loss_fn: Callable,
    shapes: dict[str, LayerShape],
    sixteen: str,
    steps: int = 4,
    outlier: float = 4.0,
    bf16: bool = False,
) -> dict[str, LayerChoice]:
    """Each layer's allowed formats from the doctor's statistics over ``steps`` of ``batches`` ((inputs, targets)
    pairs): ``sixteen`` is the base policy's 16-bit format (bf16 or fp16); ``bf16``: whether a layer of an fp16
    base that overflows it may take bf16 (the device runs bf16, the profile times it)."""
    batches = list(itertools.islice(batches, steps))
    bf16 = bf16 and sixteen == "fp16"
    formats = [sixteen, "fp8_e4m3", *(["bf16"] if bf16 else [])]
    report = diagnose(model, iter(batches), loss_fn, steps=steps, formats=formats).report
    fp8 = fp8_recipe_report(model, (x for x, _ in batches), lambda m, x: m(x), steps, ("tensorwise",), outlier)
    top = get_format(sixteen).max
    choices = {}
    for name, shape in shapes.items():
        reasons, formats = {}, list(shape.formats)
        if shape.kind == "convolution":
            reasons["fp8"] = "a convolution: FP8 computes GEMM layers only (Linear, Conv1D, the mixprec_gemm protocol)"
        elif shape.kind == "attention":
            reasons["fp8"] = (
                "attention's products: FP8 computes GEMM layers only (Linear, Conv1D, the mixprec_gemm protocol)"
            )
        stats = _forward_stats(report, name)
        reach = max(stats.amax, stats.input_amax or 0.0) if stats is not None else 0.0
        if stats is not None and (stats.overflows(sixteen) or reach > top):
            wider = bf16 and shape.kind != "attention" and not stats.overflows("bf16")
            wider = wider and reach <= get_format("bf16").max
            kept = "bf16 or FP32" if wider else "kept in FP32"
            reasons["16"] = f"its values reach {reach:.3g}, past {sixteen}'s largest {top:.6g}: {kept}"
            reasons["fp8"] = reasons.get("fp8", reasons["16"])
            formats = ["fp32", BF16] if wider else ["fp32"]
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
