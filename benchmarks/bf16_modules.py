"""A layer past fp16's range in an fp16 model: kept in FP32 (``names=``) against computed in bf16 (``bf16_names=``),
beside uniform mixed_bf16; training step time, interleaved, wall and CPU time.

    python benchmarks/bf16_modules.py [--repeats 9] [--json FILE]

The model: Linear(1024, 4096), GELU, Linear(4096, 1024) whose weights are scaled so that its outputs pass fp16's
65504, LayerNorm, Linear(1024, 10); batch 512, fused AdamW. Every step must be applied (no inf). On a CPU the fp16
around the layer runs as the compute plan has it (emulated where fp16 has no units), so the figure that carries to a
GPU is the layer's own: FP32 against bf16 GEMMs.
"""

import argparse
import json
from pathlib import Path

import torch
from torch import nn

import mixprec
from mixprec.app.bench.timing import interleaved
from mixprec.app.machine import machine_info

POLICIES = {
    "fp16, the layer in FP32": "base=mixed_fp16,names=2",
    "fp16, the layer in bf16": "base=mixed_fp16,bf16_names=2",
    "uniform mixed_bf16": "mixed_bf16",
}


def training_step(policy: str):
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(1024, 4096), nn.GELU(), nn.Linear(4096, 1024), nn.LayerNorm(1024), nn.Linear(1024, 10)
    )
    with torch.no_grad():
        model[2].weight.mul_(3e3)  # its outputs pass fp16's range
    mp = mixprec.MixedPrecision(model, torch.optim.AdamW(model.parameters(), fused=True), policy)
    x, y = torch.randn(512, 1024), torch.randint(0, 10, (512,))

    def step() -> None:
        with mp.autocast():
            loss = nn.functional.cross_entropy(model(x), y)
        mp.backward(loss)
        if not mp.step().applied:  # host sync: a skipped step would time nothing
            raise RuntimeError(f"{policy}: a step was skipped (inf or NaN)")

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    timings = interleaved({name: training_step(policy) for name, policy in POLICIES.items()}, repeats=args.repeats)
    reference = timings["fp16, the layer in FP32"]
    rows = []
    for name, timing in timings.items():
        rows.append({"mode": name, "policy": POLICIES[name], "median_ms": timing.median_ms,
                     "cpu_ms": timing.cpu_median_ms, "spread_ms": timing.spread_ms,
                     "speedup_vs_fp32_layer": reference.median_ms / timing.median_ms})  # fmt: skip
        print(f"{name:26s} {timing.median_ms:8.1f} ms (CPU {timing.cpu_median_ms:7.1f}, spread {timing.spread_ms:5.1f})"
              f"  {reference.median_ms / timing.median_ms:5.2f}x the layer in FP32")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps({"machine": machine_info(), "repeats": args.repeats, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
