"""The doctor on charlm: gradient underflow per format without scaling, the recommended loss scale,
and mixed_fp16 runs started at the default 2**16 and at that scale, side by side.

    python benchmarks/doctor_charlm.py [--doctor-steps 20] [--steps 300] [--seeds 0] [--batch-sizes 24,4]

Writes benchmarks/results/doctor_charlm.json with the machine and the command.
"""

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

from mixprec.app.config import TrainConfig
from mixprec.app.machine import machine_info
from mixprec.app.run import build_trainer
from mixprec.app.task import TaskConfig, build_task
from mixprec.doctor import diagnose


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--doctor-steps", type=int, default=20)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seeds", default="0")
    parser.add_argument("--batch-sizes", default="24,4", help="charlm batch sizes (24 is the task's default)")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/doctor_charlm.json"))
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]

    results = []
    for batch_size in [int(b) for b in args.batch_sizes.split(",")]:
        torch.manual_seed(0)
        parts = build_task("charlm", TaskConfig(batch_size, 0, "cpu", "default"))
        start = time.perf_counter()
        diagnosis = diagnose(parts.model, iter(parts.train_data), parts.loss_fn, steps=args.doctor_steps)
        seconds = time.perf_counter() - start
        print(f"batch {batch_size}: doctor ran {args.doctor_steps} steps in {seconds:.0f} s; recommends "
              f"{diagnosis.policy}, loss scale {diagnosis.loss_scale}")  # fmt: skip
        for name, advice in diagnosis.formats.items():
            lost = f"{100 * advice.lost_without_scaling:7.3f}%"
            act, weight = 100 * advice.activation_grads_lost, 100 * advice.weight_grads_lost
            parts_lost = f"activation {act:.3f}%, weight {weight:.3f}%"
            scale = f"2^{round(math.log2(advice.recommended_scale))} keeps {100 * advice.kept_with_scale:.3f}%"
            print(f"  {name:9s} gradients lost unscaled {lost} ({parts_lost}); scale {scale}")
        runs = []
        for seed in seeds:
            for label, scale in (("default 2^16", None), ("doctor", diagnosis.loss_scale)):
                config = TrainConfig(
                    task="charlm", policy="mixed_fp16", seed=seed, steps=args.steps, batch_size=batch_size,
                    loss_scale=scale,
                )  # fmt: skip
                trainer, _, _ = build_trainer(config, None, progress=False)
                result = trainer.fit(steps=args.steps)
                stats = result.stats
                runs.append({
                    "seed": seed, "start": label, "init_scale": scale or 2.0**16, "skipped_steps": stats.skipped_steps,
                    "final_scale": stats.scale, "eval_loss": result.eval["loss"], "train_loss": result.train_loss,
                })  # fmt: skip
                print(f"  seed {seed} {label:13s} skipped {stats.skipped_steps:3d}  final scale {stats.scale:g}  "
                      f"eval loss {result.eval['loss']:.4f}")  # fmt: skip
        doctor = diagnosis.to_dict()
        doctor.pop("report")  # per-module records are large; `mixprec doctor` writes them
        results.append({"batch_size": batch_size, "doctor_seconds": seconds, "doctor": doctor, "runs": runs})

    command = " ".join(["python", *sys.argv])
    payload = {"machine": {**machine_info(), "command": command}, "results": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(payload, indent=1, default=lambda v: None))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
