"""A module's forward routed through an object of a region's (the FP8 layers', the modules of another format), and
taken out again: the one place that changes ``module.forward``.

Several regions may route one module: two MixedPrecision on one model, a one-off region inside the engine's. Each
link keeps the forward it replaced (``previous``) and whose it is (``owner``, a region's token); taking one out
unlinks it wherever it lies in the chain, so the others keep routing. (Restoring the forward each had replaced dropped
a later region's routing when an earlier one closed first: the second MixedPrecision on a model then computed in
bf16, not FP8.)

Which link computes: the one whose region was entered last on the model, as the innermost ``torch.autocast``
decides; every other link passes the call down the chain. The model's :class:`Seat` (a plain object in the model,
without its wrappers, that every link routed for it holds) carries that region's token while it is entered. A
region of another policy entered inside the engine's so computes in its own formats, not in the engine's FP32
modules or FP8 layers, and the engine's again after it. A region entered on a submodule also takes the seats of
the models whose regions route modules inside it (:func:`seats_inside`), so it decides there as well. A copy of a
model (``copy.deepcopy``, pickling) has a seat of its own, empty: it is in no region.
"""

from __future__ import annotations

import functools
import itertools
import threading
from typing import Any

import torch
from torch import nn

__all__ = [
    "Link",
    "Seat",
    "Seated",
    "new_token",
    "route",
    "route_links",
    "routing_changes",
    "seat_of",
    "seats_inside",
    "unroute",
]

_SEAT = "_mixprec_seat"


class Seat:
    """Which region computes on a model: the token of the region entered last on it (None outside every region),
    the dtype its outputs are cast to there, and, entered eagerly, the thread that entered it."""

    def __init__(self) -> None:
        self.token: int | None = None
        self.thread: int | None = None
        self.output_dtype: torch.dtype | None = None

    def __deepcopy__(self, memo: dict) -> Seat:
        return Seat()  # a copy of the model is in no region (its links, copied with it, take this seat too)

    def __reduce__(self) -> tuple:
        return (Seat, ())

    def here(self) -> bool:
        """Whether what the seat holds applies on this thread: a region entered eagerly sets it for its own thread
        alone, as torch's autocast is thread-local (another thread's plain call of the model runs its own forward,
        uncast); traced, no thread is read."""
        return self.thread is None or torch.compiler.is_compiling() or self.thread == threading.get_ident()

    def refuse_other_thread(self, model: nn.Module) -> None:
        """Raise RuntimeError where the model is inside a region entered on another thread: what a region sets
        (the output cast's dtype, which region's modules compute in their formats) is the model's, not a
        thread's, so two threads in regions on one model at once would change each other's, silently."""
        if self.token is not None and self.thread is not None and self.thread != threading.get_ident():
            raise RuntimeError(
                f"mixprec: this {type(model).__name__} is inside a mixprec region on another thread; a model "
                "computes in one region at a time. Give each thread its own copy (copy.deepcopy(model)), or serve "
                "an exported model (mixprec export) with no region."
            )


def seat_of(model: nn.Module) -> Seat:
    """The model's seat (made on first use, in the model's own ``__dict__``: neither a parameter, a buffer nor a
    module)."""
    seat = vars(model).get(_SEAT)
    if seat is None:
        seat = vars(model)[_SEAT] = Seat()
    return seat


_KEEP = object()  # Seated without an output dtype: the output cast stays as it is


class Seated:  # a class, not @contextmanager: no generator per region entry
    """While entered, ``token`` holds each of ``seats`` (and, eagerly, this thread), and, given ``output_dtype``,
    the first one (the region's own model's) casts its outputs to it; restored on exit."""

    def __init__(self, seats: list[Seat], token: int, traced: bool, output_dtype: Any = _KEEP) -> None:
        self.seats, self.token, self.traced, self.output_dtype = seats, token, traced, output_dtype

    def __enter__(self) -> None:
        thread = None if self.traced else threading.get_ident()  # compiled, no thread is read
        self.previous = [(seat.token, seat.thread, seat.output_dtype) for seat in self.seats]
        for seat in self.seats:
            seat.token, seat.thread = self.token, thread
        if self.output_dtype is not _KEEP:
            self.seats[0].output_dtype = self.output_dtype

    def __exit__(self, *exc_info: object) -> None:
        for seat, (token, thread, output_dtype) in zip(self.seats, self.previous, strict=True):
            seat.token, seat.thread, seat.output_dtype = token, thread, output_dtype


class Link:
    """A routed forward of ``module``: its ``owner`` (a region's token), its model's ``seat``, and the forward it
    replaced (``previous``: None for the module's own)."""

    module: nn.Module
    seat: Seat
    owner: int
    previous: Any = None

    def computes(self) -> bool:
        """Whether this link's region is the one entered last on its model."""
        return self.seat.token == self.owner and self.seat.here()

    @property
    def __wrapped__(self) -> Any:
        """What a link that does not compute calls: the forward it replaced, or the module's own (also what
        ``inspect.signature(module.forward)`` reads: the Hugging Face Trainer's columns, for one). The module's own
        is bound as a partial: dynamo of torch 2.11 refuses to trace ``function.__get__``, and 2.11 and 2.13 a
        ``MethodType`` call (a graph break; an error under ``fullgraph=True``)."""
        return self.previous if self.previous is not None else functools.partial(type(self.module).forward, self.module)


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
    # not through Module.__setattr__, which first looks for a parameter, buffer or module of that name: a one-off
    # FP8 region routes every GEMM layer at each entry (189 -> 135 us for 49 layers)
    vars(module)["forward"] = link
    _CHANGES[0] += 1


def route_links(links: list[Link]) -> None:
    """Route each link's module through it. A region keeps its links and routes the same ones each time it routes:
    a compiled model, which guards its modules' forwards, sees the same objects and is not recompiled."""
    for link in links:
        route(link.module, link)


def routing_changes() -> int:
    """A count that changes whenever a forward is routed or taken out."""
    return _CHANGES[0]


def seats_inside(model: nn.Module, own: Seat) -> list[Seat]:
    """The seats, other than ``own``, of the models whose regions route modules of ``model`` (the whole model
    around a submodule): a region entered on ``model`` takes them too."""
    seats: dict[int, Seat] = {}
    for module in model.modules():
        link = vars(module).get("forward")
        while isinstance(link, Link):
            if link.seat is not own:
                seats.setdefault(id(link.seat), link.seat)
            link = link.previous
    return list(seats.values())


def unroute(module: nn.Module, owner: int) -> None:
    """Take ``owner``'s link out of the module's chain, wherever it lies (none: nothing changes)."""
    top = vars(module).get("forward")
    if isinstance(top, Link) and top.owner == owner:
        if top.previous is None:
            vars(module).pop("forward", None)
        else:
            vars(module)["forward"] = top.previous
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
