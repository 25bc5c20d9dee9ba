"""The doctor per FP8 recipe: what each scaling recipe would do to each GEMM layer's output, and which layers
to keep out of FP8.

For every GEMM layer of the model (:mod:`mixprec.regions.fp8.gemm_layers`: Linear, Conv1D, the protocol), on
the inputs the model's forward gives it over a few batches, both operands (input and weight) are rounded the
way each recipe rounds them and the layer's product is computed from them in FP32, against the same product
from bf16 operands (what the layer computes without FP8):

    tensorwise   fp8_e4m3, one power-of-two scale per tensor from its amax (the ``current`` recipe)
    rowwise      fp8_e4m3, a power-of-two scale per row of the input and per output row of the weight
    blockwise    fp8_e4m3, power-of-two scales per 1x128 tile of the input and 128x128 tile of the weight
    mxfp8_e4m3, mxfp8_e5m2, mxfp4, nvfp4    the block-scaled formats (:mod:`mixprec.numerics.block_formats`),
                 blocks along the reduction dimension of both operands; nvfp4's weight in 16x16 tiles, as the
                 training recipe ``scaling=nvfp4`` holds it (:mod:`mixprec.regions.fp8.fp4`)

Per layer and recipe: the output's relative error, per row (token or sample: the norm of the row's difference
over the bf16 row's norm, averaged over the rows; a norm over the whole output would let one outlier row hide
every other row's loss),
the share of the operands' nonzero elements rounded to zero (underflow), and the share clipped at the top of
their block (saturated: more than the format's rounding below their block's largest representable value).
The advice keeps out of a recipe the layers whose error is past ``outlier`` times its typical well-behaved
layer's (the lower quartile of the layers' errors: a median would hide a model whose half is hurt).
Forward GEMMs only; gradients (e5m2 in the hybrid recipes) are left to ``diagnose``'s ranges.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from mixprec.numerics.block_formats import BLOCK_FORMATS
from mixprec.numerics.formats import get_format
from mixprec.numerics.quantize import quantize
from mixprec.regions.fp8.blockwise import BLOCK, round_tiles
from mixprec.regions.fp8.fp4 import NVFP4_TILES, nvfp4_weight, tiles
from mixprec.regions.fp8.gemm_layers import select_gemm_layers

__all__ = ["FP8_RECIPES", "Fp8RecipeReport", "RecipeFit", "fp8_recipe_report"]

FP8_RECIPES = ("tensorwise", "rowwise", "blockwise", "mxfp8_e4m3", "mxfp8_e5m2", "mxfp4", "nvfp4")
_E4M3 = get_format("fp8_e4m3")


@dataclass(frozen=True)
class RecipeFit:
    """One GEMM layer under one recipe."""

    layer: str
    recipe: str
    error: float  # mean over output rows of ||y_recipe - y_bf16|| / ||y_bf16||
    underflow: float  # share of nonzero operand elements rounded to zero
    saturated: float  # share of operand elements clipped at the top of their block


@dataclass
class Fp8RecipeReport:
    """Every GEMM layer under every recipe, and the layers each recipe should keep out of FP8."""

    fits: list[RecipeFit] = field(default_factory=list)
    keep: dict[str, list[str]] = field(default_factory=dict)  # by recipe: the layers to keep in bf16
    outlier: float = 4.0

    def fit(self, layer: str, recipe: str) -> RecipeFit:
        return next(f for f in self.fits if f.layer == layer and f.recipe == recipe)

    @property
    def layers(self) -> list[str]:
        return list(dict.fromkeys(f.layer for f in self.fits))

    @property
    def recipes(self) -> list[str]:
        return list(dict.fromkeys(f.recipe for f in self.fits))

    def best(self) -> str | None:
        """The recipe with the smallest median error over every layer (None without layers): one that must keep
        layers out of FP8 to do well pays for them here."""
        medians = {r: statistics.median(f.error for f in self.fits if f.recipe == r) for r in self.recipes}
        return min(medians, key=medians.get) if medians else None

    def to_dict(self) -> dict:
        return {"fits": [asdict(f) for f in self.fits], "keep": self.keep, "outlier": self.outlier}


def _round(t: torch.Tensor, recipe: str, weight: bool) -> torch.Tensor:
    """``t`` (rows, K) as ``recipe`` rounds an input (``weight`` False) or a weight, in FP32: the training
    recipes' own casts (:func:`~mixprec.regions.fp8.blockwise.round_tiles`) and block formats."""
    rows, k = t.shape
    shapes = {"tensorwise": (rows, k), "rowwise": (1, k), "blockwise": (BLOCK if weight else 1, BLOCK)}
    if recipe in shapes:
        return round_tiles(t, _E4M3, *shapes[recipe])
    return nvfp4_weight(t) if recipe == "nvfp4" and weight else quantize(t, recipe)


def _top_gap(recipe: str) -> float:
    element = BLOCK_FORMATS[recipe].element if recipe in BLOCK_FORMATS else _E4M3
    return 1 + element.eps / 2


def _saturated(t: torch.Tensor, rounded: torch.Tensor, recipe: str, weight: bool) -> int:
    """Elements more than the format's rounding past the largest magnitude their block kept."""
    if recipe not in BLOCK_FORMATS:  # scales from the amax: nothing passes the top by construction
        return 0
    block = BLOCK_FORMATS[recipe].block
    if recipe == "nvfp4" and weight:  # a block is a 16x16 tile: laid out as a row of 256
        t, rounded, block = tiles(t), tiles(rounded), NVFP4_TILES.block
    k = t.shape[-1]
    pad = (0, -k % block)
    values = torch.nn.functional.pad(t.abs(), pad).reshape(t.shape[0], -1, block)
    kept = torch.nn.functional.pad(rounded.abs(), pad).reshape(t.shape[0], -1, block)
    top = kept.amax(dim=-1, keepdim=True)
    return int((values > top * _top_gap(recipe)).sum())


class _Tally:
    """Sums over batches for one layer and recipe."""

    def __init__(self) -> None:
        self.errors = 0.0  # summed relative errors of the rows
        self.rows = self.nonzero = self.flushed = self.elements = self.saturated = 0

    def fit(self, layer: str, recipe: str) -> RecipeFit:
        error = self.errors / self.rows if self.rows else 0.0
        return RecipeFit(
            layer,
            recipe,
            error,
            self.flushed / self.nonzero if self.nonzero else 0.0,
            self.saturated / self.elements if self.elements else 0.0,
        )


def fp8_recipe_report(
    model: nn.Module,
    batches: Iterable[object],
    forward: Callable[[nn.Module, object], object],
    steps: int = 4,
    recipes: tuple[str, ...] = FP8_RECIPES,
    outlier: float = 4.0,
    max_rows: int = 4096,
) -> Fp8RecipeReport:
    """Run ``forward(model, batch)`` on ``steps`` batches without gradients and measure every GEMM layer under
    every recipe (see the module docstring); ``max_rows``: the input rows per batch and layer kept for it."""
    unknown = [r for r in recipes if r not in FP8_RECIPES]
    if unknown:
        raise ValueError(f"recipes: received {unknown}; use names from {', '.join(FP8_RECIPES)}.")
    if not outlier > 1:
        raise ValueError(f"outlier: received {outlier!r}; use a factor above 1 (the default 4).")
    selection = select_gemm_layers(model, keep=())
    tallies = {(name, r): _Tally() for name, _, _ in selection.fp8 for r in recipes}
    handles = []
    for name, module, operands in selection.fp8:

        def measure(mod, args, name=name, operands=operands):
            weight = operands(mod)[0].detach().float()
            x = args[0].detach().float().reshape(-1, weight.shape[-1])[:max_rows]
            reference = x.bfloat16().float() @ weight.bfloat16().float().t()
            for recipe in recipes:
                xq, wq = _round(x, recipe, weight=False), _round(weight, recipe, weight=True)
                tally = tallies[(name, recipe)]
                norms = reference.norm(dim=-1)
                counted = norms > 0
                relative = (xq @ wq.t() - reference).norm(dim=-1)[counted] / norms[counted]
                tally.errors += float(relative.sum())
                tally.rows += int(counted.sum())
                for t, q, is_weight in ((x, xq, False), (weight, wq, True)):
                    nonzero = t != 0
                    tally.nonzero += int(nonzero.sum())
                    tally.flushed += int((nonzero & (q == 0)).sum())
                    tally.elements += t.numel()
                    tally.saturated += _saturated(t, q, recipe, is_weight)

        handles.append(module.register_forward_pre_hook(measure))
    try:
        with torch.no_grad():
            for step, batch in enumerate(batches):
                if step >= steps:
                    break
                forward(model, batch)
    finally:
        for handle in handles:
            handle.remove()
    report = Fp8RecipeReport([t.fit(layer, recipe) for (layer, recipe), t in tallies.items()], outlier=outlier)
    for recipe in recipes:
        errors = {f.layer: f.error for f in report.fits if f.recipe == recipe}
        baseline = _lower_quartile(errors.values())
        report.keep[recipe] = [layer for layer, error in errors.items() if baseline > 0 and error > outlier * baseline]
    return report


def _lower_quartile(errors: Iterable[float]) -> float:
    """The error a quarter of the layers stay under (zeros, layers that saw no input, left out)."""
    ordered = sorted(e for e in errors if e > 0)
    return ordered[len(ordered) // 4] if ordered else 0.0
