"""A tune of one task, end to end: the layers and their choices, the search, and what it writes.

DIR/tune.json      every candidate tried (predicted speed-up and memory against the uniform base, measured
                   loss change), the Pareto front under "pareto", the chosen policy and its verification
DIR/policy.json    the chosen policy: mixprec train TASK --policy DIR/policy.json, mixprec policy DIR/policy.json
DIR/front.png      predicted speed-up against loss change, the front and the chosen policy marked
DIR/report.md      the same in words, with the verification over seeds
"""

from __future__ import annotations

import itertools
import json
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mixprec.app.config import TrainConfig
from mixprec.app.tune.cost import BF16, DeviceProfile
from mixprec.app.tune.search import TuneOptions, search
from mixprec.checks import positive_number, whole_number

__all__ = ["BASES", "choose_base", "measured_profile", "tune", "tune_task"]

BASES = ("mixed_bf16", "mixed_fp16")  # the uniform 16-bit policies a tune starts from


def tune_task(
    config: TrainConfig,
    options: TuneOptions,
    out: Path,
    profile: DeviceProfile | None = None,
    progress: Callable[[str], None] = lambda message: None,
    bases: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Tune ``config``'s task (see :mod:`mixprec.app.tune.search`); writes the files above into ``out``."""
    import torch

    from mixprec.app.evaluate import to_device
    from mixprec.app.run import resolve_device
    from mixprec.app.task import TaskConfig, build_task
    from mixprec.app.tune.layers import ATTENTION, layer_choices, layer_shapes
    from mixprec.compute import device_caps
    from mixprec.persist import TUNE, check_folder, claim_folder

    check_folder(out, TUNE, "--out")
    device = resolve_device(config.device)
    torch.manual_seed(config.seed)
    parts = build_task(config.task, TaskConfig(config.batch_size, config.seed, device, config.size))
    parts.model.to(device)
    batches = [(to_device(x, device), to_device(y, device)) for x, y in itertools.islice(parts.train_data, 4)]
    if not batches:
        raise ValueError(f"task {config.task!r} has no training batch to tune on.")
    shapes = layer_shapes(parts.model, batches[0][0], lambda model, x: model(x), progress)
    if not shapes:
        alone = next(parts.model.children(), None) is None  # a model that is one layer: no name to give it
        why = (
            f"the model is itself one layer ({type(parts.model).__name__}): there is no per-layer choice"
            if alone
            else "the model has no layer to tune (nn.Linear, Conv1D, a convolution, ...)"
        )
        raise ValueError(
            f"task {config.task!r}: {why}; compare uniform policies: mixprec compare {config.task} "
            f"--policies fp32,{options.base}"
        )
    sixteen = "fp16" if "fp16" in options.base else "bf16"
    kinds = [shape.kind for shape in shapes.values()]
    attention = f", attention ({shapes[ATTENTION].calls} calls)" if ATTENTION in shapes else ""
    progress(
        f"tune: the doctor's statistics on {len(batches)} batches, {kinds.count('GEMM')} GEMM layers, "
        f"{kinds.count('convolution')} convolutions{attention}"
    )
    # bf16 for a layer past fp16's range: where the trials can run it and the cost model can time it
    bf16 = device_caps(torch.device(device).type).supports_bf16 and (profile is None or profile.times(BF16))
    choices = layer_choices(parts.model, batches, parts.loss_fn, shapes, sixteen, steps=len(batches), bf16=bf16)
    modules = [name for name, _ in parts.model.named_modules()]
    result = search(config, options, choices, profile, progress, modules)
    result["task"] = config.task
    if bases is not None:  # --base auto: both bases' trials and why this one
        result["bases"] = bases
    claim_folder(out, TUNE, "--out")
    _write(out, result, config)
    return result


def tune(
    task: str | Callable[..., Any],
    *,
    out: str | Path,
    base: str = "mixed_bf16",
    tolerance: float = 0.005,
    trial_steps: int = 60,
    verify_steps: int = 180,
    seeds: int = 3,
    budget_minutes: float | None = None,
    device_profile: str | Path | None = None,
    seed: int = 0,
    size: str = "default",
    device: str = "auto",
    batch_size: int | None = None,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """``mixprec tune`` from Python, for a built-in task or a model and loss of one's own: ``task`` is a built-in
    name, a ``"package.module:factory"`` path, or that factory itself (a module-level function taking a
    :class:`~mixprec.app.TaskConfig` and returning :class:`~mixprec.app.TaskParts`: the model, its data and its
    loss). Writes ``out``'s files and returns what ``tune.json`` holds (see docs/tune.md).

    Raises:
        ValueError: a factory that cannot be found again by its module and name (a lambda, a closure), a base
            that is not mixed_bf16 or mixed_fp16, a tolerance outside [0, 1), steps or seeds below 1, a budget
            of 0 minutes or less, a profile for another base.
        NoFiniteReference (a ValueError): the model made inf/NaN under the uniform base and in FP32; nothing is
            written.
    """
    if callable(task):
        module, name = getattr(task, "__module__", None), getattr(task, "__qualname__", "")
        if not module or not name.isidentifier() or getattr(sys.modules.get(module), name, None) is not task:
            raise ValueError(
                f"tune(task=...): received {task!r}, which cannot be imported again by its module and name (each "
                "trial builds the task anew); define the factory at the top level of a module, or pass "
                "'package.module:factory'."
            )
        task = f"{module}:{name}"
    if base not in (*BASES, "auto"):
        raise ValueError(f"tune(base=...): received {base!r}; use mixed_bf16, mixed_fp16 or auto.")
    if not 0 <= tolerance < 1:
        raise ValueError(f"tune(tolerance=...): received {tolerance!r}; use a share in [0, 1), e.g. 0.005 for 0.5%.")
    for value, name in ((trial_steps, "trial_steps"), (verify_steps, "verify_steps"), (seeds, "seeds")):
        whole_number(value, f"tune({name}=...)")
    if budget_minutes is not None:
        positive_number(budget_minutes, "tune(budget_minutes=...)")
    profile = DeviceProfile.load(device_profile) if device_profile is not None else None
    if profile is not None and profile.base != base:
        raise ValueError(
            f"tune(device_profile=...): measured for {profile.base}, not base={base!r} (auto measures both bases "
            "on the device at hand)."
        )
    config = TrainConfig(task=task, policy="mixed_bf16", seed=seed, size=size, device=device, batch_size=batch_size)
    say = progress or (lambda message: print(message, file=sys.stderr, flush=True))
    bases = None
    if base == "auto":
        base, bases = choose_base(config, trial_steps, tolerance, say)
    options = TuneOptions(base, tolerance, trial_steps, verify_steps, seeds, budget_minutes)
    result = tune_task(config.replace(policy=base), options, Path(out), profile, progress=say, bases=bases)
    return result


def choose_base(
    config: TrainConfig, steps: int, tolerance: float, progress: Callable[[str], None]
) -> tuple[str, dict[str, Any]]:
    """``--base auto``: a trial of each uniform 16-bit base here; mixed_fp16 is taken when its step is faster
    and its loss within the tolerance of mixed_bf16's, else mixed_bf16 (range to spare, no loss scale)."""
    from mixprec.app.tune.search import run_trial

    progress(f"tune: base auto, a warm-up run ({min(steps, 5)} steps): a process's first run pays one-time costs")
    run_trial(config, BASES[0], config.seed, min(steps, 5))
    trials = {}
    for base in BASES:
        progress(f"tune: base auto, trial of {base} ({steps} steps)")
        loss, ms = run_trial(config, base, config.seed, steps)
        trials[base] = {"loss": loss, "ms_per_step": ms}
    bf16, fp16 = trials["mixed_bf16"], trials["mixed_fp16"]
    change = (fp16["loss"] - bf16["loss"]) / abs(bf16["loss"]) if math.isfinite(fp16["loss"]) else math.inf
    faster = fp16["ms_per_step"] < bf16["ms_per_step"]
    chosen = "mixed_fp16" if faster and change <= tolerance else "mixed_bf16"
    why = (
        f"mixed_fp16 {fp16['ms_per_step']:.2f} ms a step against mixed_bf16's {bf16['ms_per_step']:.2f}, "
        f"loss change {100 * change:+.3f}% (tolerance {100 * tolerance:.2f}%): {chosen}"
    )
    progress(f"tune: base auto: {why}")
    return chosen, {"trials": trials, "chosen": chosen, "why": why}


def measured_profile(result: dict[str, Any]) -> DeviceProfile:
    """The layer timings a tune measured here, as a device profile (``--save-profile``): another tune of a model
    with these shapes, on another machine, predicts this device's speed from it."""
    if result["device_profile"]["source"] != "measured here":
        raise ValueError("--save-profile: this tune read its timings from a profile; it measured none here.")
    entries = {layer["key"]: layer["ms"] for layer in result["layers"]}
    return DeviceProfile(result["device_profile"]["device"], result["base"], entries)


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
        *([result["verification"]["verdict"]["fallback"]] if "fallback" in result["verification"]["verdict"] else []),
    )
    advice = PolicyAdvice(chosen["policy"], None, reasons)
    write_policy_file(advice, out / "policy.json", source=f"mixprec tune {config.task}")
    plot_front(result, out / "front.png")
    (out / "report.md").write_text(report_text(result), encoding="utf-8")
