"""``NonFiniteTracer``: where the first inf or NaN of a step appeared, cheaply enough to leave on.

While attached, every module's outputs (forward), the gradients the backward pass computes for each
module's inputs, and its parameters' gradients are reduced to one number each, their largest
magnitude (a single pass; NaN if any value is NaN, inf if any is infinite), kept on the device in
execution order. :meth:`NonFiniteTracer.check` reads the step's numbers back in one transfer and
names the first non-finite one:

    forward    the innermost module whose output is the first non-finite tensor of the step
               ("input" when the model's own inputs already hold one)
    backward   the module whose backward pass produced the first non-finite input gradient or
               weight gradient ("loss" when the gradient of the model's output already is one); a module's
               own code between its submodules (tensor "gradient of its own code") when the gradient of a
               submodule's output that no submodule consumed already is one

A module's input gradient is the total over every consumer of that tensor; with shared inputs the
first module to consume it in the forward pass is named.

Example:
    >>> import torch, torch.nn as nn
    >>> model = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    >>> with NonFiniteTracer(model) as tracer:
    ...     model(torch.tensor([[float("nan"), 1.0]])).sum().backward()
    ...     tracer.check().module
    'input'
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from mixprec.compute.nest import map_floating

__all__ = ["NonFiniteEvent", "NonFiniteTracer"]


@dataclass(frozen=True)
class NonFiniteEvent:
    """The first non-finite value of a step: where (full dotted module name), when and what."""

    step: int
    module: str
    phase: str  # "forward" or "backward"
    tensor: str  # "output", "input", "input gradient", "weight gradient", "output gradient", "gradient of its own code"
    kind: str  # "nan" or "inf"

    def __str__(self) -> str:
        return f"first non-finite value at step {self.step}: {self.kind} in {self.module} ({self.phase}, {self.tensor})"


def _largest_magnitude(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.numel() == 0:
        return tensor.new_zeros((), dtype=torch.float32)
    return torch.linalg.vector_norm(tensor.detach(), float("inf")).float()  # NaN if any NaN, else inf if any


class NonFiniteTracer:
    """Trace the first non-finite value per step in ``model`` (a context manager, or attach/detach).

    Call :meth:`check` after the backward pass (one host sync); it returns the step's first
    :class:`NonFiniteEvent` or None, remembers the run's first in :attr:`first`, and starts the
    next step. The step counter counts checks unless ``step`` is passed.
    """

    def __init__(self, model: nn.Module) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"NonFiniteTracer(model=...) needs an nn.Module; received {type(model).__name__}.")
        self.model = model
        self._names = {module: name or "model" for name, module in model.named_modules()}
        self._records: list[tuple[str, str, str, torch.Tensor]] = []
        # this forward's module outputs, by tensor: the outermost module that returned each (see _model_outputs)
        self._outputs: dict[int, tuple[str, torch.Tensor]] = {}
        self._in_forward = False  # between the model's own forward pre-hook and hook: only then are they kept
        self._handles: list[Any] = []
        self.steps = 0
        self.first: NonFiniteEvent | None = None
        self.events: list[NonFiniteEvent] = []

    def attach(self) -> NonFiniteTracer:
        if self._handles:
            return self
        self._handles.append(self.model.register_forward_pre_hook(self._model_inputs))
        # prepend: observe what forward returned, before a region's output cast (a hook kept on the model)
        self._handles.append(self.model.register_forward_hook(self._model_outputs, prepend=True))
        for module, name in self._names.items():
            self._handles.append(module.register_forward_hook(self._module_hook(name), prepend=True))
            for param in module.parameters(recurse=False):
                if param.requires_grad:
                    self._handles.append(param.register_hook(self._record_grad(name, "weight gradient")))
        return self

    def detach(self) -> None:
        self._outputs.clear()
        self._in_forward = False
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def __enter__(self) -> NonFiniteTracer:
        return self.attach()

    def __exit__(self, *exc: object) -> None:
        self.detach()

    # -- hooks -------------------------------------------------------------------------------------
    def _model_inputs(self, module: nn.Module, args: tuple) -> None:
        self._outputs.clear()
        self._in_forward = True
        map_floating(args, lambda t: self._record("input", "forward", "input", t) or t)

    def _model_outputs(self, module: nn.Module, args: tuple, output: Any) -> None:
        outputs, self._outputs, self._in_forward = self._outputs, {}, False
        if not torch.is_grad_enabled():
            return
        returned = set()
        hook = self._record_grad("loss", "output gradient")
        map_floating(output, lambda t: returned.add(id(t)) or (t.requires_grad and t.register_hook(hook)) or t)
        if not returned:  # an output container the nest walk does not open: what the model returned is unknown
            return
        # Each module's output gradient, hooked only now, after every module's input-gradient hook on the same
        # tensor: a hook on a tensor runs in the order it was registered, so a module that consumed the output
        # records it first. One no module consumed was used by the enclosing module's own code: non-finite on
        # arrival, that code's backward made it (a sqrt at 0 between two layers, not the layer before it).
        for key, (name, tensor) in outputs.items():
            if key not in returned and tensor.requires_grad:
                parent = name.rpartition(".")[0] if "." in name else "model"
                tensor.register_hook(self._record_grad(parent, "gradient of its own code"))

    def _module_hook(self, name: str):
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            map_floating(output, lambda t: self._record(name, "forward", "output", t) or t)
            if torch.is_grad_enabled():
                map_floating(
                    args,
                    lambda t: (t.requires_grad and t.register_hook(self._record_grad(name, "input gradient"))) or t,
                )
                if module is not self.model and self._in_forward:  # the outermost module returning a tensor
                    map_floating(output, lambda t: self._outputs.__setitem__(id(t), (name, t)) or t)

        return hook

    def _record_grad(self, name: str, tensor: str):
        def hook(grad: torch.Tensor) -> None:
            self._record(name, "backward", tensor, grad)

        return hook

    def _record(self, name: str, phase: str, tensor: str, value: torch.Tensor) -> None:
        self._records.append((name, phase, tensor, _largest_magnitude(value)))

    # -- results -----------------------------------------------------------------------------------
    def check(self, step: int | None = None) -> NonFiniteEvent | None:
        """The first non-finite value since the last check (one host sync), or None; starts a new step."""
        step = self.steps if step is None else step
        records, self._records = self._records, []
        self.steps += 1
        if not records:
            return None
        device = records[0][3].device
        values = torch.stack([r[3].to(device) for r in records]).cpu()  # the one host sync
        bad = (~torch.isfinite(values)).nonzero()
        if bad.numel() == 0:
            return None
        index = int(bad[0, 0])
        name, phase, tensor, _ = records[index]
        event = NonFiniteEvent(step, name, phase, tensor, "nan" if bool(values[index].isnan()) else "inf")
        self.events.append(event)
        if self.first is None:
            self.first = event
        return event

    def clear(self) -> None:
        """Drop this step's records without checking them (a step known to be finite)."""
        self._records.clear()
        self.steps += 1
