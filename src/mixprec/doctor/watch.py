"""``RangeWatch``: opt-in, removable hooks that record per module and phase where values fall against
each format's range (see :mod:`mixprec.doctor.ranges` and :mod:`mixprec.doctor.report`).

Counts accumulate on the device; :meth:`RangeWatch.report` reads them back once (one host sync).

Example:
    >>> import torch, torch.nn as nn
    >>> model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    >>> with RangeWatch(model, formats=("fp16",)) as watch:
    ...     model(torch.randn(2, 4)).sum().backward()
    >>> watch.report().get("0", "forward").values
    8
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from mixprec.compute.nest import map_floating
from mixprec.doctor.ranges import COUNT_FIELDS, HISTOGRAM_LOW, RangeCounts, range_counts
from mixprec.doctor.report import PHASES, DoctorReport, FormatRange, Histogram, ModuleStats
from mixprec.numerics.formats import get_format

__all__ = ["DEFAULT_FORMATS", "RangeWatch"]

DEFAULT_FORMATS = ("fp16", "bf16", "fp8_e4m3", "fp8_e5m2")


class _Accumulator:
    def __init__(self, order: int) -> None:
        self.order = order
        self.calls = 0
        self.counts: torch.Tensor | None = None
        self.amax: torch.Tensor | None = None
        self.histogram: torch.Tensor | None = None
        self.input_amax: torch.Tensor | None = None
        self.origin_calls: torch.Tensor | None = None  # per format: calls whose output overflowed, inputs fitting

    def add(self, counts: RangeCounts) -> None:
        self.calls += 1
        if self.counts is None:
            self.counts, self.amax, self.histogram = counts.counts, counts.amax, counts.histogram
        else:
            self.counts = self.counts + counts.counts
            self.amax = torch.maximum(self.amax, counts.amax)
            self.histogram = self.histogram + counts.histogram

    def add_input_amax(self, amax: torch.Tensor) -> None:
        self.input_amax = amax if self.input_amax is None else torch.maximum(self.input_amax, amax)

    def add_origin_calls(self, origins: torch.Tensor) -> None:
        self.origin_calls = origins if self.origin_calls is None else self.origin_calls + origins


class RangeWatch:
    """Record range statistics of ``model``'s modules while attached (a context manager, or
    :meth:`attach` / :meth:`detach`).

    Args:
        model: the model to watch; every submodule is watched unless ``modules`` says otherwise.
        formats: formats to count against (default fp16, bf16, fp8_e4m3, fp8_e5m2).
        phases: any of ``forward``, ``backward`` (activation gradients), ``weight_grad``.
        modules: dotted names of the modules to watch (default: all, the model itself as "").

    Raises:
        ValueError: an unknown format, phase or module name.
    """

    def __init__(
        self,
        model: nn.Module,
        formats: Iterable[str] = DEFAULT_FORMATS,
        phases: Iterable[str] = PHASES,
        modules: Iterable[str] | None = None,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"RangeWatch(model=...) needs an nn.Module; received {type(model).__name__}.")
        formats = (formats,) if isinstance(formats, str) else formats  # one name, not its characters
        self.formats = tuple(get_format(f, argument="formats").name for f in formats)
        self._thresholds = torch.tensor([get_format(f).overflow_threshold for f in self.formats])
        self.phases = tuple(phases)
        unknown = [p for p in self.phases if p not in PHASES]
        if unknown or not self.phases:
            raise ValueError(f"RangeWatch(phases=...): received {self.phases!r}; use any of {', '.join(PHASES)}.")
        named = dict(model.named_modules())
        names = list(named) if modules is None else list(modules)
        missing = [n for n in names if n not in named]
        if missing:
            raise ValueError(
                f"RangeWatch(modules=...): {missing!r} are not modules of the model; "
                f"names look like {', '.join(repr(n) for n in list(named)[1:4])}."
            )
        self._modules = [(n, named[n]) for n in names]
        self._records: dict[tuple[str, str], _Accumulator] = {}
        self._seen: dict[str, int] = dict.fromkeys(PHASES, 0)
        self._handles: list[Any] = []
        self._last: tuple[torch.Tensor, tuple, RangeCounts] | None = None  # the last forward output counted
        self.steps = 0

    # -- attaching ---------------------------------------------------------------------------
    def attach(self) -> RangeWatch:
        if self._handles:
            return self
        for name, module in self._modules:
            if "forward" in self.phases or "backward" in self.phases:
                # prepend: the module's own output, before a region's output cast on the root
                self._handles.append(module.register_forward_hook(self._forward_hook(name), prepend=True))
            if "weight_grad" in self.phases:
                for param in module.parameters(recurse=False):
                    if param.requires_grad:
                        self._handles.append(param.register_hook(self._grad_hook(name, "weight_grad")))
        return self

    def detach(self) -> None:
        self._last = None
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def __enter__(self) -> RangeWatch:
        return self.attach()

    def __exit__(self, *exc: object) -> None:
        self.detach()

    def step(self) -> None:
        """Count one training step (for the report's ``steps``)."""
        self.steps += 1

    # -- hooks -----------------------------------------------------------------------------------
    def _accumulator(self, name: str, phase: str) -> _Accumulator:
        key = (name, phase)
        if key not in self._records:
            self._records[key] = _Accumulator(self._seen[phase])
            self._seen[phase] += 1
        return self._records[key]

    def _forward_hook(self, name: str):
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            outputs: list[torch.Tensor] = []
            map_floating(output, lambda t: outputs.append(t) or t)
            if not outputs:
                return
            if "forward" in self.phases:
                accumulator = self._accumulator(name, "forward")
                counts = [self._counts(tensor) for tensor in outputs]
                for each in counts:
                    accumulator.add(each)
                inputs: list[torch.Tensor] = []
                map_floating(args, lambda t: inputs.append(t) or t)
                amaxes = [  # one pass each; inf or NaN inputs make the call no overflow origin
                    torch.linalg.vector_norm(t.detach(), float("inf")).float() for t in inputs if t.numel()
                ]
                for amax in amaxes:
                    accumulator.add_input_amax(amax)
                accumulator.add_origin_calls(self._origins(counts, amaxes))
            if "backward" in self.phases and torch.is_grad_enabled():
                for tensor in outputs:
                    if tensor.requires_grad:
                        tensor.register_hook(self._grad_hook(name, "backward"))

        return hook

    def _origins(self, counts: list[RangeCounts], input_amaxes: list[torch.Tensor]) -> torch.Tensor:
        """Per format, 1 where this call's output overflows it although every input fits (the call is where an
        overflow starts), else 0: on the device, judged call by call (a module called again with a larger input
        is an origin where one of its calls was)."""
        device = counts[0].counts.device  # inputs may sit elsewhere (a CPU scalar beside CUDA activations)
        overflow = torch.stack([c.counts[len(COUNT_FIELDS) + 2 :: 3].to(device) for c in counts]).sum(0) > 0
        if not input_amaxes:
            return overflow.long()
        largest = torch.stack([amax.to(device) for amax in input_amaxes]).amax()
        return (overflow & (largest < self._thresholds.to(device))).long()

    def _counts(self, tensor: torch.Tensor) -> RangeCounts:
        """Counts of a forward output; a container returning its last child's tensor reuses them."""
        key = (tensor.data_ptr(), tensor._version, tensor.shape, tensor.stride(), tensor.dtype)
        if self._last is not None and self._last[1] == key:
            return self._last[2]
        counts = range_counts(tensor, self.formats)
        self._last = (tensor, key, counts)  # holding the tensor keeps its memory from being reused meanwhile
        return counts

    def _grad_hook(self, name: str, phase: str):
        def hook(grad: torch.Tensor) -> None:
            self._accumulator(name, phase).add(range_counts(grad, self.formats))

        return hook

    # -- results ---------------------------------------------------------------------------------
    def report(self) -> DoctorReport:
        """Everything recorded so far, read back from the device in one transfer."""
        keys = [k for k, a in self._records.items() if a.counts is not None]
        if not keys:
            return DoctorReport(self.formats, self.steps, ())
        accs = [self._records[k] for k in keys]
        counts = torch.stack([a.counts.cpu() for a in accs]).tolist()  # host sync: one per report
        amaxes = torch.stack([a.amax.float().cpu() for a in accs]).tolist()
        histograms = torch.stack([a.histogram.cpu() for a in accs]).tolist()
        with_inputs = [a.input_amax.float().cpu() for a in accs if a.input_amax is not None]
        inputs_read = iter(torch.stack(with_inputs).tolist() if with_inputs else [])
        input_amaxes = [None if a.input_amax is None else next(inputs_read) for a in accs]
        with_origins = [a.origin_calls.cpu() for a in accs if a.origin_calls is not None]
        origins_read = iter(torch.stack(with_origins).tolist() if with_origins else [])
        origin_calls = [
            {} if a.origin_calls is None else dict(zip(self.formats, next(origins_read), strict=True)) for a in accs
        ]
        stats = []
        for (name, phase), acc, count, amax, histogram, input_amax, origins in zip(
            keys, accs, counts, amaxes, histograms, input_amaxes, origin_calls, strict=True
        ):
            values, zeros, nonfinite = count[: len(COUNT_FIELDS)]
            per_format = count[len(COUNT_FIELDS) :]
            formats = {
                fmt: FormatRange(fmt, *(c / max(values, 1) for c in per_format[3 * i : 3 * i + 3]))
                for i, fmt in enumerate(self.formats)
            }
            stats.append(
                ModuleStats(
                    module=name,
                    phase=phase,
                    order=acc.order,
                    calls=acc.calls,
                    values=values,
                    zeros=zeros,
                    nonfinite=nonfinite,
                    amax=amax,
                    input_amax=input_amax,
                    formats=formats,
                    histogram=Histogram(HISTOGRAM_LOW, tuple(histogram)),
                    origin_calls=origins,
                )
            )
        return DoctorReport(self.formats, self.steps, tuple(stats))
