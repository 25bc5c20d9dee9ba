"""A module's forward routed through an object of a region's (the FP8 layers', the modules of another format), and
taken out again: the one place that changes ``module.forward``.

Several regions may route one module: two MixedPrecision on one model, a one-off region inside the engine's. Each
link keeps the forward it replaced (``previous``) and whose it is (``owner``); taking one out unlinks it wherever it
lies in the chain, so the others keep routing. (Restoring the forward each had replaced dropped a later region's
routing when an earlier one closed first: the second MixedPrecision on a model then computed in bf16, not FP8.)
"""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["Link", "route", "unroute"]


class Link:
    """A routed forward: its ``owner`` (a region's part) and the forward it replaced (``previous``: None for the
    module's own)."""

    owner: object
    previous: Any = None


def route(module: nn.Module, link: Link) -> None:
    """Make ``link`` the module's forward, on top of what was there."""
    link.previous = vars(module).get("forward")
    module.forward = link


def unroute(module: nn.Module, owner: object) -> None:
    """Take ``owner``'s link out of the module's chain, wherever it lies (none: nothing changes)."""
    top = vars(module).get("forward")
    if isinstance(top, Link) and top.owner is owner:
        if top.previous is None:
            vars(module).pop("forward", None)
        else:
            module.forward = top.previous
        return
    link = top
    while isinstance(link, Link):
        below = link.previous
        if isinstance(below, Link) and below.owner is owner:
            link.previous = below.previous
            return
        link = below
