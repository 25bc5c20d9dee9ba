"""Seed 004's table on this machine: fine-tuning a pretrained CNN per precision, through fastai and mixprec's Trainer.

    python benchmarks/vision_table.py [--seeds 0,1,2]
    python benchmarks/vision_table.py --dry-run          # tiny sizes, one seed, two rows: the script runs
    python benchmarks/vision_table.py --from-json FILE   # the table again from saved results

EfficientNet-Lite0 with its ImageNet weights, fine-tuned on the vision task's images (scikit-learn's digits at
64x64, test split held out): one epoch with the body frozen, then two with everything, batch 32.
- through fastai (``examples/fastai_example.py``): ``fine_tune(2, freeze_epochs=1)``, FP32, then
  ``learn.to_mixprec(policy)``; fastai's own ``to_fp16()``/``to_bf16()`` where they run (CUDA: on a CPU they
  warn and train in FP32, so they are not rows there);
- through mixprec's Trainer: ``mixprec train vision --epochs 3 --frozen-epochs 1 --policy P``.
Each run is its own process, one at a time: its seconds per epoch (fine-tuning time over the three epochs), test
accuracy (mean and min-max over the seeds) and peak memory (the process's peak RSS on a CPU, torch's peak
allocation on CUDA). Writes benchmarks/results/vision_table.json (with the machine) and the Markdown table to
benchmarks/results/vision_table.md.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bert_table import spread  # the mean and min-max over seeds, as seed 002's table shows it

RESULTS = Path(__file__).parent / "results"
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "fastai_example.py"
FASTAI = ["fastai_fp32", "mixed_bf16", "o2_bf16"]
TRAINER = ["fp32", "mixed_bf16", "o2_bf16"]
# on CUDA also fp16, where fastai's own to_fp16()/to_bf16() run: (system, policy) rows, in the order they run
CUDA_FASTAI = ["fastai_fp32", "fastai_fp16", "fastai_bf16", "mixed_fp16", "mixed_bf16", "o2_bf16"]
CUDA_TRAINER = ["fp32", "mixed_fp16", "mixed_bf16", "o2_bf16"]


def one_run(system: str, policy: str, seed: int, tiny: bool) -> dict:
    """One fine-tune in this process; what the parent records from it."""
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if system == "fastai":
        spec = importlib.util.spec_from_file_location("fastai_example", EXAMPLE)
        example = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(example)
        done = example.fine_tune_digits(policy, tiny=tiny, seed=seed, device=device)
        result = {"accuracy": done["test_accuracy"], "seconds": done["seconds"], "epochs": done["epochs"]}
    else:
        from mixprec.app.config import TrainConfig
        from mixprec.app.evaluate import evaluate
        from mixprec.app.run import build_trainer

        config = TrainConfig(
            task="vision", policy=policy, seed=seed, size="tiny" if tiny else "default", epochs=2 if tiny else 3
        )
        trainer, parts, _ = build_trainer(config, None, progress=False)
        fit = trainer.fit(epochs=config.epochs)
        model, region = trainer.model, trainer.mp.autocast  # the model as trained, in its policy's region
        test = evaluate(model, parts.test_data, parts.loss_fn, parts.metric, region, trainer.device)
        result = {"accuracy": test["accuracy"], "seconds": fit.seconds, "epochs": fit.epochs}
    if device == "cuda":
        result["peak_bytes"] = torch.cuda.max_memory_allocated()
    return result


def _child(system: str, policy: str, seed: int, tiny: bool) -> dict:
    """``one_run`` in a new process; its peak RSS from the kernel's accounting of that process alone."""
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as handle:
        out = Path(handle.name)
    command = [sys.executable, __file__, "--one", system, policy, str(seed), str(out)] + (["--dry-run"] if tiny else [])
    process = subprocess.Popen(command)
    _, status, usage = os.wait4(process.pid, 0)
    process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode != 0:
        raise SystemExit(f"{system} {policy} seed {seed} failed (exit {process.returncode})")
    result = json.loads(out.read_text())
    out.unlink()
    result.setdefault("peak_bytes", usage.ru_maxrss * 1024)  # Linux: kilobytes
    result.update(system=system, policy=policy, seed=seed)
    print(
        f"{system:8s} {policy:12s} seed {seed}: {result['seconds'] / result['epochs']:6.1f} s/epoch, "
        f"test accuracy {result['accuracy']:.4f}, peak {result['peak_bytes'] / 2**20:.0f} MiB",
        flush=True,
    )
    return result


def render(payload: dict) -> str:
    runs = payload["runs"]
    lines = [
        f"Machine: {payload['machine']}. EfficientNet-Lite0 (ImageNet weights) fine-tuned on digits at 64x64: 1 epoch "
        "frozen + 2 unfrozen, batch 32; seeds " + ",".join(map(str, payload["seeds"])) + ".",
        "",
        "| system | precision | s/epoch | test accuracy (min-max) | peak memory |",
        "|---|---|---|---|---|",
    ]
    rows = dict.fromkeys((run["system"], run["policy"]) for run in runs)
    for system, policy in rows:
        mine = [run for run in runs if (run["system"], run["policy"]) == (system, policy)]
        per_epoch = statistics.fmean(run["seconds"] / run["epochs"] for run in mine)
        peak = max(run["peak_bytes"] for run in mine) / 2**20
        name = {"fastai_fp32": "FP32", "fastai_fp16": "to_fp16()", "fastai_bf16": "to_bf16()"}.get(policy)
        precision = name or (f"to_mixprec({policy!r})" if system == "fastai" else policy)
        accuracy = spread([run["accuracy"] for run in mine])
        lines.append(f"| {system} | {precision} | {per_epoch:.1f} | {accuracy} | {peak:.0f} MiB |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--dry-run", action="store_true", help="tiny sizes, one seed, two rows")
    parser.add_argument("--from-json", type=Path)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--time-limit", type=float, default=None,
                        help="seconds: start no run that the longest one so far would take past it (a GPU machine's "
                        "10-minute command); what ran is saved after every run")  # fmt: skip
    parser.add_argument("--one", nargs=4, metavar=("SYSTEM", "POLICY", "SEED", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        system, policy, seed, out = args.one
        Path(out).write_text(json.dumps(one_run(system, policy, int(seed), args.dry_run)))
        return 0
    if args.from_json:
        print(render(json.loads(args.from_json.read_text())), end="")
        return 0
    import torch

    seeds = [0] if args.dry_run else [int(s) for s in args.seeds.split(",")]
    cuda = torch.cuda.is_available()
    fastai, trainer = (CUDA_FASTAI, CUDA_TRAINER) if cuda else (FASTAI, TRAINER)
    rows = [("fastai", "o2_bf16"), ("trainer", "o2_bf16")] if args.dry_run else [
        *(("fastai", p) for p in fastai), *(("trainer", p) for p in trainer)]  # fmt: skip
    info = _machine_info(torch, cuda)
    payload = {"machine": _machine(torch, info), "machine_info": info, "seeds": seeds, "runs": []}
    stem = "vision_table_dry_run" if args.dry_run else "vision_table"
    start, longest = time.monotonic(), 0.0
    for seed in seeds:  # every row of a seed before the next seed: a time limit cuts seeds, not rows
        for system, policy in rows:
            if args.time_limit is not None and time.monotonic() - start + longest > args.time_limit:
                print(f"time limit: {system} {policy} seed {seed} and after not run", flush=True)
                break
            began = time.monotonic()
            payload["runs"].append(_child(system, policy, seed, args.dry_run))
            longest = max(longest, time.monotonic() - began)
            _save(payload, args.out, stem)
    print(_save(payload, args.out, stem), end="")
    return 0


def _machine_info(torch, cuda: bool) -> dict:
    from mixprec.app.machine import machine_info

    info = machine_info()
    if cuda:
        info["device_name"] = torch.cuda.get_device_name()
    return info


def _machine(torch, info: dict) -> str:
    where = info["device_name"] if "device_name" in info else f"{info.get('cpu', 'CPU')} ({info.get('isa', '?')})"
    return f"{where}, {info.get('cores', '?')} cores, torch {torch.__version__}"


def _save(payload: dict, folder: Path, stem: str) -> str:
    """The results so far, as JSON and as the Markdown table; returns the table."""
    seeds = sorted({run["seed"] for run in payload["runs"]})
    payload = {**payload, "seeds": seeds or payload["seeds"]}
    table = render(payload) if payload["runs"] else ""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{stem}.json").write_text(json.dumps(payload, indent=1))
    (folder / f"{stem}.md").write_text(table)
    return table


if __name__ == "__main__":
    sys.exit(main())
