"""A module's forward routed through an object of a region's (the FP8 layers', the modules of another format), and
taken out again: the one place that changes ``module.forward``.

Several regions may route one module: two MixedPrecision on one model, a one-off region inside the engine's. Each
link keeps the forward it replaced (``previous``) and whose it is (``owner``, a region's token); taking one out
unlinks it wherever it lies in the chain, so the others keep routing. (Restoring the forward each had replaced dropped
a later region's routing when an earlier one closed first: the second MixedPrecision on a model then computed in
bf16, not FP8.)

Which link computes: the one whose region was entered last on the model (its token in the model's
``_mixprec_region`` attribute while entered, :class:`ModelAttributes`), as the innermost ``torch.autocast`` decides;
every other link passes the call down the chain. A region of another policy entered inside the engine's so
computes in its own formats, not in the engine's FP32 modules or FP8 layers, and the engine's again after it. A
region entered on a wrapper of the model (DDP's, torch.compile's) or on one of its submodules writes its token on
the models whose regions route modules inside it too (:func:`other_roots`), so it decides there as well.
"""

from __future__ import annotations

import itertools
import threading
from typing import Any

from torch import nn

__all__ = [
    "ACTIVE_REGION",
    "REGION_THREAD",
    "Link",
    "ModelAttributes",
    "new_token",
    "other_roots",
    "refuse_other_thread",
    "route",
    "routing_changes",
    "unroute",
]

ACTIVE_REGION = "_mixprec_region"  # the token of the region entered last on a model, while it is entered
REGION_THREAD = "_mixprec_region_thread"  # and the thread that entered it (eager)


def refuse_other_thread(model: nn.Module) -> None:
    """Raise RuntimeError where ``model`` is inside a region entered on another thread: what a region sets (the
    output cast's dtype, which region's modules compute in their formats) is the model's, not a thread's, so two
    threads in regions on one model at once would change each other's formats and outputs, silently."""
    thread = getattr(model, REGION_THREAD, None)
    if thread is not None and thread != threading.get_ident() and getattr(model, ACTIVE_REGION, None) is not None:
        raise RuntimeError(
            f"mixprec: this {type(model).__name__} is inside a mixprec region on another thread; a model computes in "
            "one region at a time. Give each thread its own copy (copy.deepcopy(model)), or serve an exported "
            "model (mixprec export) with no region."
        )


class Link:
    """A routed forward of ``module`` (in the model ``root``): its ``owner`` (a region's token) and the forward it
    replaced (``previous``: None for the module's own)."""

    module: nn.Module
    root: nn.Module
    owner: int
    previous: Any = None

    def computes(self) -> bool:
        """Whether this link's region is the one entered last on its model (a live one: a copy's is not)."""
        return getattr(self.root, ACTIVE_REGION, None) == self.owner

    def __getstate__(self) -> dict[str, Any]:
        """A copy (``copy.deepcopy``, pickling) leaves the model out: a copied submodule would carry a copy of the
        whole model, and a copy's link never computes (no region entered holds its token)."""
        return {**vars(self), "root": None}

    @property
    def __wrapped__(self) -> Any:
        """What a link that does not compute calls: the forward it replaced, or the module's own (also what
        ``inspect.signature(module.forward)`` reads: the Hugging Face Trainer's columns, for one)."""
        return self.previous if self.previous is not None else type(self.module).forward.__get__(self.module)


_TOKENS = itertools.count(1)


def new_token() -> int:
    """A region's token: a number no other region of this process has. Not an object: torch.compile guards an
    object by its id, which a later object may take once it is freed (a compiled step then ran the code traced for
    a region gone), and a number by its value."""
    return next(_TOKENS)


_CHANGES = [0]  # how many times a forward was routed or taken out: a region's other roots are found again after


def route(module: nn.Module, link: Link) -> None:
    """Make ``link`` the module's forward, on top of what was there."""
    link.previous = vars(module).get("forward")
    module.forward = link
    _CHANGES[0] += 1


def routing_changes() -> int:
    """A count that changes whenever a forward is routed or taken out."""
    return _CHANGES[0]


def other_roots(model: nn.Module) -> list[nn.Module]:
    """The models, other than ``model``, whose regions route modules of ``model`` (the model inside a wrapper, the
    whole model around a submodule): a region entered on ``model`` marks them too."""
    roots: dict[int, nn.Module] = {}
    for module in model.modules():
        link = vars(module).get("forward")
        while isinstance(link, Link):
            if link.root is not None and link.root is not model:
                roots.setdefault(id(link.root), link.root)
            link = link.previous
    return list(roots.values())


def unroute(module: nn.Module, owner: int) -> None:
    """Take ``owner``'s link out of the module's chain, wherever it lies (none: nothing changes)."""
    top = vars(module).get("forward")
    if isinstance(top, Link) and top.owner == owner:
        if top.previous is None:
            vars(module).pop("forward", None)
        else:
            module.forward = top.previous
        _CHANGES[0] += 1
        return
    link = top
    while isinstance(link, Link):
        below = link.previous
        if isinstance(below, Link) and below.owner == owner:
            link.previous = below.previous
            _CHANGES[0] += 1
            return
        link = below


class ModelAttributes:  # a class, not @contextmanager: no generator per region entry
    """While entered, each model carries its ``values`` (attribute name to value), restored on exit. Written into
    the module's ``__dict__`` directly: they are neither parameters, buffers nor modules, and
    ``nn.Module.__setattr__``'s checks for those cost more than the rest of entering a region (compiled, dynamo
    traces setattr)."""

    def __init__(self, models: list[tuple[nn.Module, dict[str, Any]]], traced: bool) -> None:
        self.models, self.traced = models, traced

    @staticmethod
    def declare(model: nn.Module, names: tuple[str, ...]) -> None:
        """Give the model each attribute (inert, None) unless it has it: a compiled step that enters a region guards
        on them, and would compile a second time if one appeared only after the first call."""
        for name in names:
            setattr(model, name, getattr(model, name, None))

    def __enter__(self) -> None:
        self.previous = [
            (model, {name: getattr(model, name, None) for name in values}) for model, values in self.models
        ]
        self._write(self.models)

    def __exit__(self, *exc_info: object) -> None:
        self._write(self.previous)

    def _write(self, models: list[tuple[nn.Module, dict[str, Any]]]) -> None:
        for model, values in models:
            for name, value in values.items():
                if self.traced:
                    setattr(model, name, value)
                else:
                    model.__dict__[name] = value
