"""The low-precision region of a policy, built on ``torch.autocast``.

Inside ``autocast(policy, model)``:
    - matmuls and convolutions run in ``policy.compute_dtype`` (``torch.autocast``'s own op lists);
      where the device has no units for that dtype (fp16 on most CPUs) the same numerics are
      emulated in FP32 (see :mod:`mixprec.compute.emulation` and :func:`compute_plan`);
      with ``tf32``, FP32 matmuls may use TF32 units where the device has them;
    - ops in ``policy.fp32_ops`` run in FP32 (see :mod:`mixprec.regions.op_overrides`);
    - on CPUs under bf16, scaled dot-product attention runs as bf16 GEMMs (see
      :mod:`mixprec.compute.attention`) where the probe measured that faster, unless ``fp32_ops`` lists
      it; only with autograd on: the probe timed forward + backward, and forward alone (inference,
      evaluation) measured no faster on a whole model while the routing costs every op a Python call;
    - modules the policy keeps in FP32 run with autocast off and FP32 inputs, except batch, layer and
      group norms, whose kernels already compute in FP32 from 16-bit inputs (FP32 parameters, output
      in the input's dtype, as cuDNN does);
    - in an fp16 policy, the modules of ``bf16_names`` compute in bf16 (autocast's, or emulated where bf16 is),
      the fp16 emulation suspended inside them; their fp16 inputs are widened (exactly) so that bf16's rounding
      applies to them, their outputs stay bf16 (fp16's range is what they need to leave);
    - with an FP8 recipe (``policy.fp8``), the model's selected Linear layers compute in FP8, emulated
      exactly (see :mod:`mixprec.regions.fp8`);
    - the model's outputs are cast to ``policy.output_dtype``.
Everything changed (autocast state, matmul precision, hooks) is restored on exit, exceptions included.

Example:
    >>> import torch, torch.nn as nn
    >>> from mixprec.policy.parse import get_policy
    >>> model = nn.Linear(4, 2)
    >>> with autocast(get_policy("mixed_bf16"), model):
    ...     model(torch.randn(3, 4)).dtype
    torch.float32
"""

from __future__ import annotations

import contextlib
import itertools
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from mixprec.compute.attention import GemmAttention
from mixprec.compute.eager_frames import keep_out_of_compiled_frames
from mixprec.compute.emulation import active_emulation, emulations_suspended, widen_rnn_inputs
from mixprec.compute.foreign_recompute import closing_failed_checkpoints, refuse_foreign_recompute
from mixprec.policy.policy import Policy
from mixprec.regions.casting import classes_named, unwrapped
from mixprec.regions.fp8.region import fp8_state
from mixprec.regions.module_formats import (
    ModuleFormats,
    cast_floating,
    emulation_for,
    format_regions,
    routed_fp32_modules,
)
from mixprec.regions.one_off import kept_regions
from mixprec.regions.op_overrides import FP32Ops
from mixprec.regions.plan import tf32_matmuls, uses_gemm_attention
from mixprec.regions.prepare import Prepared, prepare, refuse_foreign_autocast
from mixprec.regions.recompute import Frame, checkpointing_modules, entered, wire_checkpointing
from mixprec.regions.routing import Seat, Seated, new_token, route_links, routing_changes, seat_of, seats_inside

__all__ = ["Region", "autocast"]


@contextlib.contextmanager
def autocast(
    policy: Policy | str | Prepared,
    model: nn.Module | None = None,
    device: str | torch.device | None = None,
) -> Iterator[Policy]:
    """Run the enclosed code under ``policy``'s precision; yields the resolved Policy.

    Args:
        policy: a Policy, preset name or policy string (see :func:`mixprec.get_policy`), or what
            :func:`mixprec.prepare` returned (then ``model`` and ``device`` may be left out).
        model: when given, its outputs are cast to ``output_dtype`` and the modules the policy keeps
            in FP32 compute in FP32. Its device is the region's device unless ``device`` is given.
        device: the device whose autocast to use; default: the model's, else CUDA if present, else CPU.

    A region of the same policy and device made on the model before, closed, is entered again while the model has
    the same modules on the same device (:mod:`mixprec.regions.one_off`): a region written per batch prepares once,
    and a compiled model is not recompiled at every batch.

    Raises:
        ValueError: the set-up checks of :func:`mixprec.prepare` (e.g. the device cannot compute in the
            policy's compute dtype).
    """
    if model is not None and not isinstance(model, nn.Module):  # before the model's kept regions are looked up
        raise TypeError(f"autocast(model=...) needs an nn.Module or None; received {type(model).__name__}.")
    region = _one_off_region(policy, model, device)
    try:
        with region.enter() as resolved:
            yield resolved
    finally:
        region.close()  # a one-off region leaves the model as it was


def _one_off_region(policy: Policy | str | Prepared, model: nn.Module | None, device: Any) -> Region:
    """The model's kept region for this policy and device, opened again, or a new one, kept (none kept without a
    model, for a policy that cannot be a key, or while the kept one is entered: a region nested in its own policy)."""
    key = (policy, None if device is None else str(device))
    if model is None or not _hashable(key):  # a policy object that cannot be a key: a new region each time
        return Region(policy, model, device)
    if isinstance(policy, Prepared):
        prepare(model, policy, device)  # refused where the model changed since it was prepared, as a new region is
    kept = kept_regions(model)
    region = kept.take(key, model)
    if region is not None and region.reopen():
        return region
    region = Region(policy, model, device)
    kept.keep(key, model, region)
    return region


def _hashable(key: tuple) -> bool:
    try:
        hash(key)
    except TypeError:
        return False
    return True


class Region:
    """A policy's region prepared once and entered many times (:class:`mixprec.MixedPrecision` keeps one).

    Made from :func:`mixprec.prepare`'s value (prepared here from a policy, model and device otherwise), it
    installs the model's output cast and the routing of its FP8 layers and of its modules of another format (FP32,
    bf16) once; entering only enters contexts. So a step that enters the region inside ``torch.compile`` traces it
    without graph breaks, and a compiled model is not recompiled because hooks came and went.
    """

    def __init__(
        self,
        policy: Policy | str | Prepared,
        model: nn.Module | None = None,
        device: str | torch.device | None = None,
    ) -> None:
        prepared = prepare(model, policy, device, caller="autocast")
        # Not the Prepared itself: its lists of the model's parameters would keep weights replaced since alive (a
        # kept one-off region lives as long as its model)
        self._bf16_plan = prepared.bf16_plan
        self._calls_attention: bool | None = None  # whether the model's forward calls attention: known after one
        self.policy, self.plan, model = prepared.policy, prepared.plan, prepared.model
        # The model held weakly, as everything of it the region keeps that could be the model itself: a one-off region
        # is kept in the model's own __dict__, and a cycle back to the model would leave a dropped model (its GPU
        # memory) to the cycle collector instead of freeing it at once
        self._model = weakref.ref(model) if model is not None else None
        self._has_model = model is not None
        self.device_type = prepared.device.type
        if self.policy.fp8 is not None and model is None:
            raise ValueError(
                f"policy {self.policy} computes GEMM layers in FP8, which needs the model: use autocast(policy, model)."
            )
        if model is None and (named := _module_rules(self.policy)):
            raise ValueError(
                f"policy {self.policy} keeps modules by {named}, which needs the model (without it they would "
                "compute in the region's dtype, silently): use autocast(policy, model)."
            )
        self._casts_outputs = False  # whether this region counts among the users of the model's output cast
        self.fp8 = None  # the model's FP8 scale states; its layers routed through them once, as the output cast
        self._owner = new_token()  # whose routing: a token, so that a copied or pickled model carries no Region
        routed = [(m, "fp32") for m in routed_fp32_modules(prepared)] + [(m, "bf16") for _, m in prepared.bf16_modules]
        # the seat of the model inside its wrappers: where the routed forwards read which region computes
        self._seat = seat_of(unwrapped(model)) if model is not None else Seat()
        # routed through once, as the FP8 layers (a module is routed only where the region has the model)
        self._formats = ModuleFormats(routed, self._owner, self._seat) if routed else None
        self._module_regions = self._made_module_regions(routed)
        if model is not None:
            _use_output_cast(model, self._seat)
            self._casts_outputs = True
            if self.plan.emulates:
                widen_rnn_inputs(model)
            if self.policy.fp8 is not None:
                # the GEMM layers of FP32 and bf16 modules compute in their module's format
                fp32, bf16 = [name for name, _ in prepared.fp32_modules], [name for name, _ in prepared.bf16_modules]
                self.fp8 = fp8_state(model, self.policy.fp8, fp32, bf16)
                self._fp8_links = self.fp8.links(self._owner, self._seat)  # made once, routed each time
            self._route()
        self._closed = False  # closed, an entry (a checkpoint's recompute) routes the modules for its duration
        # other regions' models routed inside this one's (found at eager entries as routing changes)
        self._seats_found: tuple[int, list[Seat]] = (-1, [])
        if model is not None:
            self._seats(refresh=True)
        # layers that call a checkpoint function of their own (Hugging Face's): it recomputes in this region
        self._checkpointing = [weakref.ref(m) for m in checkpointing_modules(model)] if model is not None else []
        wire_checkpointing(self._checkpointing_modules())

    @contextlib.contextmanager
    def enter(self, *, recomputing: bool = False) -> Iterator[Policy]:
        """The region itself: a context manager that yields the policy. One ``with`` statement, with a
        null context for each part the policy does not use, so torch.compile can trace it.
        ``recomputing``: entered again for an activation checkpoint's recompute (mixprec.checkpoint), where
        the checkpoint, not the emulation, keeps what backward saves."""
        policy, plan, device_type, has_model = self.policy, self.plan, self.device_type, self._has_model
        traced = torch.compiler.is_compiling()
        seats = self._seats(refresh=not traced) if has_model else []  # no model: nothing routed
        # Compiled, the model itself is not read (the eager entries check it): dynamo then tracked a compiled model
        # (torch.compile's wrapper) by the region's path beside the caller's and failed ("already tracked for
        # mutation") where the engine was built on the wrapper and its region entered inside a compiled step.
        model = self.model if has_model and not traced else None  # None too where it was dropped (a recompute)
        if model is not None:
            refuse_foreign_autocast(model)  # also when another framework wrapped the model after setup
            if not recomputing:  # a recompute runs on autograd's thread, the caller waiting
                for seat in seats:
                    seat.refuse_other_thread(model)
        # Each part that computes what torch's own checkpoint would recompute without it (outside the region)
        # refuses that checkpoint, applied here, once; compiled, the compiler recomputes from its graph.
        refuse = None if traced else refuse_foreign_recompute
        emulation = emulation_for(plan, policy.fp32_ops, device_type, recomputing, refuse) if plan.emulates else None
        native = plan.mode in ("native", "hybrid")
        null = contextlib.nullcontext()
        module_regions = self._module_regions.get((recomputing, refuse))
        frame = None
        if not traced:
            keep_out_of_compiled_frames()  # the region's callbacks from eager code inside a compiled call
            # compiled, the compiler recomputes checkpoints from its graph
            wire_checkpointing(self._checkpointing_modules())  # checkpointing enabled after this region was prepared
            frame = Frame(self, self._module_regions.get((True, refuse), {}))
        fp32_ops = bool(policy.fp32_ops) and plan.mode != "emulated"
        attention = None
        # GEMM attention watches every torch call of the forward (a TorchFunctionMode: a few us each); a model
        # whose first watched forward called no attention is not watched again
        if native and not traced and torch.is_grad_enabled() and self._calls_attention is not False:
            attention = GemmAttention(refuse) if uses_gemm_attention(policy, plan) else None
        with (
            _no_graph_breaks() if traced else null,  # first: it covers everything entered after it
            self._routed_again() if self._closed else null,
            entered(frame),
            # Not native: the region still owns the precision, so an outer autocast is switched off inside.
            torch.autocast(device_type, dtype=plan.dtype) if native else torch.autocast(device_type, enabled=False),
            _backward_outside_autocast() if native and not traced else null,
            # compiled, GEMM attention steps aside (the compiler picks its attention kernel): not entered at all
            attention if attention is not None else null,
            # an outer region's emulation does not reach inside this one (the innermost region decides)
            emulations_suspended() if not traced and active_emulation() is not None else null,
            emulation if emulation is not None else null,
            tf32_matmuls(device_type) if policy.allow_tf32 and plan.mode != "emulated" else null,
            FP32Ops(policy.fp32_ops, device_type, refuse) if fp32_ops else null,
            self.fp8.computing(policy.compute_dtype, refuse) if self.fp8 is not None else null,
            # this region as the one whose routed modules compute (the last entered), and its outputs' dtype
            Seated(seats, self._owner, traced, policy.output_dtype) if has_model else null,
            self._formats.computing(module_regions, frame, refuse) if self._formats is not None else null,
            null if traced else closing_failed_checkpoints(),  # last: its exit comes first (torch <= 2.12)
        ):
            yield policy
        if attention is not None and self._calls_attention is None and not recomputing:  # a recompute: part of one
            self._calls_attention = attention.attention_calls > 0

    def _seats(self, refresh: bool) -> list[Seat]:
        """The model's seat, then those of the models whose regions route modules of this region's model
        (:func:`seats_inside`), found again when routing changed; ``refresh=False`` (traced) takes the last found:
        a compiled step walks no modules."""
        model = self.model if refresh and self._seats_found[0] != routing_changes() else None
        if model is not None:
            self._seats_found = (routing_changes(), [self._seat, *seats_inside(model, self._seat)])
        return self._seats_found[1]

    @property
    def model(self) -> nn.Module | None:
        """The region's model; None without one, or once it was dropped."""
        return self._model() if self._model is not None else None

    def _checkpointing_modules(self) -> list[nn.Module]:
        return [module for ref in self._checkpointing if (module := ref()) is not None]

    def computes_fp8(self) -> bool:
        """Whether this region's FP8 layers compute now (it has some, and it is the last region entered on its
        model)."""
        return self.fp8 is not None and self._seat.token == self._owner

    def close(self) -> None:
        """Remove the output-cast hook and the routing this region installed (none if the model had them)."""
        model = self.model
        if self._casts_outputs and model is not None:  # a dropped model took its hook with it
            _release_output_cast(model)
        self._casts_outputs = False
        self._unroute()
        self._closed = True

    def reopen(self) -> bool:
        """A closed region made ready to enter again, with the same routed forwards and token as before (False,
        nothing changed, where it is not closed: entered now)."""
        model = self.model
        if not self._closed or model is None:
            return False
        self._calls_attention = None  # watched again: this entry's forward may call attention where the last did not
        _use_output_cast(model, self._seat)
        self._casts_outputs = True
        self._route()
        self._closed = False
        return True

    def _route(self) -> None:
        if self.fp8 is not None:
            route_links(self._fp8_links)
        if self._formats is not None:
            self._formats.install()

    def _unroute(self) -> None:
        if self.fp8 is not None:  # taking it out again changes nothing
            self.fp8.remove(self._owner)
        if self._formats is not None:
            self._formats.remove()

    @contextlib.contextmanager
    def _routed_again(self) -> Iterator[None]:
        """A closed region entered again, to recompute an activation checkpoint taken inside it (a one-off region's,
        whose backward runs after it closed): its modules routed for the recompute, and taken out after."""
        self._route()
        try:
            yield
        finally:
            self._unroute()

    def _made_module_regions(
        self, routed: list[tuple[nn.Module, str]]
    ) -> dict[tuple, dict[str, Callable[[], contextlib.AbstractContextManager]]]:
        """What the forward of a routed module of each format runs in, per kind of entry (recomputing or not, with
        the foreign-recompute refusal or none, as compiled): made here, once, so that a compiled step sees the same
        objects at each entry (none routed: empty)."""
        if not routed:
            return {}
        kinds = {kind for _, kind in routed}
        plans = {"region": self.plan, "bf16": self._bf16_plan}
        entries = itertools.product((False, True), (None, refuse_foreign_recompute))
        return {
            (recomputing, refuse): format_regions(
                kinds, plans, self.device_type, self.policy.fp32_ops, recomputing, refuse
            )
            for recomputing, refuse in entries
        }


@contextlib.contextmanager
def _backward_outside_autocast() -> Iterator[None]:
    """A model compiled inside the region gets a backward that runs as eager's does, outside autocast.
    AOTAutograd traces the backward graph with the forward, under the autocast around it (torch 2.13's
    ``backward_pass_autocast="same_as_forward"``, pytorch#179804): an FP32 module's (``names=``) and a bf16
    module's backward then ran in the region's 16 bits (under a native fp16 policy the FP32 module's weight
    gradient overflowed, 2.1e5 in FP32: other steps skipped than eager). Set back on exit; a compiled step
    entering the region traces its autocast inside the graph and is not affected. Set and restored by hand, not
    with the config's own ``patch()``: that costs 14.5 us an entry against 3.8 (measured), on every step's path."""
    import torch._functorch.config as config  # not imported by `import torch` (1.7 ms, once)

    before = config.backward_pass_autocast
    config.backward_pass_autocast = "off"
    try:
        yield
    finally:
        config.backward_pass_autocast = before


def _no_graph_breaks() -> contextlib.AbstractContextManager:
    """Inside a compiled function, a graph break in the region is an error rather than a wrong result: torch
    2.13's dynamo resumed after such a break without the rest of the ``with`` block (measured, every 16-bit
    policy: ``with mp.autocast(): loss = f(model(x))`` returned ``model(x)``; alone, ``torch.autocast`` and a
    TorchFunctionMode resume correctly, the region's nest of context managers does not). A region entered
    outside the compiled code, around a compiled model, is not affected: graph breaks there are fine."""
    toggle = getattr(torch._dynamo, "error_on_graph_break", None)
    return toggle(True) if toggle is not None else contextlib.nullcontext()


class _OutputCast:
    """The model's output cast: one forward hook, installed once and kept, that casts the outputs to the dtype its
    model's seat holds while a region is entered (``Seat.output_dtype``), and does nothing otherwise. The dtype is
    on the seat, a plain object, not on the module: a compiled step that enters the region changes no module
    attribute (torch.compile's wrapper passes attributes to the model inside; dynamo refused a module written
    through two paths)."""

    def __init__(self, seat: Seat) -> None:
        self.seat = seat

    def __call__(self, module: nn.Module, args: tuple, output: Any) -> Any:
        dtype = self.seat.output_dtype
        return None if dtype is None or not self.seat.here() else cast_floating(output, dtype)


# the model's output cast and how many live regions use it: removed when the last one closes (two engines on one
# model, the first released: the second still casts)
_OUTPUT_CASTS: weakref.WeakKeyDictionary[nn.Module, list] = weakref.WeakKeyDictionary()


def _use_output_cast(model: nn.Module, seat: Seat) -> None:
    """Register the output cast on ``model`` unless it has it (a copy's, copied with it, is kept); count a user."""
    entry = _OUTPUT_CASTS.get(model)
    if entry is None:
        present = any(isinstance(hook, _OutputCast) for hook in model._forward_hooks.values())
        entry = _OUTPUT_CASTS[model] = [None if present else model.register_forward_hook(_OutputCast(seat)), 0]
    entry[1] += 1


def _release_output_cast(model: nn.Module) -> None:
    """One user fewer; the last one removes the hook it registered."""
    entry = _OUTPUT_CASTS.get(model)
    if entry is not None:
        entry[1] -= 1
        if entry[1] == 0:
            if entry[0] is not None:
                entry[0].remove()
            del _OUTPUT_CASTS[model]


def _cast_outputs(module: nn.Module, args: tuple, output: Any) -> None:
    """The output cast of earlier releases, a function reading an attribute of the model: whole models pickled
    with it (``torch.save(model)``) still load; it does nothing now (:class:`_OutputCast` casts)."""
    return None


def _module_rules(policy: Policy) -> str:
    """The policy's rules that name modules (``names=``, ``bf16_names=``, ``mods=`` classes), as a policy string
    writes them; empty where it has none. ``norm`` aside: presets list it for any model, and normalization
    layers compute in FP32 (or as the device's autocast has them) without the model too."""
    rules = [f"names={'+'.join(policy.fp32_names)}" if policy.fp32_names else ""]
    rules.append(f"bf16_names={'+'.join(policy.bf16_names)}" if policy.bf16_names else "")
    classes = classes_named(policy)
    rules.append(f"mods={'+'.join(classes)}" if classes else "")
    return " and ".join(rule for rule in rules if rule)
