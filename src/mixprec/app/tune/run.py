"""A tune of one task, end to end: the layers and their choices, the search, and what it writes.

DIR/tune.json      every candidate tried (predicted speed-up and memory against the uniform base, measured
                   loss change), the Pareto front under "pareto", the chosen policy and its verification
DIR/policy.json    the chosen policy: mixprec train TASK --policy DIR/policy.json, mixprec policy DIR/policy.json
DIR/front.png      predicted speed-up against loss change, the front and the chosen policy marked
DIR/report.md      the same in words, with the verification over seeds
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mixprec.app.config import TrainConfig
from mixprec.app.tune.cost import DeviceProfile
from mixprec.app.tune.search import TuneOptions, search

__all__ = ["tune_task"]


def tune_task(
    config: TrainConfig,
    options: TuneOptions,
    out: Path,
    profile: DeviceProfile | None = None,
    save_profile: Path | None = None,
    progress: Callable[[str], None] = lambda message: None,
) -> dict[str, Any]:
    """Tune ``config``'s task (see :mod:`mixprec.app.tune.search`); writes the files above into ``out``."""
    import torch

    from mixprec.app.evaluate import to_device
    from mixprec.app.run import resolve_device
    from mixprec.app.task import TaskConfig, build_task
    from mixprec.app.tune.layers import gemm_shapes, layer_choices
    from mixprec.persist import TUNE, check_folder, claim_folder

    check_folder(out, TUNE, "--out")
    device = resolve_device(config.device)
    torch.manual_seed(config.seed)
    parts = build_task(config.task, TaskConfig(config.batch_size, config.seed, device, config.size))
    parts.model.to(device)
    batches = [(to_device(x, device), to_device(y, device)) for x, y in _first(parts.train_data, 4)]
    if not batches:
        raise ValueError(f"task {config.task!r} has no training batch to tune on.")
    shapes = gemm_shapes(parts.model, batches[0][0], lambda model, x: model(x))
    if not shapes:
        raise ValueError(f"task {config.task!r}: the model has no GEMM layer to tune (nn.Linear, Conv1D, ...).")
    sixteen = "fp16" if "fp16" in options.base else "bf16"
    progress(f"tune: the doctor's statistics on {len(batches)} batches, {len(shapes)} GEMM layers")
    choices = layer_choices(parts.model, batches, parts.loss_fn, shapes, sixteen, steps=len(batches))
    result = search(config, options, choices, profile, progress)
    result["task"] = config.task
    claim_folder(out, TUNE, "--out")
    _write(out, result, config)
    if save_profile is not None and profile is None:
        _measured_profile(result, options.base).save(save_profile)
    return result


def _first(data: Any, count: int) -> list[Any]:
    batches = []
    for batch in data:
        batches.append(batch)
        if len(batches) == count:
            break
    return batches


def _measured_profile(result: dict[str, Any], base: str) -> DeviceProfile:
    entries = {"{m}x{k}x{n}".format(**layer["shape"]): layer["ms"] for layer in result["layers"]}
    return DeviceProfile(result["device_profile"]["device"], base, entries)


def _write(out: Path, result: dict[str, Any], config: TrainConfig) -> None:
    from mixprec.app.tune.report import plot_front, report_text
    from mixprec.doctor import PolicyAdvice, write_policy_file
    from mixprec.persist import TUNE, stamped, write_atomically

    write_atomically(out / "tune.json", json.dumps(stamped(result, TUNE), indent=1).encode())
    chosen = result["chosen"]
    reasons = (
        f"predicted {chosen['prediction']['speedup']:.3f}x {result['base']} ({chosen['prediction']['scope']})",
        f"verified loss change {100 * result['verification']['verdict']['loss_change']:+.3f}% over "
        f"{len(result['verification']['base']['losses'])} seeds",
    )
    advice = PolicyAdvice(chosen["policy"], None, reasons)
    write_policy_file(advice, out / "policy.json", source=f"mixprec tune {config.task}")
    plot_front(result, out / "front.png")
    (out / "report.md").write_text(report_text(result), encoding="utf-8")
