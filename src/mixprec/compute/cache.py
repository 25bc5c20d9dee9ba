"""The per-machine cache of measurements: one JSON file per kind in ``$MIXPREC_CACHE_DIR``.

Measurements that decide how mixprec computes on this machine (the CPU kernel probe, the FP8 GEMM shapes that
pay) are taken once and kept in ``$MIXPREC_CACHE_DIR`` (default ``$XDG_CACHE_HOME/mixprec`` or
``~/.cache/mixprec``), each file ``{"version": N, "entries": {key: entry}}``. A file of another version, or one
that does not parse, reads as empty (measured again); a cache that cannot be written (a read-only home) only
costs a measurement, and a file there that mixprec did not write is left alone. Keys name torch's version
(``... | torch 2.13.0 | ...``): storing an entry drops those another version measured.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from pathlib import Path

import torch

from mixprec.persist import write_atomically

__all__ = ["default_cache_dir", "read_cache", "store", "write_cache"]

_OURS = re.compile(rb'\s*\{\s*"version"\s*:')  # how every cache mixprec writes begins, damaged or not


def default_cache_dir() -> Path:
    """``$MIXPREC_CACHE_DIR``, else ``$XDG_CACHE_HOME/mixprec``, else ``~/.cache/mixprec``."""
    if os.environ.get("MIXPREC_CACHE_DIR"):
        return Path(os.environ["MIXPREC_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "mixprec"


def read_cache(path: Path, version: int) -> dict:
    """The entries of the cache at ``path`` written with ``version``; empty if absent, damaged or another version."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("version") != version or not isinstance(data.get("entries"), dict):
        return {}
    return data["entries"]


def write_cache(path: Path, version: int, entries: dict) -> None:
    """Replace the cache at ``path`` atomically; silently nothing where it cannot be written or is not ours."""
    with contextlib.suppress(OSError):
        if path.exists() and not _OURS.match(path.read_bytes()[:64]):
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(path, json.dumps({"version": version, "entries": entries}, indent=1).encode())


def store(path: Path, version: int, key: str, entry: object) -> None:
    """Add ``entry`` under ``key`` to the cache at ``path``, dropping the entries of other torch versions (stale:
    a new torch measures again)."""
    this_torch = f"| torch {torch.__version__} |"
    kept = {k: v for k, v in read_cache(path, version).items() if this_torch in k}
    kept[key] = entry
    write_cache(path, version, kept)
