"""What a compiled FP8 training step moves through memory, beside bf16's and torchao's: Inductor's own count.

    python benchmarks/fp8_compiled_bytes.py [--width 1024] [--layers 2] [--batch 4] [--context 1024]
                                            [--modes NAME ...] [--json FILE]

Compiled, an FP8 step is faster than bf16's only if its GEMMs save more time than its casts cost, and on a GPU
the casts (amax reductions, scaled conversions, transposed copies) are memory-bound: what they cost is the bytes
they read and write. Inductor counts those bytes for every kernel it generates and every extern kernel it calls
(GEMMs, attention) while it compiles (``torch._inductor.metrics.num_bytes_accessed``, counted where its
``inductor_metrics`` log is on): a count, the same on every machine for the same graph, so a CPU can compare what
the compiled FP8 step of mixprec, of torchao's float8 training (where it imports) and of the ``torch.autocast``
bf16 loop move, without a GPU. Inductor's CPU backend fuses as its GPU backend does for the most part (its
reductions are planned differently), and the GPU's GEMMs are compute-bound where the CPU's FP8 ones are not:
this counts traffic, it does not time anything.

The model is TinyGPT (the GPU check's ``fp8gpt`` model at another width), one training step, compiled forward
and backward (the optimizer is not compiled). Rows: generated kernels, megabytes they move, megabytes the extern
kernels move (GEMMs, attention), the sum, and the generated megabytes against the bf16 loop's (what FP8 adds
besides its GEMMs). FP8 rows run every layer but the LM head in FP8 on PyTorch's FP8 GEMM (``gemm=scaled_mm``,
``shapes=all``), as on a GPU.
"""

from __future__ import annotations

import argparse
import json
import logging
import time

import torch

from mixprec.app.bench.suites import BenchModel, mixprec_step, torch_step
from mixprec.app.machine import machine_info
from mixprec.app.tasks.byte_corpus import lm_loss
from mixprec.app.tasks.tiny_gpt import GPTConfig, TinyGPT

FP8 = "keep=lm_head,shapes=all,gemm=scaled_mm"
MIXPREC = {
    "mixprec mixed_bf16": "mixed_bf16",
    "mixprec fp8 current": f"base=fp8,fp8=({FP8})",
    "mixprec fp8 delayed": f"base=fp8,fp8=(scaling=delayed,{FP8})",
    "mixprec fp8 rowwise": f"base=fp8,fp8=(scaling=rowwise,{FP8})",
}
LOOP = "torch autocast bf16"
TORCHAO = {"torchao tensorwise": "tensorwise", "torchao rowwise": "rowwise"}
MODES = [LOOP, *MIXPREC, *TORCHAO]


def _step(mode: str, config: GPTConfig, batch: int):
    """One training step of ``mode`` on a fresh model, its forward through torch.compile: the bench suite's loops
    (``torch.autocast`` bf16, or MixedPrecision), torchao's model converted before it is compiled."""
    tokens = torch.randint(0, 256, (2, batch, config.context), generator=torch.Generator().manual_seed(0))

    def build() -> torch.nn.Module:
        model = TinyGPT(config)
        if mode in TORCHAO:
            from torchao.float8 import Float8LinearConfig, convert_to_float8_training

            recipe = Float8LinearConfig.from_recipe_name(TORCHAO[mode])
            convert_to_float8_training(model, config=recipe, module_filter_fn=lambda module, name: name != "lm_head")
        return model

    bench = BenchModel(build, lambda: (tokens[0], tokens[1]), lm_loss)
    if mode in MIXPREC:
        return mixprec_step(bench, MIXPREC[mode], compiled=True)[0]
    return torch_step(bench, torch.bfloat16, compiled=True)


def count(mode: str, config: GPTConfig, batch: int) -> dict:
    """Inductor's counts for one compiled training step of ``mode`` (compiled afresh: no cached graph)."""
    import torch._inductor.metrics as metrics

    torch._dynamo.reset()
    metrics.reset()
    start = time.perf_counter()
    _step(mode, config, batch)()
    extern = sum(4 * n for node, n in metrics.nodes_num_elem if type(node).__name__ == "ExternKernelSchedulerNode")
    total = metrics.num_bytes_accessed
    return {
        "mode": mode,
        "generated_kernels": metrics.generated_kernel_count,
        "generated_mb": (total - extern) / 1e6,
        "extern_mb": extern / 1e6,
        "total_mb": total / 1e6,
        "seconds": time.perf_counter() - start,
    }


def _available(modes: list[str]) -> list[str]:
    try:
        import torchao.float8  # noqa: F401
    except Exception as error:  # not installed, or built for another torch
        left = [mode for mode in modes if mode in TORCHAO]
        if left:
            print(f"left out {', '.join(left)}: torchao.float8 does not import ({type(error).__name__})")
        return [mode for mode in modes if mode not in TORCHAO]
    return modes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--modes", nargs="+", choices=MODES, default=MODES)
    parser.add_argument("--json", help="also write the counts, with the machine, to this file")
    args = parser.parse_args()
    if LOOP not in args.modes:
        parser.error(f"--modes: include {LOOP!r}, the row the others are compared with")
    # no cached graph (its counts are not recounted) and the byte count on (it is made only for this log)
    torch._inductor.config.fx_graph_cache = False
    torch._functorch.config.enable_autograd_cache = False
    counting = logging.getLogger("torch._inductor.compile_fx.__inductor_metrics")  # its log, quiet
    counting.setLevel(logging.INFO)
    counting.propagate = False
    config = GPTConfig(layers=args.layers, width=args.width, heads=max(1, args.width // 128), context=args.context)
    print(f"TinyGPT {config}, batch {args.batch}: one compiled training step (forward and backward)", flush=True)
    rows = []
    for mode in _available(args.modes):
        rows.append(count(mode, config, args.batch))
        print(f"  counted {mode} ({rows[-1]['seconds']:.0f} s)", flush=True)
    base = next(row for row in rows if row["mode"] == LOOP)["generated_mb"]
    print(f"  {'mode':<22} {'kernels':>7} {'generated MB':>12} {'extern MB':>9} {'total MB':>9}  generated vs bf16")
    for row in rows:
        row["generated_vs_loop"] = row["generated_mb"] / base
        print(
            f"  {row['mode']:<22} {row['generated_kernels']:>7} {row['generated_mb']:>12.1f} {row['extern_mb']:>9.1f} "
            f"{row['total_mb']:>9.1f}  {row['generated_vs_loop']:.2f}x"
        )
    if args.json:
        record = {"machine": machine_info(), "model": str(config), "batch": args.batch, "rows": rows}
        with open(args.json, "w") as handle:
            json.dump(record, handle, indent=2)


if __name__ == "__main__":
    main()
