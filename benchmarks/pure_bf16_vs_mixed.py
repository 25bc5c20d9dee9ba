"""Final loss and model-state bytes per parameter of each policy, on a small GPT over stdlib text.

Same seed, same batches, same AdamW hyperparameters for every policy; pure_bf16 uses mixprec.AdamW
(Kahan-compensated bf16 updates), the others torch.optim.AdamW. Prints one table, writes JSON.

    python benchmarks/pure_bf16_vs_mixed.py [--steps 600] [--seeds 0,1,2] [--policies fp32,mixed_bf16,...]

Differences between policies are judged against the spread between seeds of the same policy.
"""

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from machine import machine

import mixprec
from mixprec.app.tasks.byte_corpus import bits_per_char, lm_loss, stdlib_corpus
from mixprec.app.tasks.tiny_gpt import GPTConfig, TinyGPT

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=600)
parser.add_argument("--policies", default="fp32,mixed_bf16,o2_bf16,pure_bf16")
parser.add_argument("--seeds", default="0")
parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "pure_bf16_vs_mixed.json"))
args = parser.parse_args()

config = GPTConfig(layers=2, width=128, heads=4, context=128)
corpus = stdlib_corpus()
batch_size, lr = 16, 2e-3
eval_batches = [corpus.batch("valid", 32, config.context, torch.Generator().manual_seed(1000 + i)) for i in range(10)]


def train(name: str, seed: int) -> dict:
    torch.manual_seed(seed)
    model = TinyGPT(config)
    optimizer_class = mixprec.AdamW if name == "pure_bf16" else torch.optim.AdamW
    optimizer = optimizer_class(model.parameters(), lr=lr, weight_decay=0.01)
    mp = mixprec.MixedPrecision(model, optimizer, name)
    generator = torch.Generator().manual_seed(seed)
    losses, start = [], time.perf_counter()
    for _ in range(args.steps):
        x, y = corpus.batch("train", batch_size, config.context, generator)
        with mp.autocast():
            loss = lm_loss(model(x), y)
        mp.backward(loss)
        mp.clip_grad_norm_(1.0)
        mp.step()
        losses.append(loss.item())
    seconds = time.perf_counter() - start
    with torch.no_grad(), mp.autocast():
        valid = statistics.mean(lm_loss(model(x), y).item() for x, y in eval_batches)
    stats = mp.stats()
    print(f"{name:11s} seed {seed}: valid {valid:.4f} in {seconds:.0f}s", flush=True)
    return {
        "policy": name,
        "seed": seed,
        "train_loss_last50": statistics.mean(losses[-50:]),
        "valid_loss": valid,
        "ms_per_step": 1e3 * seconds / args.steps,
        "skipped_steps": stats.skipped_steps,
        "bytes_per_param": {**vars(stats.bytes_per_param), "total": stats.bytes_per_param.total},
    }


seeds = [int(s) for s in args.seeds.split(",")]
policies = args.policies.split(",")
runs = [train(name, seed) for seed in seeds for name in policies]  # interleaved: drift hits all alike
summary = []
for name in policies:
    mine = [r for r in runs if r["policy"] == name]
    valid = [r["valid_loss"] for r in mine]
    summary.append(
        {
            "policy": name,
            "valid_mean": statistics.mean(valid),
            "valid_spread": max(valid) - min(valid),
            "ms_per_step_median": statistics.median(r["ms_per_step"] for r in mine),
            "bytes_per_param": mine[0]["bytes_per_param"]["total"],
        }
    )
reference = {r["policy"]: r for r in summary}.get("mixed_bf16", summary[0])
print(
    f"\nTinyGPT {config.layers}x{config.width}, {args.steps} steps, batch {batch_size}x{config.context} bytes, "
    f"seeds {seeds}\n"
)
print(
    f"{'policy':11s} {'valid (mean)':>12s} {'seed spread':>11s} {'bpc':>6s} {'vs mixed_bf16':>14s} "
    f"{'ms/step':>8s} {'bytes/param':>12s}"
)
for r in summary:
    delta = 100 * (r["valid_mean"] / reference["valid_mean"] - 1)
    print(
        f"{r['policy']:11s} {r['valid_mean']:12.4f} {r['valid_spread']:11.4f} {bits_per_char(r['valid_mean']):6.3f} "
        f"{delta:+13.2f}% {r['ms_per_step_median']:8.1f} {r['bytes_per_param']:12.2f}"
    )
Path(args.out).write_text(
    json.dumps(
        {
            "machine": machine(),
            "config": vars(config),
            "steps": args.steps,
            "seeds": seeds,
            "summary": summary,
            "runs": runs,
        },
        indent=2,
    )
)
print(f"\nwrote {args.out}")
