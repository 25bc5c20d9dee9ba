"""Docstrings of the Python standard library, labelled by the package they document (the minilm task's data).

Every machine with Python has this text, so nothing is downloaded. The docstrings of the functions,
methods and classes of six top-level packages (:data:`LABELS`, present in every CPython 3.10 to 3.12)
are read with ``ast`` from the source files, never by importing the packages; test folders are left
out, and so are docstrings of fewer than :data:`MIN_WORDS` words ("Return self.").

The split is fixed and documented: a docstring's source key (its file relative to the standard library
folder and its qualified name, e.g. ``email/message.py:Message.get_payload``) is hashed with SHA-256;
bucket 0 of 10 is the test split, bucket 1 the validation split, the rest train (about 80/10/10). The
same source lands in the same split on every machine and run, whatever the seed. Identical texts
(whitespace aside) are kept once, at their first key in sorted order, so no text appears in two
splits; a text found under two packages is dropped, since its label would be a coin toss. The split
depends on the Python version only through which docstrings exist.

Example:
    >>> splits = stdlib_docstrings()
    >>> sorted(splits) == sorted(SPLITS) and LABELS[splits["train"][0].label] in LABELS
    True
"""

from __future__ import annotations

import ast
import functools
import hashlib
import sysconfig
from dataclasses import dataclass
from pathlib import Path

__all__ = ["LABELS", "MIN_WORDS", "SPLITS", "Docstring", "split_of", "stdlib_docstrings"]

LABELS = ("asyncio", "email", "http", "logging", "unittest", "xml")
SPLITS = ("train", "validation", "test")
MIN_WORDS = 5


@dataclass(frozen=True)
class Docstring:
    """One example: where it comes from, its package's index in :data:`LABELS`, its text."""

    key: str  # "email/message.py:Message.get_payload"
    label: int
    text: str  # whitespace collapsed to single spaces


def split_of(key: str) -> str:
    """The split of a source key: SHA-256 bucket 0 of 10 is test, 1 validation, 2-9 train."""
    bucket = int.from_bytes(hashlib.sha256(key.encode("utf-8")).digest()[:8], "big") % 10
    return "test" if bucket == 0 else "validation" if bucket == 1 else "train"


def stdlib_docstrings(root: str | Path | None = None) -> dict[str, tuple[Docstring, ...]]:
    """The labelled docstrings of :data:`LABELS` under ``root`` (default: this Python's standard library),
    split as the module docstring says; each split in key order. Read once per folder and process
    (``compare`` and ``export`` build the task several times).

    Raises:
        FileNotFoundError: a package of :data:`LABELS` has no docstrings under ``root``.
    """
    return _read(Path(root if root is not None else sysconfig.get_paths()["stdlib"]).resolve())


@functools.cache
def _read(directory: Path) -> dict[str, tuple[Docstring, ...]]:
    found: list[Docstring] = []
    for label, package in enumerate(LABELS):
        files = sorted(p for p in (directory / package).rglob("*.py") if not _in_tests(p, directory))
        before = len(found)
        for path in files:
            found += [Docstring(key, label, text) for key, text in _docstrings(path, directory)]
        if len(found) == before:
            raise FileNotFoundError(f"the minilm task found no docstrings of {package!r} under {directory}.")
    unique = _unique(found)
    return {name: tuple(item for item in unique if split_of(item.key) == name) for name in SPLITS}


def _in_tests(path: Path, root: Path) -> bool:
    return any(part in ("test", "tests") for part in path.relative_to(root).parts[:-1])


def _docstrings(path: Path, root: Path) -> list[tuple[str, str]]:
    """(key, text) of each function, method and class in ``path`` with a docstring of MIN_WORDS words or more."""
    try:
        tree = ast.parse(path.read_bytes())
    except (SyntaxError, ValueError):  # a file of another Python's syntax: not this library's text
        return []
    relative = path.relative_to(root).as_posix()
    found = []
    stack: list[tuple[ast.AST, str]] = [(tree, "")]
    while stack:
        node, prefix = stack.pop()
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                name = f"{prefix}{child.name}"
                text = " ".join((ast.get_docstring(child) or "").split())
                if len(text.split()) >= MIN_WORDS:
                    found.append((f"{relative}:{name}", text))
                stack.append((child, f"{name}."))
            else:
                stack.append((child, prefix))  # definitions inside if/try blocks keep their prefix
    return found


def _unique(items: list[Docstring]) -> list[Docstring]:
    """Each text once, at its first key in sorted order; texts found under two labels dropped."""
    first: dict[str, Docstring] = {}
    labels: dict[str, set[int]] = {}
    for item in sorted(items, key=lambda d: d.key):
        first.setdefault(item.text, item)
        labels.setdefault(item.text, set()).add(item.label)
    return [item for text, item in first.items() if len(labels[text]) == 1]
