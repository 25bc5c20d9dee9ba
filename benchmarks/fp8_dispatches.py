"""What an eager FP8 layer asks of the host: PyTorch operations dispatched per training pass, beside bf16's.

    python benchmarks/fp8_dispatches.py [--json FILE]

Eager, a GPU runs one kernel (or none: views, transposes) per operation the host dispatches, and each costs the
host its Python, dispatch and launch whatever the tensor's size: on an H200 the width-2048 GPT's eager FP8 step
launched 1408 kernels against bf16's 357 and took 2.1x as long, the GPU waiting on the host (docs/fp8.md). So
the count of operations one FP8 layer dispatches per training pass (forward, input and weight gradients) is the
host cost of FP8 in eager mode, on any machine: counted here with a ``TorchDispatchMode`` on the path CUDA takes
(``gemm=scaled_mm``, PyTorch's FP8 GEMM, which the CPU has too), per recipe, beside the same layer under
``torch.autocast`` bf16. Counted, not timed: a count is the same on every machine.

Rows: ``launching`` counts the operations that run a kernel; ``total`` adds the views, transposes and
detaches, which cost the host without a kernel.
"""

from __future__ import annotations

import argparse
import collections
import json

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mixprec.policy import Fp8Recipe
from mixprec.regions.fp8 import Fp8LinearState, fp8_linear

NO_KERNEL = {"view", "t", "detach", "alias", "_unsafe_view", "as_strided", "expand", "transpose", "reshape", "permute"}
RECIPES = {
    "fp8 current": Fp8Recipe(keep=(), gemm="scaled_mm"),
    "fp8 delayed": Fp8Recipe(scaling="delayed", keep=(), gemm="scaled_mm"),
    "fp8 rowwise": Fp8Recipe(scaling="rowwise", keep=(), gemm="scaled_mm"),
}


class _Count(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _pass(layer, leaves: list[torch.Tensor]) -> collections.Counter[str]:
    """The operations of one forward + backward of ``layer()`` (its output's gradient given, not counted), after
    one uncounted pass (what is done once per process: the cast's probe)."""
    out = layer()
    grad = torch.ones_like(out)
    out.backward(grad)
    for leaf in leaves:  # a first gradient, not one accumulated into the warm-up's
        leaf.grad = None
    with _Count() as count:
        out = layer()
        out.backward(grad)
    return count.ops


def counts() -> dict[str, dict]:
    torch.manual_seed(0)
    x = torch.randn(32, 64, dtype=torch.bfloat16, requires_grad=True)
    w = torch.nn.Parameter(torch.randn(48, 64) * 0.05)
    b = torch.nn.Parameter(torch.zeros(48))

    def bf16():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return torch.nn.functional.linear(x, w, b)

    layers = {"bf16 autocast": bf16}
    for name, recipe in RECIPES.items():
        state = Fp8LinearState(recipe)
        layers[name] = lambda state=state: fp8_linear(x, w, b, state, torch.bfloat16)
    rows = {}
    for name, layer in layers.items():
        ops = _pass(layer, [x, w, b])
        launching = sum(n for op, n in ops.items() if op not in NO_KERNEL)
        rows[name] = {"launching": launching, "total": sum(ops.values()), "ops": dict(ops.most_common())}
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write the counts to this file")
    args = parser.parse_args()
    rows = counts()
    base = rows["bf16 autocast"]["launching"]
    print("operations dispatched per training pass of one layer (forward + backward), the CUDA path (gemm=scaled_mm)")
    print(f"  {'mode':<16} {'launching':>9} {'total':>6}  vs bf16")
    for name, row in rows.items():
        print(f"  {name:<16} {row['launching']:>9} {row['total']:>6}  {row['launching'] / base:5.2f}x")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"torch": torch.__version__, "rows": rows}, handle, indent=2)


if __name__ == "__main__":
    main()
