"""Where a policy's FP8 recipe applies: the model's Linear layers, minus the ones it keeps.

Inside :func:`fp8_region` each selected ``nn.Linear`` computes through :func:`mixprec.regions.fp8.fp8_linear`
(its ``forward`` is swapped for the region and restored on exit, exceptions included). The scale
states (amax histories) live in an :class:`Fp8State` per model, which persists across regions and
belongs in checkpoints (``MixedPrecision.state_dict`` includes it).
"""

from __future__ import annotations

import contextlib
import fnmatch
import weakref
from collections.abc import Iterator

import torch
from torch import nn

from mixprec.policy.fp8_recipe import Fp8Recipe
from mixprec.regions.fp8.linear import Fp8LinearState, fp8_linear

__all__ = ["Fp8State", "fp8_layers", "fp8_region", "fp8_state"]

_STATES: weakref.WeakKeyDictionary[nn.Module, Fp8State] = weakref.WeakKeyDictionary()


def fp8_layers(model: nn.Module, recipe: Fp8Recipe) -> list[tuple[str, nn.Linear]]:
    """The Linear layers computed in FP8: all of them, less ``recipe.keep`` ("first" and "last" are
    the first and last Linear layers in the model's registration order)."""
    linears = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    kept = set()
    if linears and "first" in recipe.keep:
        kept.add(linears[0][0])
    if linears and "last" in recipe.keep:
        kept.add(linears[-1][0])
    globs = [k for k in recipe.keep if k not in ("first", "last")]
    return [(n, m) for n, m in linears if n not in kept and not any(fnmatch.fnmatchcase(n, g) for g in globs)]


class Fp8State:
    """The scale states of a model's FP8 layers, by module name."""

    def __init__(self, model: nn.Module, recipe: Fp8Recipe) -> None:
        self.recipe = recipe
        self.modules = dict(fp8_layers(model, recipe))  # chosen once; each region swaps these
        self.layers = {name: Fp8LinearState(recipe) for name in self.modules}

    def state_dict(self) -> dict:
        return {name: layer.state_dict() for name, layer in self.layers.items()}

    def load_state_dict(self, state: dict) -> None:
        unknown = set(state) - set(self.layers)
        if unknown:
            raise ValueError(f"FP8 state for layers this model does not compute in FP8: {sorted(unknown)}")
        for name, layer_state in state.items():
            self.layers[name].load_state_dict(layer_state)


def fp8_state(model: nn.Module, recipe: Fp8Recipe) -> Fp8State:
    """The model's FP8 state for ``recipe`` (created on first use, replaced if the recipe changes)."""
    state = _STATES.get(model)
    if state is None or state.recipe != recipe:
        state = _STATES[model] = Fp8State(model, recipe)
    return state


@contextlib.contextmanager
def fp8_region(model: nn.Module, recipe: Fp8Recipe, out_dtype: torch.dtype) -> Iterator[Fp8State]:
    """Compute the model's selected Linear layers in FP8 inside; outputs in ``out_dtype``."""
    state = fp8_state(model, recipe)
    swapped = []
    try:
        for name, module in state.modules.items():
            layer = state.layers[name]

            def forward(x, module=module, layer=layer):
                return fp8_linear(x, module.weight, module.bias, layer, out_dtype)

            module.forward = forward
            swapped.append(module)
        yield state
    finally:
        for module in swapped:
            del module.forward  # the class's own forward again
