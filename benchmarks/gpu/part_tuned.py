"""Part ``tuned``: the policies ``mixprec tune`` tried from this GPU's device profile, timed on the GPU itself.

A tune on any machine can predict a GPU's speed from the profile the ``profile`` part wrote there
(``mixprec tune charlm --device-profile benchmarks/results/gpu/<device>/device_profile.json``); this part holds
those predictions to the GPU. For each tune record in ``benchmarks/results/tune/*/tune.json`` of a task whose
model it builds (charlm) and whose profile names this device, every distinct policy the search tried (the
uniform base and FP32 among them, and the chosen one) trains the task's model at its size on random tokens,
timed in interleaved rounds: the measured speed-up over the uniform base beside the predicted one. The
prediction covers the GEMM layers alone (a profile file has no step; ``scope: layers``), the measurement the
whole step, so the measured speed-up is the predicted one diluted by the rest of the step: what is compared
is the direction and the ranking.

Dry run: the first charlm record whatever its device, at the tiny size.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from benchmarks.gpu import models
from benchmarks.gpu.common import Part, Settings, log
from benchmarks.gpu.measure import prepare_all, time_modes
from benchmarks.gpu.steps import training_mode

import mixprec
from mixprec.app.tasks.charlm import SIZES

__all__ = ["run"]

TUNES = Path(__file__).resolve().parents[1] / "results" / "tune"
_TIMING_RESERVE_S = 30.0


def _records(settings: Settings, part: Part) -> list[tuple[str, dict]]:
    """The tune records to time: charlm's, from this device's profile (any device's on a dry run)."""
    name = torch.cuda.get_device_name(settings.device) if settings.cuda else ""
    found = []
    for path in sorted(TUNES.glob("*/tune.json")):
        record = json.loads(path.read_text(encoding="utf-8"))
        device = str(record.get("device_profile", {}).get("device", ""))
        if record.get("task") != "charlm":
            part.leave_out(path.parent.name, f"task {record.get('task')!r}: this part builds charlm's model only")
        elif settings.dry_run or (name and device.startswith(name)):
            found.append((path.parent.name, record))
        else:
            part.leave_out(path.parent.name, f"its profile is another device's: {device}")
    return found[:1] if settings.dry_run else found


def _policies(record: dict) -> dict[str, dict]:
    """Each distinct policy the search tried, by a short label, with its predicted speed-up."""
    chosen = mixprec.get_policy(record["chosen"]["policy"])  # "base=mixed_bf16" is the candidate "mixed_bf16"
    policies: dict[str, dict] = {}
    for index, candidate in enumerate(record["candidates"], 1):
        policy = candidate["policy"]
        if policy in (p["policy"] for p in policies.values()):
            continue
        label = {record["base"]: "uniform base", "fp32": "uniform FP32"}.get(policy, f"candidate {index}")
        label = f"{label} (chosen)" if mixprec.get_policy(policy) == chosen else label
        policies[label] = {"policy": policy, "predicted": candidate["prediction"]["speedup"], "note": candidate["note"]}
    return policies


def run(settings: Settings, part: Part) -> None:
    config, _, batch, _, _ = SIZES["tiny" if settings.dry_run else "default"]
    work = models.tiny_gpt(config, batch)
    part.meta.update(model=f"TinyGPT {config}", batch=batch, tunes=str(TUNES))
    repeats, warmup = (2, 1) if settings.dry_run else (10, 3)
    for folder, record in _records(settings, part):
        policies = _policies(record)
        rows = {f"{folder}: {label}": spec for label, spec in policies.items()}
        modes = [
            training_mode(row, work, settings.device, policies={row: spec["policy"]}) for row, spec in rows.items()
        ]
        ready = prepare_all(settings, part, modes, _TIMING_RESERVE_S, {"tune": folder})
        log(f"  {folder}: timing {len(ready)} policies, {repeats} interleaved rounds after {warmup} warm-up steps")
        timings, failed = time_modes(ready, repeats, warmup)
        base = timings.get(f"{folder}: uniform base") or timings.get(f"{folder}: uniform base (chosen)")
        for made in ready:
            row, spec = made.mode.name, rows[made.mode.name]
            entry = {"mode": row, "policy": spec["policy"], "note": spec["note"], "predicted": spec["predicted"]}
            if row in failed:
                part.records.append({**entry, "error": failed[row]})
                continue
            ms = timings[row].median_ms
            entry.update(median_ms=round(ms, 3), spread_ms=round(timings[row].spread_ms, 3))
            entry["measured"] = round(base.median_ms / ms, 3) if base else None
            part.records.append(entry)
