"""``mixprec demo``: a short end-to-end run: one small model trained under several policies.

The data is synthetic (a random teacher network labels Gaussian inputs), so it runs anywhere in
seconds; the built-in tasks on real data come with ``mixprec train``.
"""

from __future__ import annotations

import argparse
import time
from typing import TYPE_CHECKING

from mixprec.app.cli.arg_types import seed, whole_number
from mixprec.app.cli.formats_cmd import formats_table
from mixprec.app.cli.table import render_table

if TYPE_CHECKING:  # torch is imported when the command runs, so that --help answers at once
    import torch
    from torch import nn

    from mixprec.policy import Policy

_FEATURES, _CLASSES, _HIDDEN, _SAMPLES, _BATCH = 64, 10, 1024, 24576, 256


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "demo",
        help="train a small model on synthetic data under two policies, then show the formats",
        description="Train one small MLP on synthetic data under each policy, side by side.",
    )
    parser.add_argument(
        "--policies",
        default="fp32,auto",
        help="policies to compare, comma-separated; separate policy strings with ';' (default: fp32,auto)",
    )
    parser.add_argument("--steps", type=whole_number(), default=200, help="optimizer steps per policy (default: 200)")
    parser.add_argument("--seed", type=seed, default=0, help="random seed for data and weights (default: 0)")
    parser.set_defaults(run=run)


def _data(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    import torch

    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(_SAMPLES, _FEATURES, generator=gen)
    teacher = torch.randn(_FEATURES, _CLASSES, generator=gen)
    y = (torch.tanh(x) @ teacher).argmax(dim=1)
    return x, y


def _model(seed: int) -> nn.Module:
    import torch
    from torch import nn

    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(_FEATURES, _HIDDEN),
        nn.LayerNorm(_HIDDEN),
        nn.GELU(),
        nn.Linear(_HIDDEN, _HIDDEN),
        nn.GELU(),
        nn.Linear(_HIDDEN, _CLASSES),
    )


class Training:
    """One policy's run of the demo, a step at a time, so that the policies' steps can be interleaved: the
    machine's drift (other processes, frequency) then hits every policy alike, not whichever runs first."""

    def __init__(self, policy: Policy, seed: int) -> None:
        import torch

        from mixprec.app.optimizer import adamw_for
        from mixprec.engine import MixedPrecision

        x, y = _data(seed)
        split = _SAMPLES * 7 // 8
        self.train_x, self.train_y, self.test_x, self.test_y = x[:split], y[:split], x[split:], y[split:]
        self.model = _model(seed)
        self.mp = MixedPrecision(self.model, adamw_for(policy, self.model.parameters(), "cpu", lr=2e-3), policy)
        self.gen = torch.Generator().manual_seed(seed)
        self.losses: list[float] = []
        self.seconds: list[float] = []

    def step(self) -> None:
        import torch
        import torch.nn.functional as F

        start = time.perf_counter()
        idx = torch.randint(0, len(self.train_x), (_BATCH,), generator=self.gen)
        with self.mp.autocast():
            loss = F.cross_entropy(self.model(self.train_x[idx]), self.train_y[idx])
        self.mp.backward(loss)
        self.mp.step()
        self.losses.append(loss.item())  # host sync, once per step: fine for a demo
        self.seconds.append(time.perf_counter() - start)

    def result(self) -> dict:
        import torch

        with torch.no_grad(), self.mp.autocast():
            accuracy = (self.model(self.test_x).argmax(dim=1) == self.test_y).float().mean().item()
        timed = sorted(self.seconds[min(10, len(self.seconds) // 4) :])  # first steps: allocations, set-up
        return {
            "first_loss": sum(self.losses[:10]) / 10,
            "last_loss": sum(self.losses[-10:]) / 10,
            "accuracy": accuracy,
            "ms_per_step": 1e3 * timed[len(timed) // 2],  # the median step
            "stats": self.mp.stats(),
        }


def train_side_by_side(policies: list[Policy], steps: int, seed: int) -> list[dict]:
    """Train every policy ``steps`` steps, their steps interleaved (A, B, A, B, ...); a result per policy."""
    trainings = [Training(policy, seed) for policy in policies]
    for _ in range(steps):
        for training in trainings:
            training.step()
    return [training.result() for training in trainings]


def run(args: argparse.Namespace) -> int:
    import torch

    from mixprec.numerics import FORMATS
    from mixprec.policy import parse_policy_list

    if args.steps < 10:
        raise ValueError(f"--steps must be at least 10; received {args.steps}.")
    pairs = parse_policy_list(args.policies)
    print(
        f"Training a {_FEATURES}-{_HIDDEN}-{_HIDDEN}-{_CLASSES} MLP for {args.steps} steps per policy "
        f"(synthetic data, seed {args.seed}, {torch.get_num_threads()} threads; the policies' steps interleaved, "
        "ms/step their median)\n"
    )
    for spec, policy in pairs:
        print(f"{spec}: {policy}" + (f"  [{policy.reason}]" if policy.reason else ""))
    rows, reference_ms = [], None
    for (spec, _), result in zip(pairs, train_side_by_side([p for _, p in pairs], args.steps, args.seed), strict=True):
        reference_ms = reference_ms or result["ms_per_step"]
        stats = result["stats"]
        rows.append(
            [
                spec,
                f"{result['first_loss']:.3f} -> {result['last_loss']:.3f}",
                f"{100 * result['accuracy']:.1f}%",
                f"{result['ms_per_step']:.2f}",
                f"{reference_ms / result['ms_per_step']:.2f}x",
                str(stats.skipped_steps),
                f"{stats.scale:g}",
                f"{stats.bytes_per_param.total:.1f}",
            ]
        )
    headers = [
        "policy",
        "train loss",
        "test acc",
        "ms/step",
        f"speed vs {pairs[0][0]}",
        "skipped",
        "scale",
        "bytes/param",
    ]
    print()
    print(render_table(headers, rows))
    print("\nThe float formats:\n")
    print(formats_table(list(FORMATS.values())))
    return 0
