"""mixprec with torch.compile: compile the model as usual; mixprec's region traces without graph breaks.

    python examples/compile_example.py [--policy mixed_bf16] [--backend inductor]

Prints the graph breaks torch._dynamo counted in the compiled forward step (0) and the loss per step.
"""

import argparse

import torch
import torch.nn.functional as F
from torch import nn

import mixprec


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policy", default="mixed_bf16")
    parser.add_argument("--backend", default="inductor", help="torch.compile backend (aot_eager: no C++ build)")
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()

    torch.manual_seed(0)
    model = nn.Sequential(nn.LayerNorm(32), nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 4))
    optimizer = (mixprec.AdamW if args.policy == "pure_bf16" else torch.optim.AdamW)(model.parameters(), lr=1e-2)
    mp = mixprec.MixedPrecision(model, optimizer, policy=args.policy)
    x, y = torch.randn(64, 32), torch.randint(0, 4, (64,))

    def forward_loss(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with mp.autocast():  # inside the compiled function: traced, no graph break
            return F.cross_entropy(model(x), y)

    explained = torch._dynamo.explain(forward_loss)(x, y)
    print(f"graph breaks: {explained.graph_break_count}")
    compiled = torch.compile(forward_loss, backend=args.backend)
    for step in range(args.steps):
        loss = compiled(x, y)
        mp.backward(loss)
        mp.step()
        print(f"step {step}: loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
