"""argparse types for numeric flags: argparse refuses a bad value naming the flag, with what was received and
what to use (``argument --batch-size: received 0; use a whole number of at least 1``), before anything runs.
A value that passed would otherwise reach code that reads 0 as "the default" or fails far from the flag."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from pathlib import Path

from mixprec.app.config import SEED_LIMIT
from mixprec.checks import LOSS_SCALE_RANGE, shown

__all__ = [
    "file_path",
    "fraction",
    "loss_scale",
    "non_negative_number",
    "positive_number",
    "seed",
    "stop_signals",
    "whole_number",
]


def whole_number(minimum: int = 1, maximum: int | None = None) -> Callable[[str], int]:
    """A whole number of at least ``minimum`` (and at most ``maximum``)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum or (maximum is not None and value > maximum):
            wanted = f"at least {minimum}" if maximum is None else f"from {minimum} to {maximum}"
            raise argparse.ArgumentTypeError(f"received {text}; use a whole number {wanted}")
        return value

    return parse


# a run's seed, in every command that takes one (train, compare, doctor, demo): the range config.py explains
seed = whole_number(0, SEED_LIMIT - 1)


def _number(text: str, accept: Callable[[float], bool], wanted: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and accept(value)):
        raise argparse.ArgumentTypeError(f"received {text}; use {wanted}")
    return value


def positive_number(text: str) -> float:
    """A finite number above 0."""
    return _number(text, lambda v: v > 0, "a number above 0")


def non_negative_number(text: str) -> float:
    """A finite number of at least 0."""
    return _number(text, lambda v: v >= 0, "a number of at least 0")


def fraction(text: str) -> float:
    """A fraction in (0, 1]."""
    return _number(text, lambda v: 0 < v <= 1, "a fraction in (0, 1], e.g. 0.999")


def tolerance(text: str) -> float:
    """A relative tolerance: ``0.5%`` or ``0.005``, at least 0 and below 1."""
    number = text.strip()
    percent = number.endswith("%")
    value = _number(number.removesuffix("%"), lambda v: 0 <= (v / 100 if percent else v) < 1,
                    "a share such as 0.5% or 0.005")  # fmt: skip
    return value / 100 if percent else value


def loss_scale(text: str) -> float:
    """An initial dynamic loss scale that FP32 stores as a normal number (beyond it the scaler could not hold
    it: 1e39 crashed, 1e-50 became 0). Above the growth ceiling (2^24) is allowed: it backs off as usual."""
    low, high = LOSS_SCALE_RANGE
    return _number(text, lambda v: low <= v <= high, "a number from 2^-126 to 3.4e38")


# Linux's limits, in bytes: one name in a path (less what mixprec's hidden temporary names add to a file's name:
# ".NAME.tmp-PID", up to 16 bytes), the whole path
NAME_MAX, PATH_MAX = 255 - 16, 4096


def file_path(text: str) -> Path:
    """A file or folder name: not empty (an empty --out would be the current folder), within the system's
    length limits (past them the system's own error echoed all of it)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("received an empty path; name a file or folder")
    try:
        encoded = text.encode("utf-8")
    except UnicodeEncodeError:  # bytes the system passed on that are not UTF-8: the logs and reports could not name it
        raise argparse.ArgumentTypeError(f"received {shown(text)}: not UTF-8 text; use a UTF-8 name") from None
    if len(encoded) >= PATH_MAX or max(len(name) for name in encoded.split(b"/")) > NAME_MAX:
        raise argparse.ArgumentTypeError(
            f"received {shown(text)}: longer than this system allows ({PATH_MAX} bytes in all, {NAME_MAX} per "
            "name); use a shorter path"
        )
    return Path(text)


def stop_signals(text: str) -> str:
    """Signal names separated by commas (``SIGINT,SIGTERM``), or ``none`` for no graceful stop; an empty value
    (an unset shell variable) or an empty name between commas is refused, not read as "no stop signals"."""
    from mixprec.app.stop_signals import check_stop_signals

    if text.strip().lower() == "none":
        return ""
    names = [name.strip().upper() for name in text.split(",")]
    if not all(names):
        raise argparse.ArgumentTypeError(
            f"received {shown(text)}: an empty signal name; name signals (SIGINT,SIGTERM) or 'none' for no stop "
            "with a checkpoint"
        )
    try:
        return ",".join(check_stop_signals(names, "--stop-signals"))
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error).removeprefix("--stop-signals: ")) from None
