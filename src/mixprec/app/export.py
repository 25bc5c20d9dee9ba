"""Export a trained run's weights in half precision, and show what that costs and buys at inference.

From the run's newest valid checkpoint: the exact FP32 weights (the masters, for o2 policies) are
written to ``export/model-fp32.safetensors`` and, cast, to ``export/model-<dtype>.safetensors``; the
half model keeps in FP32 what the run's policy keeps (see :func:`export_policy`). Both models are
evaluated on the task's test data (the half model computing in its own dtype, outputs in FP32) and
timed on it, interleaved, median of several passes.
"""

from __future__ import annotations

import copy
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save as safetensors_bytes

from mixprec.app.checkpoint import load_latest
from mixprec.app.config import TrainConfig
from mixprec.app.evaluate import evaluate, to_device
from mixprec.app.resume import check_run_identity
from mixprec.app.run import build_trainer
from mixprec.app.sharded_checkpoint import Shards, fill_sharded, load_sharded
from mixprec.parallel import with_tied_names
from mixprec.persist import EXPORT, claim_folder, folder_holds, write_atomically
from mixprec.policy import export_policy, get_policy
from mixprec.regions import autocast, cast_module

__all__ = ["ExportResult", "export_run", "fp32_weights"]


@dataclass(frozen=True)
class ExportResult:
    dtype: str
    fp32_path: Path
    half_path: Path
    fp32_bytes: int
    half_bytes: int
    fp32_eval: dict[str, float]
    half_eval: dict[str, float]
    fp32_samples_per_s: float
    half_samples_per_s: float
    metric: str | None
    split: str = "validation"  # the data both were evaluated and timed on: "test" where the task has it


def export_run(
    run_dir: str | Path, dtype: str, repeats: int = 5, *, allow_foreign_checkpoint: bool = False
) -> ExportResult:
    """Write the run's weights in FP32 and ``dtype`` ("fp16" or "bf16"), evaluate and time both.

    The newest checkpoint that verifies is used; one of another run (see :mod:`mixprec.app.resume`) is
    refused unless ``allow_foreign_checkpoint``."""
    export_policy(get_policy("fp32"), dtype)  # an unknown dtype refused before the run is loaded
    run_dir = Path(run_dir)
    config = TrainConfig.load(run_dir)
    config = config.replace(parallel="ddp")  # one process, whole tensors: a sharded run's shards are read whole
    trainer, parts, _ = build_trainer(config, None, progress=False)
    source, weights = fp32_weights(run_dir, trainer, allow_foreign_checkpoint)

    reference, _, _ = build_trainer(config.replace(policy="fp32"), None, progress=False)
    fp32_model = reference.model
    fp32_model.load_state_dict(weights)
    half_policy = export_policy(trainer.mp.policy, dtype)
    half_model = cast_module(copy.deepcopy(fp32_model), half_policy)

    out = run_dir / "export"
    if not _earlier_export(out):  # a file of the user's there is refused, not written over
        claim_folder(out, EXPORT, "the export folder")
    metadata = {"task": config.task, "policy": config.policy, "source": str(source)}
    fp32_path, half_path = out / "model-fp32.safetensors", out / f"model-{dtype}.safetensors"
    fp32_tensors = {k: v.contiguous().clone() for k, v in weights.items()}
    write_atomically(fp32_path, safetensors_bytes(fp32_tensors, {**metadata, "dtype": "fp32"}))
    half_state = half_model.state_dict()  # each tensor in its kept or lowered dtype
    half_weights = {k: half_state[k].contiguous().clone() for k in weights}
    write_atomically(half_path, safetensors_bytes(half_weights, {**metadata, "dtype": dtype}))

    device = trainer.device
    fp32_policy = get_policy("fp32")
    regions = {
        "fp32": (fp32_model, lambda: autocast(fp32_policy, fp32_model, device)),
        dtype: (half_model, lambda: autocast(half_policy, half_model, device)),
    }
    split, data = parts.held_out()  # the test data where the task has one, as serve-bench
    evals = {
        name: evaluate(model, data, parts.loss_fn, parts.metric, region, device)
        for name, (model, region) in regions.items()
    }
    speeds = _throughput(regions, data, device, repeats)
    return ExportResult(
        dtype=dtype,
        fp32_path=fp32_path,
        half_path=half_path,
        fp32_bytes=fp32_path.stat().st_size,
        half_bytes=half_path.stat().st_size,
        fp32_eval=evals["fp32"],
        half_eval=evals[dtype],
        fp32_samples_per_s=speeds["fp32"],
        half_samples_per_s=speeds[dtype],
        metric=parts.metric.name if parts.metric is not None else None,
        split=split,
    )


def _earlier_export(folder: Path) -> bool:
    """An export folder an earlier mixprec wrote, before the folder marker: only model-*.safetensors files whose
    metadata names the checkpoint they came from."""
    if not folder.is_dir() or folder_holds(folder) is not None:
        return False
    files = list(folder.iterdir())
    return bool(files) and all(_exported(path) for path in files)


def _exported(path: Path) -> bool:
    if not (path.is_file() and path.name.startswith("model-") and path.suffix == ".safetensors"):
        return False
    try:
        with safe_open(path, framework="pt") as handle:
            return "source" in (handle.metadata() or {})
    except Exception:  # not a safetensors file at all (safetensors raises its own kinds): not an export
        return False


def fp32_weights(run_dir: Path, trainer, allow_foreign: bool) -> tuple[Path, dict[str, torch.Tensor]]:
    """The newest verified checkpoint of the run (of this run: see :mod:`mixprec.app.resume`) and its
    exact FP32 weights."""
    found = load_latest(run_dir / "checkpoints")
    if found is None:
        raise ValueError(f"{run_dir} has no checkpoint to export; train it first (mixprec train).")
    path, state = found
    check_run_identity(trainer, path, state, allow_foreign=allow_foreign)
    if state.get("sharded"):
        # an FSDP2 run's model state: the exact FP32 weights under mixed and o2 policies (the shards were the
        # masters), the bf16 ones under pure_bf16; sharded tensors are read whole from every rank's files
        model = state["model"]
        if isinstance(state.get("shards"), Shards):
            names, plain = state["shards"].names, trainer.model.state_dict()
            wanted = {
                f"model.{k}": torch.empty_like(v, dtype=torch.float32)
                for k, v in plain.items()
                if f"model.{k}" in names
            }
            load_sharded(state["shards"], wanted)
            model = with_tied_names(trainer.model, fill_sharded({"model": model}, wanted)["model"])
        return path, {k: v.float() if v.is_floating_point() else v for k, v in model.items()}
    trainer.load_state_dict(state)
    return path, trainer.mp.fp32_state_dict()


def _throughput(regions: dict, data, device: torch.device, repeats: int) -> dict[str, float]:
    """Samples per second of a forward pass over ``data``: passes interleaved, median reported."""
    batches = [to_device(inputs, device) for inputs, _ in data]
    samples = sum(int(b.shape[0]) for b in batches)
    timings: dict[str, list[float]] = {name: [] for name in regions}
    with torch.no_grad():
        for repeat in range(repeats + 1):
            for name, (model, region) in regions.items():
                model.eval()
                start = time.perf_counter()
                with region():
                    for inputs in batches:
                        model(inputs)
                if device.type == "cuda":
                    torch.cuda.synchronize()  # host sync: timing needs the work finished
                if repeat:  # the first pass warms up
                    timings[name].append(time.perf_counter() - start)
    return {name: samples / statistics.median(times) for name, times in timings.items()}
