"""``mixprec demo``: a short end-to-end run: one small model trained under several policies.

The data is synthetic (a random teacher network labels Gaussian inputs), so it runs anywhere in
seconds; the built-in tasks on real data come with ``mixprec train``.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch import nn

from mixprec.cli.formats_cmd import formats_table
from mixprec.cli.table import render_table
from mixprec.numerics.formats import FORMATS
from mixprec.policy.autocast import autocast
from mixprec.policy.casting import cast_module
from mixprec.policy.parse import parse_policy_list
from mixprec.policy.policy import Policy

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
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps per policy (default: 200)")
    parser.add_argument("--seed", type=int, default=0, help="random seed for data and weights (default: 0)")
    parser.set_defaults(run=run)


def _data(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(_SAMPLES, _FEATURES, generator=gen)
    teacher = torch.randn(_FEATURES, _CLASSES, generator=gen)
    y = (torch.tanh(x) @ teacher).argmax(dim=1)
    return x, y


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(_FEATURES, _HIDDEN),
        nn.LayerNorm(_HIDDEN),
        nn.GELU(),
        nn.Linear(_HIDDEN, _HIDDEN),
        nn.GELU(),
        nn.Linear(_HIDDEN, _CLASSES),
    )


def train_once(policy: Policy, steps: int, seed: int) -> dict:
    """Train under ``policy``; returns first/last loss, held-out accuracy and time per step."""
    x, y = _data(seed)
    split = _SAMPLES * 7 // 8
    train_x, train_y, test_x, test_y = x[:split], y[:split], x[split:], y[split:]
    model = cast_module(_model(seed), policy)
    # Until FP32 master weights arrive, low-precision parameters are updated in place.
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)
    gen = torch.Generator().manual_seed(seed)
    losses = []
    start = time.perf_counter()
    for _ in range(steps):
        idx = torch.randint(0, len(train_x), (_BATCH,), generator=gen)
        with autocast(policy, model):
            loss = F.cross_entropy(model(train_x[idx]), train_y[idx])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())  # host sync, once per step: fine for a demo
    seconds = time.perf_counter() - start
    with torch.no_grad(), autocast(policy, model):
        accuracy = (model(test_x).argmax(dim=1) == test_y).float().mean().item()
    return {
        "first_loss": sum(losses[:10]) / 10,
        "last_loss": sum(losses[-10:]) / 10,
        "accuracy": accuracy,
        "ms_per_step": 1e3 * seconds / steps,
    }


def run(args: argparse.Namespace) -> int:
    if args.steps < 10:
        raise ValueError(f"--steps must be at least 10; received {args.steps}.")
    pairs = parse_policy_list(args.policies)
    print(
        f"Training a {_FEATURES}-{_HIDDEN}-{_HIDDEN}-{_CLASSES} MLP for {args.steps} steps per policy "
        f"(synthetic data, seed {args.seed}, {torch.get_num_threads()} threads)\n"
    )
    rows, reference_ms = [], None
    for spec, policy in pairs:
        result = train_once(policy, args.steps, args.seed)
        reference_ms = reference_ms or result["ms_per_step"]
        rows.append(
            [
                spec,
                str(policy),
                f"{result['first_loss']:.3f} -> {result['last_loss']:.3f}",
                f"{100 * result['accuracy']:.1f}%",
                f"{result['ms_per_step']:.2f}",
                f"{reference_ms / result['ms_per_step']:.2f}x",
            ]
        )
        if policy.reason:
            print(f"{spec}: {policy.reason}")
    print()
    print(
        render_table(
            ["policy", "meaning", "train loss", "test acc", "ms/step", f"speed vs {pairs[0][0]}"], rows, align="llrrrr"
        )
    )
    print("\nThe float formats:\n")
    print(formats_table(list(FORMATS.values())))
    return 0
