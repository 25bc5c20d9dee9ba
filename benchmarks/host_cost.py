"""What MixedPrecision's step costs the host, beside the hand-written torch loop: a launch-bound proxy.

    python benchmarks/host_cost.py [--rounds 5] [--steps 60] [--layers 100] [--src DIR ...] [--json FILE]

The model is ``--layers`` ``Linear(16, 16)`` (200 parameters at 100 layers), batch 4, one thread: the
arithmetic is tiny, so a step's CPU time is the host work per step (Python, dispatch, guards), which on a
GPU decides whether a launch-bound step waits on the host. Pairs, interleaved round by round:

- torch.autocast bf16 + AdamW(foreach=True) (the five-line loop) against mixprec ``mixed_bf16``;
- torch.autocast fp16 + GradScaler against mixprec ``mixed_fp16`` with native kernels (``kernels=native``:
  the same kernels as the loop, not the CPU's emulation);
- the bf16 loop with ``mixprec.autocast("mixed_bf16", model)`` in place of ``torch.autocast``, entered at every
  step (a one-off region, as code moved from ``torch.autocast`` writes it; no engine): the region's own cost.

Each round times ``--steps`` steps per mode, the modes interleaved step by step after 10 warm-up steps each,
and keeps each mode's median CPU time per step; the figure is the median over rounds.
``--src DIR`` (repeatable) times mixprec from other source trees too (e.g. a worktree of an older commit), each
in its own process, interleaved with the first, each against its own process's torch loops: the ratios then
compare versions on one machine in one run. ``--json FILE`` writes the figures with the machine (CPU model,
ISA, torch), e.g. ``benchmarks/results/host_cost.json``. Goal (issue 35): <= 1.03x the torch loop.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

WARMUP = 10


def _model(layers: int):
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(layers)])


def _torch_loop(dtype_name: str, layers: int):
    import torch

    model = _model(layers)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    dtype = getattr(torch, dtype_name)
    scaler = torch.amp.GradScaler("cpu", enabled=dtype == torch.float16)
    x, y = torch.randn(4, 16), torch.randn(4, 16)

    def step():
        with torch.autocast("cpu", dtype=dtype):
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)

    return step


def _mixprec_loop(policy: str, layers: int):
    import torch

    import mixprec

    model = _model(layers)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    mp = mixprec.MixedPrecision(model, optimizer, policy=policy)
    x, y = torch.randn(4, 16), torch.randn(4, 16)

    def step():
        with mp.autocast():
            loss = torch.nn.functional.mse_loss(model(x), y)
        mp.backward(loss)
        mp.step()

    return step


def _one_off_loop(layers: int):
    import torch

    import mixprec

    model = _model(layers)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    x, y = torch.randn(4, 16), torch.randn(4, 16)

    def step():
        with mixprec.autocast("mixed_bf16", model):
            loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


MODES = {
    "torch autocast bf16": lambda layers: _torch_loop("bfloat16", layers),
    "mixprec mixed_bf16": lambda layers: _mixprec_loop("mixed_bf16", layers),
    "torch fp16 + GradScaler": lambda layers: _torch_loop("float16", layers),
    "mixprec mixed_fp16 native": lambda layers: _mixprec_loop("base=mixed_fp16,kernels=native", layers),
    "mixprec one-off mixed_bf16 region": _one_off_loop,
}


def _one_round(modes: list[str], layers: int, steps: int) -> dict[str, float]:
    """Each mode's median CPU time per step, the modes interleaved step by step (a shared machine's drift
    reaches them all alike)."""
    import torch

    torch.set_num_threads(1)
    loops = {mode: MODES[mode](layers) for mode in modes}
    for step in loops.values():
        for _ in range(WARMUP):
            step()
    times: dict[str, list[float]] = {mode: [] for mode in modes}
    for _ in range(steps):
        for mode, step in loops.items():
            start = time.process_time()
            step()
            times[mode].append(time.process_time() - start)
    return {mode: 1e3 * statistics.median(values) for mode, values in times.items()}


def _round_in(src: str | None, modes: list[str], layers: int, steps: int) -> dict[str, float]:
    """One round in a fresh process that imports mixprec from ``src`` (None: this process's own)."""
    if src is None:
        return _one_round(modes, layers, steps)
    env = dict(os.environ, PYTHONPATH=os.path.join(src, "src"))
    code = (
        f"import json, sys; sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r}); import host_cost; "
        f"print(json.dumps(host_cost._one_round({modes!r}, {layers}, {steps})))"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--layers", type=int, default=100)
    parser.add_argument("--src", action="append", default=[], help="another source tree of mixprec to time too")
    parser.add_argument("--json", help="also write the figures and the machine to this file")
    args = parser.parse_args()
    sources: list[str | None] = [None, *args.src]
    results: dict[tuple[str, str], list[float]] = {}  # (source, mode) -> ms per round
    ratios: dict[tuple[str, str], list[float]] = {}  # (source, mixprec mode) -> x its own process's torch loop
    for round_index in range(args.rounds):
        for src in sources:
            figures = _round_in(src, list(MODES), args.layers, args.steps)
            for mode, ms in figures.items():
                results.setdefault((src or "this tree", mode), []).append(ms)
                if mode.startswith("mixprec"):
                    reference = "torch autocast bf16" if "bf16" in mode else "torch fp16 + GradScaler"
                    ratios.setdefault((src or "this tree", mode), []).append(ms / figures[reference])
        print(f"round {round_index + 1}/{args.rounds} done", file=sys.stderr)
    print(f"{2 * args.layers} parameters, batch 4, one thread; median CPU ms per step over {args.rounds} rounds")
    for (src, mode), values in results.items():
        ratio = ratios.get((src, mode))
        against = f"  ({statistics.median(ratio):.3f}x the torch loop)" if ratio else ""
        print(f"  {src:<12} {mode:<28} {statistics.median(values):7.3f} ms{against}")
    if args.json:
        from mixprec.app.machine import machine_info

        records = [
            {
                "source": src,
                "mode": mode,
                "cpu_ms_per_step": statistics.median(values),
                "x_torch_loop": statistics.median(ratios[(src, mode)]) if (src, mode) in ratios else None,
            }
            for (src, mode), values in results.items()
        ]
        setup = {"parameters": 2 * args.layers, "batch": 4, "threads": 1, "rounds": args.rounds, "steps": args.steps}
        with open(args.json, "w") as handle:
            json.dump({"machine": machine_info(), "setup": setup, "records": records}, handle, indent=2)


if __name__ == "__main__":
    main()
