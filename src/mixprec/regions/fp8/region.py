"""Where a policy's FP8 recipe applies: the model's GEMM layers, minus the ones it keeps.

Inside :func:`fp8_region` each selected GEMM layer (:mod:`mixprec.regions.fp8.gemm_layers`) computes
through :func:`mixprec.regions.fp8.fp8_linear`
(its ``forward`` is routed there for the region and restored on exit, exceptions included). The scale
states (amax histories) live in an :class:`Fp8State` per model, which persists across regions and
belongs in checkpoints (``MixedPrecision.state_dict`` includes it).

A prepared region (:class:`mixprec.regions.Region`, the one ``MixedPrecision`` keeps) routes the
forwards once, as it installs its output cast once, and entering it only sets the state's output
dtype; outside a region the layers run their own forward. So torch.compile traces a step without
graph breaks and a compiled model is not recompiled because forwards came and went (a forward set and
deleted within one traced step, besides, is replayed by the compiler as a bare delete, which fails).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Collection, Iterator

import torch
from torch import nn

from mixprec.policy.fp8_recipe import Fp8Recipe
from mixprec.regions.casting import unwrapped
from mixprec.regions.fp8.gemm import recipe_uses_kernel
from mixprec.regions.fp8.gemm_layers import GemmSelection, Operands, select_gemm_layers
from mixprec.regions.fp8.linear import Fp8LinearState, fp8_linear
from mixprec.regions.fp8.shape_speed import SpeedTable, decides_by_speed
from mixprec.regions.routing import Link, Seat, Seated, new_token, route_links, seat_of, unroute

__all__ = ["Fp8State", "fp8_layers", "fp8_region", "fp8_state", "gemm_selection"]

# The model's Fp8State sits in the model's own __dict__, as its seat does: a weak-keyed table would keep a model
# that is itself a GEMM layer alive forever (its state holds the layer, so the key never dies).
_STATE = "_mixprec_fp8_state"


def fp8_layers(
    model: nn.Module, recipe: Fp8Recipe, fp32: Collection[str] = (), bf16: Collection[str] = ()
) -> list[tuple[str, nn.Module]]:
    """The GEMM layers computed in FP8 (:mod:`mixprec.regions.fp8.gemm_layers`: ``nn.Linear``, transformers'
    ``Conv1D``, the ``mixprec_gemm`` protocol): all of them, less those ``recipe.keep`` keeps ("first" and
    "last" in the model's registration order, "head", name globs) and those ``recipe.only``'s globs leave out,
    those in the modules named in ``fp32`` and ``bf16`` (the
    policy's FP32 modules and an fp16 policy's bf16 modules, with everything inside them) and, where the FP8 GEMM
    kernel runs, shapes it refuses. :func:`gemm_selection` gives the kept ones with their reasons."""
    return [(name, module) for name, module, _ in gemm_selection(model, recipe, fp32, bf16).fp8]


def gemm_selection(
    model: nn.Module, recipe: Fp8Recipe, fp32: Collection[str] = (), bf16: Collection[str] = ()
) -> GemmSelection:
    """The model's GEMM layers in FP8 and those kept, each with the reason, for ``recipe`` on the model's device."""
    param = next(model.parameters(), None)
    kernel = param is not None and recipe_uses_kernel(recipe, param.device)
    selection = select_gemm_layers(model, recipe.keep, fp32, kernel, only=recipe.only, bf16=bf16)
    selection.precision = recipe.precision
    return selection


class Fp8State:
    """The scale states of a model's FP8 layers, by module name, and the region's output dtype.

    A region routes each selected layer's forward through one of its :meth:`links`: FP8 while ``out_dtype`` is set
    (inside a region) and the region is the one entered last on the model, the forward it replaced otherwise.
    """

    def __init__(
        self, model: nn.Module, recipe: Fp8Recipe, fp32: Collection[str] = (), bf16: Collection[str] = ()
    ) -> None:
        self.recipe, self.fp32, self.bf16 = recipe, tuple(fp32), tuple(bf16)
        self.selection = gemm_selection(model, recipe, self.fp32, self.bf16)  # chosen once
        self.modules = {name: module for name, module, _ in self.selection.fp8}
        self._operands = {name: operands for name, _, operands in self.selection.fp8}
        devices = {name: self._operands[name](module)[0].device for name, module in self.modules.items()}
        self.layers = {name: Fp8LinearState(recipe, device) for name, device in devices.items()}
        # shapes=faster (auto where the FP8 kernel runs): each layer in FP8 only where its shape measured faster
        device = next(iter(devices.values()), torch.device("cpu"))
        self.speeds = SpeedTable(recipe, device) if decides_by_speed(recipe, device) else None
        if self.speeds is not None:
            self.selection.speeds = self.speeds.decided  # the plan reads the decisions as they are made
        self.out_dtype: torch.dtype | None = None  # set while a region computes in FP8
        self.refuse: Callable[[str], None] | None = None  # and the region's foreign-recompute refusal
        self._boundary = self._delayed_copies()  # the delayed histories at the last update (end_window)

    def links(self, owner: int, seat: Seat) -> list[Link]:
        """The selected layers' forwards through this state for ``owner`` (a region's token; ``seat``, its model's),
        to route (:func:`route_links`) on top of what is there (another region's routing, of this state or another
        recipe's)."""
        links = []
        for name, module in self.modules.items():
            link = _Fp8Forward(name, module, self.layers[name], self, self._operands[name])
            link.owner, link.seat = owner, seat
            links.append(link)
        return links

    def remove(self, owner: int) -> None:
        """Take ``owner``'s routing out of the layers (another region's stays)."""
        for module in self.modules.values():
            unroute(module, owner)

    @contextlib.contextmanager
    def computing(self, out_dtype: torch.dtype, refuse: Callable[[str], None] | None = None) -> Iterator[Fp8State]:
        """The installed layers compute in FP8 inside, with outputs in ``out_dtype``; each calls ``refuse`` first
        with what it does."""
        previous = self.out_dtype, self.refuse
        self.out_dtype, self.refuse = out_dtype, refuse
        try:
            yield self
        finally:
            self.out_dtype, self.refuse = previous

    @property
    def keeps_histories(self) -> bool:
        """Whether the scales come from amax histories (delayed scaling), which end_window maintains."""
        return self.recipe.scaling == "delayed"

    def _delayed(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The delayed scale states' histories and counts (none under other scalings)."""
        if not self.keeps_histories:
            return [], []
        roles = [role for layer in self.layers.values() for role in (layer.input, layer.weight, layer.grad)]
        return [role.history for role in roles], [role.recorded for role in roles]

    def _delayed_copies(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        histories, counts = self._delayed()
        # one foreach call each (a multiply by one: an exact copy); the lists are empty but under delayed scaling
        return (torch._foreach_mul(histories, 1.0), torch._foreach_mul(counts, 1)) if histories else ([], [])

    def end_window(self, skipped: bool | torch.Tensor, loss_scale_change: torch.Tensor | float | None = None) -> None:
        """At an update (applied or skipped): a skipped update's amaxes, recorded by its window's forwards and
        backwards as they ran, are taken back out of the delayed histories, which return to what they were at the
        last update; then these are kept for the next. ``skipped``: known on the host, or a device flag (a fused
        optimizer that skips on the device; no host sync: the histories are masked with it).
        ``loss_scale_change``: the new loss scale over the one the window's gradients carried (on the device or
        the host); the gradient histories are multiplied by it.

        Why: an update skips because a gradient overflowed, and its finite amaxes (a gradient amax of 1e36 whose
        weight gradient overflowed) would otherwise scale the next ``history`` steps' gradients to zero. And the
        gradients' amaxes carry the loss scale: kept as they were, after the scale doubled the next step's largest
        gradients saturated at the format's largest value (up to 2x), and after it halved they used half the
        range for ``history`` steps."""
        histories, counts = self._delayed()
        if not histories:
            return
        saved_histories, saved_counts = self._boundary
        if len(saved_histories) == len(histories) and skipped is not False:
            if skipped is True:
                torch._foreach_copy_(histories, saved_histories)
                torch._foreach_copy_(counts, saved_counts)
            else:  # live * (1 - skipped) + saved * skipped: exact, every history value finite
                for live, saved, flag in (
                    (histories, saved_histories, skipped.reshape(()).float()),
                    (counts, saved_counts, skipped.reshape(()).long()),
                ):
                    torch._foreach_mul_(live, 1 - flag)
                    torch._foreach_add_(live, torch._foreach_mul(saved, flag))
        if loss_scale_change is not None:  # a power of two (growth 2, backoff 0.5): exact
            torch._foreach_mul_([layer.grad.history for layer in self.layers.values()], loss_scale_change)
        self._boundary = self._delayed_copies()

    def state_dict(self) -> dict:
        return {name: layer.state_dict() for name, layer in self.layers.items()}

    def load_state_dict(self, state: dict) -> None:
        unknown = set(state) - set(self.layers)
        if unknown:
            raise ValueError(f"FP8 state for layers this model does not compute in FP8: {sorted(unknown)}")
        for name, layer_state in state.items():
            self.layers[name].load_state_dict(layer_state)
        self._boundary = self._delayed_copies()  # a loaded state is an update's


class _Fp8Forward(Link):
    """A selected GEMM layer's forward: FP8 while its region is the one entered last on the model, the forward it
    replaced otherwise.

    An object rather than a closure, so that ``copy.deepcopy`` of the model gives the copy a forward
    bound to the copy (a closure would keep computing with the original's weights) and pickling works.
    """

    def __init__(
        self, name: str, module: nn.Module, layer: Fp8LinearState, state: Fp8State, operands: Operands
    ) -> None:
        self.name, self.module, self.layer, self.state, self.operands = name, module, layer, state, operands

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        module, out_dtype = self.module, self.state.out_dtype
        if out_dtype is None or not self.computes():
            return self.__wrapped__(x)
        if self.state.refuse is not None:
            self.state.refuse("the policy's FP8 GEMM layers")
        weight, bias = self.operands(module)
        speeds = self.state.speeds
        if speeds is not None and not speeds.pays(self.name, x, weight, bias, out_dtype):
            return self.__wrapped__(x)  # its shape measured slower in FP8: the compute dtype
        return fp8_linear(x, weight, bias, self.layer, out_dtype, torch.is_grad_enabled())


def fp8_state(model: nn.Module, recipe: Fp8Recipe, fp32: Collection[str] = (), bf16: Collection[str] = ()) -> Fp8State:
    """The model's FP8 state for ``recipe``, its GEMM layers outside the ``fp32`` and ``bf16`` modules (created on
    first use, replaced if the recipe or those modules change)."""
    state = vars(model).get(_STATE)
    if state is None or state.recipe != recipe or (state.fp32, state.bf16) != (tuple(fp32), tuple(bf16)):
        state = vars(model)[_STATE] = Fp8State(model, recipe, fp32, bf16)
    return state


@contextlib.contextmanager
def fp8_region(
    model: nn.Module, recipe: Fp8Recipe, out_dtype: torch.dtype, fp32: Collection[str] = ()
) -> Iterator[Fp8State]:
    """Compute the model's selected GEMM layers in FP8 inside; outputs in ``out_dtype``.

    The layers' forward is routed on entry and restored on exit. A region entered many times
    (:class:`mixprec.regions.Region`) installs the routing once and only sets the output dtype on entry
    (:meth:`Fp8State.computing`): a compiled step then changes no module attribute.
    """
    state, owner, seat = fp8_state(model, recipe, fp32), new_token(), seat_of(unwrapped(model))
    route_links(state.links(owner, seat))
    try:
        with state.computing(out_dtype), Seated([seat], owner, False):
            yield state
    finally:
        state.remove(owner)
