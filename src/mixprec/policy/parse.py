"""``get_policy``: the one entry point from a preset name or a policy string to a :class:`Policy`.

Grammar (jmp's, extended):

    policy  := preset | dtype | field ("," field)*
    field   := key "=" value
    key     := base | params|p | compute|c | output|o | master|m | fp32_modules|mods | fp32_names|names
               | bf16_names | fp32_ops|ops | kernels | fp8
    value   := a dtype name (f32, float32, bf16, half, ...; compute also takes tf32)
               or, for the four lists, entries joined by "+"  (fp32_ops=softmax+exp)
               (bf16_names: modules computed in bf16 in an fp16 policy, base=mixed_fp16,bf16_names=*.mlp.2)
               or, for base, a preset name (base=mixed_fp16,names=head: the preset, then the changes)
               kernels: auto (timed per machine), native or emulated
               fp8: an FP8 recipe, FORMATS or FORMATS(key=value,...), e.g. hybrid(scaling=current,keep=first+last)
               (see :mod:`mixprec.policy.fp8_recipe`; with base, the named options change the preset's
               recipe and the formats may be left out: base=fp8_hybrid,fp8=(scaling=current)), or none

Unspecified fields follow jmp: params default to float32, compute to params, output to compute,
master to float32. A lone dtype (``"bf16"``) means that dtype everywhere. With ``base``, unspecified
fields keep the preset's values and the given ones replace them (lists are replaced, not extended).

Example:
    >>> str(get_policy("p=f32,c=bf16"))
    'params=float32,compute=bfloat16,output=bfloat16'
    >>> get_policy("mixed_float16") == get_policy("params=float32,compute=float16,output=float32")
    True
"""

from __future__ import annotations

import dataclasses
import difflib

import torch

from mixprec.checks import shown
from mixprec.compute.device import device_type_of
from mixprec.policy.fp8_recipe import Fp8Recipe, parse_recipe
from mixprec.policy.policy import Policy
from mixprec.policy.presets import NO_PRESET, PRESET_ALIASES, PRESETS, resolve_auto

__all__ = ["RUN_OPTIONS", "get_policy", "parse_policy_list", "resumes_under", "valid_policy_names"]

_KEYS = {
    "base": "base",
    "preset": "base",
    "params": "params",
    "p": "params",
    "param": "params",
    "compute": "compute",
    "c": "compute",
    "output": "output",
    "o": "output",
    "out": "output",
    "master": "master",
    "m": "master",
    "fp32_modules": "fp32_modules",
    "mods": "fp32_modules",
    "fp32_names": "fp32_names",
    "names": "fp32_names",
    "bf16_names": "bf16_names",
    "fp32_ops": "fp32_ops",
    "ops": "fp32_ops",
    "kernels": "kernels",
    "fp8": "fp8",
}
_LIST_KEYS = ("fp32_modules", "fp32_names", "bf16_names", "fp32_ops")
_TF32 = ("tf32", "tensorfloat32")  # compute spellings that mean FP32 storage with TF32 matmuls


# Recipe options that say how the FP8 layers run (one fused cast or several passes; which layers by measured speed;
# the kernel's accumulation), not what a saved state holds: the scale states are the same, so a run may resume
# under another value of them.
RUN_OPTIONS = ("cast", "shapes", "fast_accum")


def resumes_under(saved: str, policy: Policy) -> bool:
    """Whether a state saved under the policy string ``saved`` resumes under ``policy``: the same policy, or one
    that differs only in the FP8 recipe's ``RUN_OPTIONS`` (a string that no longer parses: only if equal)."""
    if saved == str(policy):
        return True
    try:
        other = get_policy(saved)
    except ValueError:
        return False
    return _without_run_options(other) == _without_run_options(policy)


def _without_run_options(policy: Policy) -> Policy:
    if policy.fp8 is None:
        return policy
    defaults = {name: getattr(Fp8Recipe(), name) for name in RUN_OPTIONS}
    return dataclasses.replace(policy, fp8=dataclasses.replace(policy.fp8, **defaults))


def valid_policy_names() -> str:
    presets = ", ".join([*PRESETS, "auto", *PRESET_ALIASES])
    return f"presets: {presets}; or a string such as 'p=f32,c=bf16,o=f32' (keys: {', '.join(sorted(set(_KEYS)))})"


def get_policy(
    spec: Policy | str, *, device: str | torch.device | None = None, argument: str = "get_policy(spec=...)"
) -> Policy:
    """Return the :class:`Policy` for a Policy, a preset name or a policy string.

    Args:
        spec: a Policy (returned as is), a preset (``fp32``, ``tf32``, ``mixed_fp16``/``mixed_float16``,
            ``mixed_bf16``/``mixed_bfloat16``, ``o2_fp16``, ``o2_bf16``, ``pure_bf16``, ``auto``),
            a lone dtype (``"bf16"``) or a string in the grammar above.
        device: only for ``auto``: the device to choose for (default: CUDA if present, else CPU).
        argument: how errors name the argument (``"MixedPrecision(policy=...)"``: a caller's own).

    Raises:
        TypeError: ``spec`` is neither a Policy nor a str.
        ValueError: an unknown preset, key or dtype, a repeated key or a malformed part; the message
            names the part and lists the valid choices.
    """
    if device is not None:
        device_type_of(device)  # a bad device is refused whatever the spec, not only for auto
    if isinstance(spec, Policy):
        return spec
    if not isinstance(spec, str):
        raise TypeError(
            f"{argument} takes a Policy or a str; received {shown(spec)} (of type {type(spec).__name__}). "
            f"Valid {valid_policy_names()}."
        )
    text = spec.strip()
    where = argument.replace("...", shown(spec), 1)  # how errors name the argument and echo it
    name = _preset_name(text)
    if name == "auto":
        return resolve_auto(device)
    if name in PRESETS:
        return PRESETS[name]
    if name in NO_PRESET:
        raise ValueError(f"{where}: no preset means this: {NO_PRESET[name]}.")
    if "=" not in text:
        return _single_dtype(text, where)
    return _parse_fields(text, where)


def _single_dtype(text: str, where: str) -> Policy:
    try:
        return Policy(param_dtype=text, compute_dtype=text, output_dtype=text)
    except (TypeError, ValueError):
        names = [*PRESETS, "auto", *PRESET_ALIASES]
        close = difflib.get_close_matches(_preset_name(text), names, n=2, cutoff=0.6)
        hint = f" Did you mean {' or '.join(close)}?" if close else ""
        raise ValueError(f"{where}: unknown policy.{hint} Valid {valid_policy_names()}.") from None


def _parse_fields(text: str, where: str) -> Policy:
    fields: dict[str, str] = {}
    for part in _top_level_parts(text):
        key, sep, value = part.partition("=")
        key, value = key.strip().lower(), value.strip()
        if not sep or not key or not value:
            raise ValueError(
                f"{where}: the part {shown(part.strip())} is not 'key=value'. Valid {valid_policy_names()}."
            )
        if key not in _KEYS:
            raise ValueError(f"{where}: unknown key {shown(key)}; valid keys: {', '.join(sorted(set(_KEYS)))}.")
        canonical = _KEYS[key]
        if canonical in fields:
            raise ValueError(f"{where}: the key {canonical!r} is given twice.")
        fields[canonical] = value

    if "base" in fields:
        return _with_base(fields, where)
    params = fields.get("params", "float32")
    compute = fields.get("compute", params)
    allow_tf32 = compute.lower() in _TF32
    if allow_tf32:
        compute = "float32"
    lists = {key: _plus_list(fields.get(key, "")) for key in _LIST_KEYS}
    fp8 = _fp8_recipe(fields, None, where)
    try:
        return Policy(
            param_dtype=params,
            compute_dtype=compute,
            output_dtype=fields.get("output", compute),
            master_dtype=fields.get("master", "float32"),
            allow_tf32=allow_tf32,
            fp8=fp8,
            kernels=fields.get("kernels", "auto").lower(),
            **lists,
        )
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{where}: {exc}") from None


def _preset_name(text: str) -> str:
    """A preset's canonical name from any accepted spelling (case, '-' for '_', aliases)."""
    name = text.strip().lower().replace("-", "_")
    return PRESET_ALIASES.get(name, name)


def _plus_list(value: str) -> tuple[str, ...]:
    """The entries of a '+'-joined list value, empty ones dropped."""
    return tuple(v for v in value.split("+") if v.strip())


def _top_level_parts(text: str) -> list[str]:
    """``text`` split at the commas outside parentheses (an FP8 recipe's options are inside them)."""
    parts, depth, start = [], 0, 0
    for index, char in enumerate(text):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if char == "," and depth == 0:
            parts.append(text[start:index])
            start = index + 1
    return [*parts, text[start:]]


def _fp8_recipe(fields: dict[str, str], base: Fp8Recipe | None, where: str) -> Fp8Recipe | None:
    """The FP8 recipe the ``fp8`` field spells, starting from ``base`` (a preset's recipe, or none)."""
    if "fp8" not in fields:
        return base
    if fields["fp8"].lower() == "none":
        return None
    try:
        return parse_recipe(fields["fp8"], base)
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None


def _with_base(fields: dict[str, str], where: str) -> Policy:
    name = _preset_name(fields["base"])
    if name not in PRESETS:
        raise ValueError(f"{where}: base={shown(fields['base'])} is not a preset; use one of {', '.join(PRESETS)}.")
    base = PRESETS[name]
    changes: dict[str, object] = {}
    changes["fp8"] = _fp8_recipe(fields, base.fp8, where)
    for key, value in fields.items():
        if key == "fp8":
            continue
        if key in _LIST_KEYS:
            changes[key] = _plus_list(value)
        elif key == "kernels":
            changes["kernels"] = value.lower()
        elif key == "compute" and value.lower() in _TF32:
            changes.update(compute_dtype="float32", allow_tf32=True)
        elif key != "base":
            changes[f"{'param' if key == 'params' else key}_dtype"] = value
    if "compute_dtype" in changes and "allow_tf32" not in changes:
        changes["allow_tf32"] = False
    try:
        return dataclasses.replace(base, reason="", **changes)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{where}: {exc}") from None


def parse_policy_list(text: str, *, device: str | torch.device | None = None) -> list[tuple[str, Policy]]:
    """Parse several policies from one string, as ``--policies`` takes them: ``(spec, Policy)`` pairs.

    Policies are separated by ``;``, or by ``,`` where unambiguous: consecutive ``key=value`` parts
    form one policy string until a key repeats.

    Example:
        >>> [spec for spec, _ in parse_policy_list("fp32,p=f32,c=bf16,mixed_fp16,base=fp8,fp8=(history=4,amax=max)")]
        ['fp32', 'p=f32,c=bf16', 'mixed_fp16', 'base=fp8,fp8=(history=4,amax=max)']
    """
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"--policies needs at least one policy; received {shown(text)}. Example: fp32,mixed_bf16.")
    specs: list[str] = []
    for chunk in text.split(";"):
        group: list[str] = []  # key=value parts of the policy string being collected
        keys: set[str] = set()
        for part in (p.strip() for p in _top_level_parts(chunk)):
            if not part:
                continue
            key = _KEYS.get(part.partition("=")[0].strip().lower(), part) if "=" in part else None
            if group and (key is None or key in keys):
                specs.append(",".join(group))
                group, keys = [], set()
            if key is None:
                specs.append(part)
            else:
                group.append(part)
                keys.add(key)
        if group:
            specs.append(",".join(group))
    if not specs:
        raise ValueError(f"--policies needs at least one policy; received {shown(text)}. Example: fp32,mixed_bf16.")
    return [(spec, get_policy(spec, device=device, argument="--policies ...")) for spec in specs]
