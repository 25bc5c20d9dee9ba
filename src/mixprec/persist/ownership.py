"""What mixprec wrote, told by what it wrote: a marker in each folder it owns, a stamp in each JSON file.

mixprec never overwrites, moves or deletes a file it did not write. A folder named for its output (a
training run, a comparison, a doctor report) is mixprec's when it holds the marker ``.mixprec``
(``{"written_by": "mixprec", "holds": "a training run"}``), written when mixprec created the folder or
found it empty; a folder that holds anything else is refused with one line, whatever it holds. A JSON
file mixprec writes on its own (``doctor --apply``, ``serve-bench --json``, ``bench``'s results) carries
``"written_by": "mixprec"`` and is written over only when the file there carries it too.

A run folder from before the marker (its ``checkpoints/`` holds mixprec's checkpoint files) is taken
for one: it is mixprec's by the names of its checkpoints, which nothing else writes.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from mixprec.checks import shown
from mixprec.persist.state_file import write_atomically

__all__ = [
    "COMPARISON",
    "DOCTOR_REPORT",
    "EXPORT",
    "MARKER",
    "RUN",
    "TUNE",
    "WRITTEN_BY",
    "check_folder",
    "check_overwrite",
    "claim_folder",
    "folder_holds",
    "stamped",
]

MARKER = ".mixprec"
WRITTEN_BY = {"written_by": "mixprec"}
# what a folder holds, as its marker says and messages read
RUN = "a training run"
COMPARISON = "a comparison of policies"
DOCTOR_REPORT = "a doctor report"
EXPORT = "an export of a run's weights"
TUNE = "a tune of per-layer precision"
# what one of mixprec's folders may hold inside it: a comparison its runs, a run its export; nothing else
_MAY_HOLD = {COMPARISON: {RUN}, RUN: {EXPORT}}
_LEGACY_CHECKPOINT = re.compile(r"step-\d{8}\.(safetensors|sharded)")


def folder_holds(folder: Path) -> str | None:
    """What mixprec's marker in ``folder`` says it holds, or None without a marker.

    Raises:
        ValueError: a marker that is not mixprec's (unreadable, or not the object mixprec writes).
    """
    marker = folder / MARKER
    if not marker.exists():
        return None
    try:
        data = json.loads(marker.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{marker}: not mixprec's folder marker ({error}); choose another folder.") from None
    if not isinstance(data, dict) or data.get("written_by") != "mixprec" or not isinstance(data.get("holds"), str):
        raise ValueError(f"{marker}: not mixprec's folder marker (received {shown(data)}); choose another folder.")
    return data["holds"]


def check_folder(folder: str | Path, holds: str, argument: str) -> Path:
    """``folder``, once it is clear that mixprec may write ``holds`` there (it does not exist, is empty, or is
    mixprec's for ``holds``); nothing is created or written (for a check before long work).

    Raises:
        ValueError: ``folder`` is a file, holds files mixprec did not write (no marker), or holds something
            else of mixprec's; the message names ``argument`` (e.g. "--out").
    """
    folder = Path(folder)
    if not folder.exists():
        _check_not_inside_a_run(folder, holds, argument)
        return folder
    if not folder.is_dir():
        raise ValueError(f"{argument} {folder}: is a file, not a folder; name a new folder for {holds}.")
    found = folder_holds(folder)
    if found is None and _holds_files(folder) and not (holds == RUN and _legacy_run(folder)):
        raise ValueError(
            f"{argument} {folder}: this folder holds files mixprec did not write (it has no {MARKER} marker); "
            f"mixprec never writes over them: name a new or empty folder for {holds}."
        )
    if found is not None and found != holds:
        raise ValueError(f"{argument} {folder}: this folder holds {found}, not {holds}; name another folder.")
    return folder


def claim_folder(folder: str | Path, holds: str, argument: str) -> bool:
    """:func:`check_folder`, then make ``folder`` mixprec's: created (with parents) and marked, or an empty one
    marked. True when it was created here (so a start that fails may remove it). A run folder from before
    the marker is left unmarked: its checkpoints tell it, and a resume that fails leaves it as it was.

    Raises:
        ValueError: as :func:`check_folder`.
        OSError: the folder cannot be created (a file in its path, no permission); the message names ``argument``.
    """
    folder = check_folder(folder, holds, argument)
    created = not folder.exists()
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as error:  # the same kind (a runtime failure), saying which argument and what to do
        raise type(error)(
            f"{argument} {folder}: cannot create this folder ({error.strerror or error}); name a folder you can write."
        ) from None
    if created or not _holds_files(folder):
        _mark(folder, holds)
    return created


def _holds_files(folder: Path) -> bool:
    """Whether ``folder`` holds anything but a marker being written: two runs started into one new folder at once
    saw the other's temporary marker file, and refused the folder as a stranger's instead of as in use."""
    return any(not entry.name.startswith(f".{MARKER}.tmp-") for entry in folder.iterdir())


def _check_not_inside_a_run(folder: Path, holds: str, argument: str) -> None:
    """A new folder inside one of mixprec's (say in a run's checkpoints/, which mixprec prunes) is refused, but
    for a comparison's runs and a run's export."""
    folder = folder.absolute()
    for parent in folder.parents:  # the nearest of mixprec's folders around it decides
        found = folder_holds(parent)
        if found is None:
            continue
        if parent != folder.parent or holds not in _MAY_HOLD.get(found, ()):
            raise ValueError(f"{argument} {folder}: is inside {parent}, which holds {found}; name a folder outside it.")
        return


def _legacy_run(folder: Path) -> bool:
    checkpoints = folder / "checkpoints"
    return checkpoints.is_dir() and any(_LEGACY_CHECKPOINT.fullmatch(p.name) for p in checkpoints.iterdir())


def _mark(folder: Path, holds: str) -> None:
    write_atomically(folder / MARKER, json.dumps({**WRITTEN_BY, "holds": holds}).encode())


def stamped(payload: dict[str, Any], kind: str) -> dict[str, Any]:
    """``payload`` with mixprec's stamp first, and what kind of file it is: what :func:`check_overwrite` recognises
    later (a file of one kind is never written over by another: a policy file by benchmark results)."""
    return {**WRITTEN_BY, "kind": kind, **payload}


def check_overwrite(path: str | Path, argument: str, kind: str, earlier_keys: frozenset[str] = frozenset()) -> Path:
    """``path``, once it is clear that writing a file of ``kind`` there loses nothing: it does not exist, or it
    is a JSON file mixprec wrote as that kind (:func:`stamped`), or one an earlier mixprec wrote before the
    stamp, told by its keys being exactly ``earlier_keys``.

    Raises:
        ValueError: ``path`` is a folder, a folder marker, or a file mixprec did not write as ``kind``; the
            message names ``argument``.
    """
    path = Path(path)
    if path.name == MARKER:
        raise ValueError(f"{argument} {path}: is the folder's {MARKER} marker; name another file.")
    if not path.exists():
        return path
    if path.is_dir():
        raise ValueError(f"{argument} {path}: is a folder; name a file to write.")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):  # UnicodeDecodeError, JSONDecodeError
        data = None
    stamp = (data.get("written_by"), data.get("kind")) if isinstance(data, dict) else None
    if stamp == ("mixprec", kind) or (earlier_keys and isinstance(data, dict) and set(data) == earlier_keys):
        return path
    said = f"mixprec wrote it as {data['kind']}" if stamp and stamp[0] == "mixprec" else "mixprec did not write it"
    raise ValueError(
        f"{argument} {path}: this file exists and {said}; mixprec never writes over a file it did not write as "
        f"{kind}: name a new file, or move this one away."
    )
