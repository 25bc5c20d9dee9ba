"""The doctor's advice on disk: a small JSON file that ``mixprec train --policy FILE.json`` reads.

    {"policy": "mixed_fp16", "loss_scale": 1024.0, "reasons": ["..."], "source": "mixprec doctor charlm --steps 20"}

Reading parses JSON only (no code runs) and checks every key.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from mixprec.checks import loss_scale, unique_keys
from mixprec.doctor.advice import Diagnosis
from mixprec.persist import WRITTEN_BY, check_overwrite, stamped, write_atomically
from mixprec.policy.parse import get_policy

__all__ = ["PolicyAdvice", "check_policy_target", "policy_and_scale", "read_policy_file", "write_policy_file"]


@dataclass(frozen=True)
class PolicyAdvice:
    """What a policy file holds: the policy string, the loss scale to start from (None: the policy's own) and
    the reasons. The doctor's :class:`~mixprec.doctor.advice.Diagnosis` has the same three fields."""

    policy: str
    loss_scale: float | None = None
    reasons: tuple[str, ...] = ()


def write_policy_file(diagnosis: Diagnosis | PolicyAdvice, path: str | Path, source: str = "") -> Path:
    """Write the recommended policy and loss scale to ``path`` (atomically); a file there that mixprec did not
    write is refused, never written over."""
    path = check_policy_target(path)
    payload = stamped(
        {
            "policy": diagnosis.policy,
            "loss_scale": diagnosis.loss_scale,
            "reasons": list(diagnosis.reasons),
            "source": source,
        },
        KIND,
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(path, json.dumps(payload, indent=1).encode())
    return path


KIND = "policy advice"


def check_policy_target(path: str | Path) -> Path:
    """``path``, once writing the advice there loses nothing: no file, or one a mixprec doctor wrote (an
    earlier one, before the ``written_by`` stamp, told by its four keys).

    Raises:
        ValueError: a folder, or a file mixprec did not write as advice (named as ``--apply``).
    """
    return check_overwrite(path, "--apply", KIND, earlier_keys=frozenset({"policy", "loss_scale", "reasons", "source"}))


def policy_and_scale(spec: str, argument: str = "--policy") -> tuple[str, float | None]:
    """A ``--policy`` as the commands take it: a policy file (``FILE.json``, written by the doctor or the tuner)
    read for its policy string and the loss scale it recommends; anything else is the policy itself, no scale.

    Raises:
        ValueError: a policy file :func:`read_policy_file` refuses.
    """
    return read_policy_file(spec, argument) if spec.endswith(".json") else (spec, None)


def read_policy_file(path: str | Path, argument: str = "--policy") -> tuple[str, float | None]:
    """(policy string, loss scale or None) from a file :func:`write_policy_file` wrote; errors name ``argument``
    (the command's argument that gave the file).

    Raises:
        ValueError: unreadable file, not JSON, missing or malformed keys, an invalid policy or scale.
    """
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"), object_pairs_hook=unique_keys)
    except (OSError, UnicodeDecodeError, ValueError) as exc:  # JSONDecodeError, a key given twice
        raise ValueError(f"{argument} {path}: not a readable policy file ({exc}).") from None
    if not isinstance(data, dict) or not isinstance(data.get("policy"), str):
        raise ValueError(
            f"{argument} {path}: expected a JSON object with a 'policy' string, as `mixprec doctor --apply` writes."
        )
    unknown = set(data) - {"policy", "loss_scale", "reasons", "source", "kind", *WRITTEN_BY}
    if unknown:
        raise ValueError(
            f"{argument} {path}: unknown keys {sorted(unknown)}; known: policy, loss_scale, reasons, source, "
            "written_by, kind."
        )
    try:
        get_policy(data["policy"])
    except (TypeError, ValueError) as error:
        raise ValueError(f"{argument} {path}: its 'policy' is not valid: {error}") from None
    scale = data.get("loss_scale")
    return data["policy"], None if scale is None else loss_scale(scale, f"{argument} {path}: loss_scale")
