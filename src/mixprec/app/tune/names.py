"""Layer names in a tuned policy, shortened to globs where a glob names exactly the same modules.

A search that puts every block's query projection in FP32 would otherwise write all of them by name
(``names=encoder.layer.0.attention.self.query+encoder.layer.1.attention.self.query+...``). The block index
(the first path component of digits) becomes ``?`` per digit (``encoder.layer.?.attention.self.query``): ``*``
would cross dots and reach other modules. A glob stands for its names only when the modules of the whole model it
matches are exactly those names, so the policy keeps the same modules in FP32 (or FP8) and no other: not a
GELU between two Linears, not the one block a glob would add that the search left in 16 bits.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Sequence

__all__ = ["compact_names"]


def compact_names(names: Iterable[str], modules: Sequence[str]) -> list[str]:
    """``names`` (sorted), with each group that differs only in its block indices replaced by one glob wherever
    the glob matches exactly that group among ``modules`` (every module name of the model)."""
    groups: dict[str, list[str]] = {}
    for name in sorted(set(names)):
        groups.setdefault(_pattern(name), []).append(name)
    compact = []
    for pattern, group in groups.items():
        matched = {module for module in modules if fnmatch.fnmatchcase(module, pattern)}
        compact += [pattern] if len(group) > 1 and matched == set(group) else group
    return sorted(compact)


def _pattern(name: str) -> str:
    """``name`` with its first index (the block's, as models number them: ``blocks.3.mlp.0``) as ``?``s."""
    parts = name.split(".")
    for index, part in enumerate(parts):
        if part.isdigit():
            parts[index] = "?" * len(part)
            break
    return ".".join(parts)
