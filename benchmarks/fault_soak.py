"""A longer soak than the tests: inf and NaN gradients injected at random steps into random layers of
a real task, under every fp16 policy, through `mixprec.app.Trainer`.

    python benchmarks/fault_soak.py [--task charlm] [--size tiny] [--steps 1500] [--rate 0.01]
                                    [--policies mixed_fp16,o2_fp16] [--seed 0]

For each policy: a clean run and a faulted run of the same length (a fault: one element of one
parameter's gradient set to inf or NaN, after it is accumulated, at a random ``rate`` of steps), and
one FP32 run. The dynamic scaler grows every ``--growth-interval`` clean steps (default 50): with the
usual 2000, a fault rate above 1 in 2000 ratchets the scale down for good, which is the scaler's
design, not what this soak measures.

Reported per run: faults injected by kind, steps skipped and their inf/NaN counts, steps skipped for
other reasons (natural overflows), final loss scale and validation loss. A hook on the optimizer
counts faulted steps whose update ran; the script exits 1 unless that count is 0.

Writes benchmarks/results/fault_soak.json with the machine and the command.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

import torch

from mixprec.app.config import TrainConfig
from mixprec.app.machine import machine_info
from mixprec.app.run import build_trainer
from mixprec.scaling.dynamic import DynamicLossScaler


class Injector:
    """Chooses, at each forward pass of the model, whether this step gets a fault and where; the
    chosen parameter's post-accumulate-grad hook writes it. A hook on the optimizer counts the
    faulted steps whose update ran anyway (must stay 0)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, rate: float, seed: int) -> None:
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.rate, self.rng = rate, random.Random(seed)
        self.target: tuple[int, str] | None = None
        self.injected = {"inf": 0, "nan": 0}
        self.steps: list[int] = []  # forward-pass indices that got a fault
        self.forwards = 0
        self.pending = False  # this step's gradients hold a fault
        self.applied_faults = 0
        model.register_forward_pre_hook(self._choose)
        optimizer.register_step_pre_hook(self._check_update)
        for index, param in enumerate(self.params):
            param.register_post_accumulate_grad_hook(lambda p, index=index: self._inject(p, index))

    def _choose(self, module, args) -> None:
        if not module.training or not torch.is_grad_enabled():
            return  # evaluation: no backward follows
        self.forwards += 1
        self.pending = False
        if self.rng.random() < self.rate:
            self.target = (self.rng.randrange(len(self.params)), self.rng.choice(["inf", "nan"]))
        else:
            self.target = None

    def _inject(self, param: torch.Tensor, index: int) -> None:
        if self.target is None or self.target[0] != index:
            return
        kind = self.target[1]
        flat = param.grad.view(-1)
        flat[self.rng.randrange(flat.numel())] = float(kind)
        self.injected[kind] += 1
        self.steps.append(self.forwards)
        self.target, self.pending = None, True

    def _check_update(self, optimizer, args, kwargs) -> None:
        self.applied_faults += int(self.pending)


def run(task: str, size: str, policy: str, steps: int, rate: float, seed: int, growth_interval: int) -> dict:
    config = TrainConfig(task=task, size=size, policy=policy, steps=steps, seed=seed, log_every=steps)
    trainer, _, _ = build_trainer(config, None, progress=False)
    if isinstance(trainer.mp.scalers[0], DynamicLossScaler):
        trainer.mp.scalers[0] = DynamicLossScaler(growth_interval=growth_interval)
    injector = Injector(trainer.model, trainer.optimizer, rate, seed) if rate > 0 else None
    result = trainer.fit(steps=steps)
    stats = result.stats
    injected = injector.injected if injector else {"inf": 0, "nan": 0}
    faults = injected["inf"] + injected["nan"]
    return {
        "policy": policy,
        "faults": injected,
        "steps": stats.steps,
        "applied_steps": stats.applied_steps,
        "skipped_steps": stats.skipped_steps,
        "inf_steps": stats.inf_steps,
        "nan_steps": stats.nan_steps,
        "skipped_without_fault": stats.skipped_steps - faults,
        "faulted_steps_applied": injector.applied_faults if injector else 0,
        "final_scale": stats.scale,
        "eval_loss": result.eval["loss"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", default="charlm")
    parser.add_argument("--size", default="tiny")
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--rate", type=float, default=0.01)
    parser.add_argument("--policies", default="mixed_fp16,o2_fp16")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--growth-interval", type=int, default=50)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/fault_soak.json"))
    args = parser.parse_args()

    common = (args.task, args.size)
    runs = [run(*common, "fp32", args.steps, 0.0, args.seed, args.growth_interval)]
    for policy in args.policies.split(","):
        for rate in (0.0, args.rate):
            runs.append(run(*common, policy, args.steps, rate, args.seed, args.growth_interval))
    failures = sum(record["faulted_steps_applied"] for record in runs)
    for record in runs:
        faults = record["faults"]["inf"] + record["faults"]["nan"]
        kinds = f"inf {record['faults']['inf']}, nan {record['faults']['nan']}"
        print(f"{record['policy']:11s} faults {faults:4d} ({kinds})"
              f"  skipped {record['skipped_steps']:4d} (inf {record['inf_steps']}, nan {record['nan_steps']})"
              f"  other skips {record['skipped_without_fault']:3d}  scale {record['final_scale']:g}"
              f"  eval loss {record['eval_loss']:.4f}")  # fmt: skip
    command = " ".join(["python", *sys.argv])
    payload = {"machine": {**machine_info(), "command": command}, "runs": runs, "failures": failures}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(payload, indent=1))
    print(f"wrote {args.out}; faulted steps applied: {failures}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
