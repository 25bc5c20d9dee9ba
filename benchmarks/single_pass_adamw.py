"""pure_bf16's optimizer, eager against single-pass, side by side: step time of the whole training step and
of the optimizer alone, per model, interleaved, wall and CPU time.

    python benchmarks/single_pass_adamw.py [--models mlp,gpt] [--repeats 7]

Writes benchmarks/results/single_pass_adamw.json with the machine.
"""

import argparse
import json
import time
from pathlib import Path

import torch

from mixprec import AdamW, MixedPrecision
from mixprec.app.bench.suites import MODELS, mixprec_step
from mixprec.app.bench.timing import interleaved
from mixprec.app.machine import machine_info


def training_step(bench, single_pass: bool):
    return mixprec_step(bench, "pure_bf16", lambda model: AdamW(model.parameters(), lr=1e-4, single_pass=single_pass))


def optimizer_only(mp: MixedPrecision):
    params = [p for p in mp.model.parameters() if p.requires_grad]
    grads = [torch.randn_like(p) for p in params]

    def step() -> None:
        for param, grad in zip(params, grads, strict=True):
            param.grad = grad
        mp.optimizer.step()

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="mlp,gpt")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    records = []
    for name in args.models.split(","):
        bench = MODELS[name]()
        eager, eager_mp = training_step(bench, single_pass=False)
        single, single_mp = training_step(bench, single_pass=True)
        start = time.perf_counter()
        single()  # the first call compiles (or loads the compiled kernel from Inductor's cache)
        compile_s = time.perf_counter() - start
        steps = {
            "step, eager AdamW": eager,
            "step, single-pass AdamW": single,
            "optimizer, eager": optimizer_only(eager_mp),
            "optimizer, single-pass": optimizer_only(single_mp),
        }
        timings = interleaved(steps, repeats=args.repeats)
        for mode, timing in timings.items():
            records.append({"model": name, "mode": mode, "median_ms": timing.median_ms, "cpu_ms": timing.cpu_median_ms,
                            "spread_ms": timing.spread_ms})  # fmt: skip
        records.append({"model": name, "mode": "first single-pass step (compile or cache load)", "seconds": compile_s})
        for record in records[-5:]:
            print(record)
    out = Path(__file__).parent / "results" / "single_pass_adamw.json"
    out.write_text(json.dumps({"machine": machine_info(), "records": records}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
