"""Modules that compute in another format than their region: the policy's FP32 modules, an fp16 policy's bf16 modules.

Each such module's forward is routed through a :class:`_FormatForward` once per region (as the FP8 layers'
are, :mod:`mixprec.regions.fp8.region`), and restored when the region closes. While the region is entered, the
routed forward runs the module's own forward inside its format's context, in a ``with`` block, so that
torch.compile traces it; outside, the module's own forward. Hooks that entered the context before the forward and
left it after, and came and went with each entry, were neither: a compiled step under ``names=...`` failed with
``'autocast' object has no attribute 'prev'`` (torch 2.13).

    FP32   autocast off, every floating input cast to FP32 (norms whose kernels compute in FP32 from 16-bit
           inputs are not routed: :func:`routed_fp32_modules`)
    bf16   bf16 autocast or emulation, fp16 inputs widened to FP32 (exactly) so that bf16's rounding applies
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from mixprec.compute.emulation import EmulatedAutocast, emulations_suspended
from mixprec.compute.nest import map_floating
from mixprec.regions.casting import MIXED_DTYPE_NORMS
from mixprec.regions.op_overrides import FP32Ops
from mixprec.regions.plan import ComputePlan
from mixprec.regions.prepare import Prepared
from mixprec.regions.recompute import Frame
from mixprec.regions.routing import Link, Seat, route_links, unroute

__all__ = ["ModuleFormats", "cast_floating", "emulation_for", "format_regions", "routed_fp32_modules"]

_SHOWN = {"fp32": "FP32", "bf16": "bf16"}


def format_regions(
    kinds: set[str],
    plans: dict[str, ComputePlan | None],
    device_type: str,
    fp32_ops: tuple[str, ...],
    recomputing: bool,
    refuse: Callable[[str], None] | None,
) -> dict[str, Callable[[], contextlib.AbstractContextManager]]:
    """What the forward of a module of each of ``kinds`` runs in, in a region of ``plans["region"]`` (bf16 modules
    as ``plans["bf16"]`` runs bf16): one ``torch.autocast`` where no emulation can be active (what torch.compile
    traces), else a context that suspends the emulations and enters the format's own."""
    region, bf16 = plans["region"], plans["bf16"]
    emulating = region.emulates or (bf16 is not None and bf16.emulates)  # an emulation may be active
    regions = {}
    if "fp32" in kinds:
        regions["fp32"] = (
            functools.partial(_plain_fp32, device_type)
            if emulating
            else functools.partial(torch.autocast, device_type, enabled=False)
        )
    if "bf16" in kinds:
        regions["bf16"] = (
            functools.partial(_in_bf16, bf16, fp32_ops, device_type, recomputing, refuse)
            if emulating
            else functools.partial(torch.autocast, device_type, dtype=torch.bfloat16)
        )
    return regions


def emulation_for(
    plan: ComputePlan,
    fp32_ops: tuple[str, ...],
    device_type: str,
    recomputing: bool,
    refuse: Callable[[str], None] | None,
) -> EmulatedAutocast:
    """The emulation of ``plan``'s 16-bit format (its emulated families only, in a hybrid plan); in a recompute
    the checkpoint, not the emulation, keeps what backward saves."""
    return EmulatedAutocast(
        plan.dtype,
        fp32_ops,
        only=plan.kernels.emulated_ops if plan.mode == "hybrid" else None,
        device_type=device_type,
        saves_low=not recomputing,
        refuse=None if recomputing else refuse,
    )


@contextlib.contextmanager
def _plain_fp32(device_type: str) -> Iterator[None]:
    """An FP32 module where an emulation may be active (the region's, a bf16 module's around it): neither autocast
    nor any emulation touches its ops."""
    with emulations_suspended(), torch.autocast(device_type, enabled=False):
        yield


@contextlib.contextmanager
def _in_bf16(
    plan: ComputePlan,
    fp32_ops: tuple[str, ...],
    device_type: str,
    recomputing: bool,
    refuse: Callable[[str], None] | None,
) -> Iterator[None]:
    """A bf16 module of an fp16 region: the region's emulation suspended, bf16 as ``plan`` runs it here, the
    policy's FP32 ops kept (by the bf16 emulation where it emulates everything)."""
    native = plan.mode in ("native", "hybrid")
    emulation = emulation_for(plan, fp32_ops, device_type, recomputing, refuse) if plan.emulates else None
    null = contextlib.nullcontext()
    with (
        emulations_suspended(),
        torch.autocast(device_type, dtype=torch.bfloat16) if native else torch.autocast(device_type, enabled=False),
        emulation if emulation is not None else null,
        FP32Ops(fp32_ops, device_type, refuse) if fp32_ops and native else null,
    ):
        yield


def routed_fp32_modules(prepared: Prepared) -> list[nn.Module]:
    """The FP32 modules whose forward needs autocast off and FP32 inputs (norms compute in FP32 already)."""
    if prepared.policy.compute_dtype == torch.float32:
        return []
    # FP32 parameters and FP32 arithmetic already; a 16-bit output saves memory
    return [module for _, module in prepared.fp32_modules if not isinstance(module, MIXED_DTYPE_NORMS)]


class ModuleFormats:
    """The routed modules of one region (``owner``, its token; ``seat``, its model's), each with its format ("fp32"
    or "bf16"), and, while the region is entered, what each format's forward runs in (``regions``), the region's
    frame (eager) and its refusal."""

    def __init__(self, modules: list[tuple[nn.Module, str]], owner: int, seat: Seat) -> None:
        self.modules, self.owner, self.seat = modules, owner, seat
        self.links = [_FormatForward(module, kind, self) for module, kind in modules]  # made once, routed each time
        self.regions: dict[str, Callable[[], contextlib.AbstractContextManager]] | None = None
        self.frame: Frame | None = None
        self.refuse: Callable[[str], None] | None = None

    def install(self) -> None:
        """Route each module's forward through this object (the forward an instance had is kept and called)."""
        route_links(self.links)

    def remove(self) -> None:
        """Take this object's routing out of each module (another region's routing stays)."""
        for module, _ in self.modules:
            unroute(module, self.owner)

    def __getstate__(self) -> dict[str, Any]:
        """A copy (``copy.deepcopy``, pickling) made inside a region is not inside it."""
        return {**vars(self), "regions": None, "frame": None, "refuse": None}

    @contextlib.contextmanager
    def computing(
        self,
        regions: dict[str, Callable[[], contextlib.AbstractContextManager]],
        frame: Frame | None,
        refuse: Callable[[str], None] | None,
    ) -> Iterator[None]:
        """The routed modules compute in their formats inside."""
        previous = self.regions, self.frame, self.refuse
        self.regions, self.frame, self.refuse = regions, frame, refuse
        try:
            yield
        finally:
            self.regions, self.frame, self.refuse = previous


class _FormatForward(Link):
    """A routed module's forward: in its format while its region is the one entered last on the model, the forward
    it replaced otherwise. An object rather than a closure, so that ``copy.deepcopy`` of the model gives the copy a
    forward bound to the copy."""

    def __init__(self, module: nn.Module, kind: str, formats: ModuleFormats) -> None:
        self.module, self.kind, self.formats = module, kind, formats
        self.owner, self.seat = formats.owner, formats.seat

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        module, formats = self.module, self.formats
        own = self.__wrapped__
        if formats.regions is None or not self.computes():
            return own(*args, **kwargs)
        if formats.refuse is not None:  # torch's own checkpoint would recompute it in the region's format
            formats.refuse(f"the policy's {_SHOWN[self.kind]} module {type(module).__name__}")
        widened = _all_to_fp32 if self.kind == "fp32" else _fp16_to_fp32
        # compiled, the compiler recomputes checkpoints from its own graph: no frame to keep (a list written from
        # inside a checkpoint's traced body is a side effect dynamo refuses; it then ran torch's checkpoint eagerly)
        frame = formats.frame if not torch.compiler.is_compiling() else None
        with formats.regions[self.kind]():
            if frame is not None:  # a checkpoint called inside recomputes inside
                frame.open.append(self.kind)
            try:
                return own(*widened(args), **widened(kwargs))
            finally:
                if frame is not None:
                    frame.open.pop()


def cast_floating(value: Any, dtype: torch.dtype) -> Any:
    """Cast every floating tensor in a nest of tuples, lists and mappings to ``dtype``."""
    return map_floating(value, lambda t: t if t.dtype == dtype else t.to(dtype))


def _all_to_fp32(value: Any) -> Any:
    return cast_floating(value, torch.float32)


def _fp16_to_fp32(value: Any) -> Any:
    """Every fp16 tensor in a nest as FP32 (exact), the others as they are."""
    return map_floating(value, lambda t: t.float() if t.dtype == torch.float16 else t)
