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
from pathlib import Path

from bert_table import spread  # the mean and min-max over seeds, as seed 002's table shows it

RESULTS = Path(__file__).parent / "results"
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "fastai_example.py"
FASTAI = ["fastai_fp32", "mixed_bf16", "o2_bf16"]  # + fastai_fp16, fastai_bf16 on CUDA
TRAINER = ["fp32", "mixed_bf16", "o2_bf16"]


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

    from mixprec.app.machine import machine_info

    seeds = [0] if args.dry_run else [int(s) for s in args.seeds.split(",")]
    fastai = FASTAI + (["fastai_fp16", "fastai_bf16"] if torch.cuda.is_available() else [])
    rows = (
        [("fastai", "o2_bf16"), ("trainer", "o2_bf16")]
        if args.dry_run
        else [
            *(("fastai", p) for p in fastai),
            *(("trainer", p) for p in TRAINER),
        ]
    )
    runs = [_child(system, policy, seed, args.dry_run) for seed in seeds for system, policy in rows]
    info = machine_info()
    cpu = f"{info.get('cpu', 'CPU')} ({info.get('isa', '?')})"
    machine = f"{cpu}, {info.get('cores', '?')} cores, torch {torch.__version__}"
    payload = {"machine": machine, "machine_info": info, "seeds": seeds, "runs": runs}
    table = render(payload)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = "vision_table_dry_run" if args.dry_run else "vision_table"
    (args.out / f"{stem}.json").write_text(json.dumps(payload, indent=1))
    (args.out / f"{stem}.md").write_text(table)
    print(table, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
