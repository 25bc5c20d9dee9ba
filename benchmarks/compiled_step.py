"""torch.compile: mixprec's step with a compiled model against the hand-written compiled torch.autocast loop,
same model, interleaved, CPU time (and the eager pair for reference).

    python benchmarks/compiled_step.py [--models gpt,mlp] [--policy mixed_bf16] [--repeats 7]

Writes benchmarks/results/compiled_step.json with the machine. Goal: compiled mixprec <= 1.02x the compiled
torch.autocast loop (mixprec adds its region, the loss scaler's check and the step's bookkeeping).
"""

import argparse
import json
import time
from pathlib import Path

import torch

from mixprec.app.bench.suites import MODELS, mixprec_step, torch_step
from mixprec.app.bench.timing import interleaved
from mixprec.app.machine import machine_info


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="gpt,mlp")
    parser.add_argument("--policy", default="mixed_bf16", help="a mixed_* policy (the torch loop is autocast)")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    dtype = torch.float16 if "fp16" in args.policy else torch.bfloat16
    records = []
    for name in args.models.split(","):
        bench = MODELS[name]()
        steps = {
            "torch.autocast, compiled": torch_step(bench, dtype, compiled=True),
            f"mixprec {args.policy}, compiled": mixprec_step(bench, args.policy, compiled=True)[0],
            "torch.autocast, eager": torch_step(bench, dtype),
            f"mixprec {args.policy}, eager": mixprec_step(bench, args.policy)[0],
        }
        compile_s = {}
        for mode, step in steps.items():  # the first calls compile; time them apart
            start = time.perf_counter()
            step()
            compile_s[mode] = time.perf_counter() - start
        timings = interleaved(steps, repeats=args.repeats)
        base = {kind: timings[f"torch.autocast, {kind}"].cpu_median_ms for kind in ("compiled", "eager")}
        for mode, timing in timings.items():
            kind = mode.rsplit(", ", 1)[1]
            record = {"model": name, "mode": mode, "cpu_ms": timing.cpu_median_ms, "median_ms": timing.median_ms,
                      "spread_ms": timing.spread_ms, "vs_torch": timing.cpu_median_ms / base[kind],
                      "first_call_s": compile_s[mode]}  # fmt: skip
            records.append(record)
            print(f"{name:4} {mode:34} {timing.cpu_median_ms:8.1f} ms CPU  {record['vs_torch']:.3f}x torch")
    out = Path(__file__).parent / "results" / "compiled_step.json"
    out.write_text(json.dumps({"machine": machine_info(), "records": records}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
