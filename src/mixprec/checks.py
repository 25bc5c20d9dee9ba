"""Argument checks shared by every layer: one wording for "a whole number >= N" and "a positive number".

Each names the argument, echoes what was received and its type, as every mixprec error does.

Example:
    >>> whole_number(3, "Trainer(log_every=...)")
    3
    >>> whole_number(0, "Trainer(log_every=...)")
    Traceback (most recent call last):
    ...
    ValueError: Trainer(log_every=...) must be an integer >= 1; received 0 (of type int).
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["positive_number", "shown", "unique_keys", "whole_number"]

SHOWN_CHARACTERS = 120  # an input echoed in an error is cut here: a 90 KB string would bury the message


def shown(value: Any) -> str:
    """``repr(value)``, cut to about SHOWN_CHARACTERS with the full length said, for error messages."""
    text = repr(value)
    if len(text) <= SHOWN_CHARACTERS:
        return text
    length = f"{len(value)} characters" if isinstance(value, str) else f"{len(text)} characters as text"
    return f"{text[:SHOWN_CHARACTERS]}... ({length})"


def whole_number(value: Any, what: str, minimum: int = 1) -> int:
    """``value`` if it is an int (not a bool) of at least ``minimum``; else ValueError naming ``what``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(
            f"{what} must be an integer >= {minimum}; received {value!r} (of type {type(value).__name__})."
        )
    return value


def positive_number(value: Any, what: str) -> float:
    """``value`` as a float if it is a finite number above 0 (not a bool); else ValueError naming ``what``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(
            f"{what} must be a positive finite number; received {value!r} (of type {type(value).__name__})."
        )
    return float(value)


def unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``json.loads``' ``object_pairs_hook`` for files a person may edit: a key given twice is refused (JSON
    would keep the last without a word, and train with a setting its reader did not see).

    Example:
        >>> import json
        >>> json.loads('{"policy": "fp32", "policy": "mixed_fp16"}', object_pairs_hook=unique_keys)
        Traceback (most recent call last):
        ...
        ValueError: the key 'policy' is given twice; keep one.
    """
    data: dict[str, Any] = {}
    for key, value in pairs:
        if key in data:
            raise ValueError(f"the key {shown(key)} is given twice; keep one.")
        data[key] = value
    return data
