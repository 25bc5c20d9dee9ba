"""Which modules are GEMM layers an FP8 recipe can compute, and which of a model's it computes, with reasons.

A GEMM layer is a module whose forward is ``F.linear(x, weight, bias)`` for some weight of shape
(out, in): FP8 replaces that one product. Recognised:

    nn.Linear                       (weight, bias)
    transformers' Conv1D            (weight.t(), bias): GPT-2's 48 projections, which store (in, out)
    any module with ``mixprec_gemm``  the protocol: a method returning ``(weight, bias)`` with weight (out, in)
                                    (bias may be None) such that forward(x) == F.linear(x, weight, bias)
    a registered type               :func:`register_gemm_layer`: the same for classes one cannot edit

Modules that compute a GEMM some other way are reported as not supported, never converted silently:
convolutions, ``nn.Bilinear``, and the projections of ``nn.MultiheadAttention`` (its forward reads
``out_proj.weight`` itself, so the Linear's own forward never runs).

:func:`select_gemm_layers` walks a model and sorts its GEMM layers into those computed in FP8 and those kept
in the compute dtype, each with the reason: inside an FP32 module of the policy; kept by the recipe ("first",
"last", "head" — the language-model head, a layer whose weight is an embedding's — or a name glob); left out
by the recipe's ``only`` globs (a per-layer policy: FP8 for the layers they match alone); and,
where the FP8 GEMM kernel runs, a shape whose in or out features are not multiples of 16 (the kernel's
requirement; the emulation takes any shape).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from mixprec.regions.casting import attention_projections, enclosing

__all__ = ["GemmSelection", "KeptLayer", "gemm_operands", "register_gemm_layer", "select_gemm_layers"]

Operands = Callable[[nn.Module], tuple[torch.Tensor, torch.Tensor | None]]

_REGISTERED: dict[type, Operands] = {}
GEMM_METHOD = "mixprec_gemm"
KERNEL_ALIGNMENT = 16  # torch._scaled_mm on CUDA: inner and output widths multiples of 16


def register_gemm_layer(module_type: type, operands: Operands) -> None:
    """Let FP8 recipes compute modules of ``module_type`` (and its subclasses): ``operands(module)`` returns
    ``(weight, bias)`` with weight of shape (out, in) such that the module's forward(x) equals
    ``F.linear(x, weight, bias)``."""
    if not (isinstance(module_type, type) and issubclass(module_type, nn.Module)):
        raise TypeError(f"register_gemm_layer(module_type=...) needs an nn.Module subclass; received {module_type!r}.")
    if not callable(operands):
        raise TypeError(f"register_gemm_layer(operands=...) needs a callable; received {operands!r}.")
    _REGISTERED[module_type] = operands


def _linear(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    return module.weight, module.bias


def _conv1d(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    return module.weight.t(), module.bias  # transformers stores (in, out): x @ weight + bias


def _protocol(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    return getattr(module, GEMM_METHOD)()


def _is_transformers_conv1d(module: nn.Module) -> bool:
    kind = type(module)
    return any(k.__name__ == "Conv1D" and k.__module__.startswith("transformers.") for k in kind.__mro__)


def gemm_operands(module: nn.Module) -> Operands | None:
    """How to read ``module``'s (weight, bias) as a GEMM layer, or None if it is not one mixprec computes."""
    for kind in type(module).__mro__:
        if kind in _REGISTERED:
            return _REGISTERED[kind]
    if callable(getattr(module, GEMM_METHOD, None)):
        return _protocol
    if isinstance(module, nn.Linear):
        return _linear
    if _is_transformers_conv1d(module):
        return _conv1d
    return None


_NOT_SUPPORTED = "not supported: "
_UNSUPPORTED = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.Bilinear)


@dataclass(frozen=True)
class KeptLayer:
    """A GEMM layer (or GEMM-like module) left out of FP8, and why."""

    name: str
    kind: str  # the module's class name
    reason: str


@dataclass
class GemmSelection:
    """A model's GEMM layers: those computed in FP8 (name, module, how to read its operands), those kept."""

    fp8: list[tuple[str, nn.Module, Operands]] = field(default_factory=list)
    kept: list[KeptLayer] = field(default_factory=list)
    precision: str = "FP8"  # what the selected layers compute in, as said: "FP8", or "FP4" for the FP4 recipes
    # where the recipe decides by speed (shapes=faster): each selected layer's last measurement by name (a layer not
    # measured yet absent); None where it does not
    speeds: dict[str, Any] | None = None

    def describe(self) -> str:
        """One line: how many GEMM layers run FP8 (or FP4), each kept one with its reason, and the modules not
        supported; deciding by speed, those measured slower for their shape and those not measured yet."""
        unsupported = [k for k in self.kept if k.reason.startswith(_NOT_SUPPORTED)]
        kept = [k for k in self.kept if k not in unsupported] + self._slower()
        total = len(self.fp8) + len(self.kept) - len(unsupported)
        text = f"{total - len(kept)} of {total} GEMM layers in {self.precision}"
        if self.speeds is not None:
            unseen = sum(1 for name, _, _ in self.fp8 if name not in self.speeds)
            text += f" ({self.precision} only where a layer's shape measured faster"
            text += f"; {unseen} not measured yet: each decides at its first pass)" if unseen else ")"
        if kept:
            text += "; kept: " + "; ".join(f"{k.name} ({k.kind}): {k.reason}" for k in kept)
        if unsupported:
            shown = (f"{k.name} ({k.kind}): {k.reason.removeprefix(_NOT_SUPPORTED)}" for k in unsupported)
            text += "; not supported: " + "; ".join(shown)
        return text

    def _slower(self) -> list[KeptLayer]:
        """Selected layers whose shape measured slower in FP8 than in the compute dtype."""
        speeds = self.speeds or {}
        return [
            KeptLayer(name, type(module).__name__, f"FP8 measured slower for its shape ({speeds[name].describe()})")
            for name, module, _ in self.fp8
            if speeds.get(name) is not None and not speeds[name].pays
        ]


def _head_names(model: nn.Module, gemms: list[tuple[str, nn.Module, Operands]]) -> set[str]:
    """The language-model head: GEMM layers whose weight is an embedding's (tied), else a layer named
    ``lm_head``."""
    embedded = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    tied = {name for name, module, _ in gemms if id(getattr(module, "weight", None)) in embedded}
    return tied or {name for name, _, _ in gemms if name.rsplit(".", 1)[-1] == "lm_head"}


def _aligned(module: nn.Module, operands: Operands) -> tuple[bool, str]:
    weight = operands(module)[0]
    out_features, in_features = weight.shape[-2], weight.shape[-1]
    ok = out_features % KERNEL_ALIGNMENT == 0 and in_features % KERNEL_ALIGNMENT == 0
    return ok, f"{in_features} -> {out_features}"


def select_gemm_layers(
    model: nn.Module,
    keep: Collection[str],
    fp32: Collection[str] = (),
    kernel: bool = False,
    only: Collection[str] = (),
    bf16: Collection[str] = (),
) -> GemmSelection:
    """Sort ``model``'s GEMM layers into FP8 and kept (see the module docstring). ``keep``: the recipe's
    entries ("first", "last", "head", name globs); ``fp32``: the policy's FP32 modules by name; ``kernel``:
    whether the FP8 GEMM kernel runs (then shapes it refuses are kept); ``only``: name globs, the layers
    that match none are kept (empty: every layer may run FP8); ``bf16``: an fp16 policy's bf16 modules by name."""
    selection = GemmSelection()
    in_mha = attention_projections(model)
    gemms: list[tuple[str, nn.Module, Operands]] = []
    for name, module in model.named_modules():
        operands = gemm_operands(module)
        if name in in_mha and operands is not None:
            reason = "nn.MultiheadAttention reads its weights itself, not through this layer's forward"
            selection.kept.append(KeptLayer(name, type(module).__name__, _NOT_SUPPORTED + reason))
        elif operands is not None:
            inside = next(
                (shown for shown, names in (("an FP32", fp32), ("a bf16", bf16)) if enclosing(name, names) is not None),
                None,
            )
            if inside is not None:
                selection.kept.append(KeptLayer(name, type(module).__name__, f"inside {inside} module of the policy"))
            else:
                gemms.append((name, module, operands))
        elif isinstance(module, _UNSUPPORTED):
            reason = "not a GEMM layer mixprec computes in FP8 (nn.Linear, Conv1D, mixprec_gemm)"
            selection.kept.append(KeptLayer(name, type(module).__name__, _NOT_SUPPORTED + reason))
    by_recipe: dict[str, str] = {}
    if gemms and "first" in keep:
        by_recipe.setdefault(gemms[0][0], "kept by the recipe (first)")
    if gemms and "last" in keep:
        by_recipe.setdefault(gemms[-1][0], "kept by the recipe (last)")
    if "head" in keep:
        for name in _head_names(model, gemms):
            by_recipe.setdefault(name, "kept by the recipe (head: the language-model head)")
    globs = [k for k in keep if k not in ("first", "last", "head")]
    for name, module, operands in gemms:
        glob = next((g for g in globs if fnmatch.fnmatchcase(name, g)), None)
        if glob is not None:
            by_recipe.setdefault(name, f"kept by the recipe (matches {glob!r})")
        if only and not any(fnmatch.fnmatchcase(name, g) for g in only):
            by_recipe.setdefault(name, f"left out by the recipe (only={'+'.join(only)})")
        if name in by_recipe:
            selection.kept.append(KeptLayer(name, type(module).__name__, by_recipe[name]))
            continue
        aligned, shape = _aligned(module, operands)
        if kernel and not aligned:
            reason = f"shape {shape} not divisible by {KERNEL_ALIGNMENT} (the FP8 GEMM kernel's requirement)"
            selection.kept.append(KeptLayer(name, type(module).__name__, reason))
            continue
        selection.fp8.append((name, module, operands))
    return selection
