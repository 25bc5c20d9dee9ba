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
import sys
from typing import Any

__all__ = ["LOSS_SCALE_RANGE", "flag", "loss_scale", "positive_number", "shown", "unique_keys", "whole_number"]

SHOWN_CHARACTERS = 120  # an input echoed in an error is cut here: a 90 KB string would bury the message


def shown(value: Any) -> str:
    """``repr(value)``, cut to about SHOWN_CHARACTERS with the full length said, for error messages."""
    text = repr(value)
    if len(text) <= SHOWN_CHARACTERS:
        return text
    length = f"{len(value)} characters" if isinstance(value, str) else f"{len(text)} characters as text"
    return f"{text[:SHOWN_CHARACTERS]}... ({length})"


def flag(value: Any, what: str) -> bool:
    """``value`` if it is True or False (numpy's included); else TypeError naming ``what`` (a string "false" is
    truthy: taken as a flag, it turns the setting on)."""
    if isinstance(value, bool):
        return value
    numpy = sys.modules.get("numpy")  # not imported for it: where numpy is not loaded, none of its bools exist
    if numpy is not None and isinstance(value, numpy.bool_):
        return bool(value)
    raise TypeError(f"{what} needs True or False; received {shown(value)} (of type {type(value).__name__}).")


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


# a loss scale FP32 holds as a normal number: beyond it a scaler could not (1e39 is inf in FP32, 1e-50 is 0);
# up to FP32's largest, which a scale growing by a factor other than 2 can reach and a checkpoint then holds
LOSS_SCALE_RANGE = (2.0**-126, (2 - 2.0**-23) * 2.0**127)


def loss_scale(value: Any, what: str) -> float:
    """``value`` as a float if it is a number within LOSS_SCALE_RANGE; else ValueError naming ``what``. The one
    bound every way to give a scale meets: the scalers, the command line, a config or policy file."""
    low, high = LOSS_SCALE_RANGE
    number = positive_number(value, what)
    if not low <= number <= high:
        raise ValueError(f"{what} must be from 2^-126 to 3.4e38 (a normal FP32 number); received {value!r}.")
    return number


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
