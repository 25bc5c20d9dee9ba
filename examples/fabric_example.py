"""mixprec inside a Lightning Fabric loop: Fabric places the model and runs the processes; mixprec sets
the precision. Keep Fabric's own precision at "32-true".

    python examples/fabric_example.py                        # mixed_fp16, an inf injected at step 3
    python examples/fabric_example.py --policy o2_bf16

`--fabric-precision bf16-true` shows the refusal: Fabric casts the model after MixedPrecision prepared
it, and MixedPrecision names the fix before anything trains.
"""

import argparse

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn

import mixprec


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policy", default="mixed_fp16")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--inject-inf-at", type=int, default=3)
    parser.add_argument("--fabric-precision", default="32-true")
    args = parser.parse_args()

    fabric = L.Fabric(accelerator="cpu", devices=1, precision=args.fabric_precision)  # the precision is mixprec's
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4)).to(fabric.device)  # before mixprec
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mp = mixprec.MixedPrecision(model, optimizer, policy=args.policy)  # before setup: exact FP32 masters
    fabric_model, _ = fabric.setup(model, optimizer)  # the optimizer steps through mp.step()
    data = torch.utils.data.TensorDataset(torch.randn(256, 16), torch.randint(0, 4, (256,)))
    loader = fabric.setup_dataloaders(torch.utils.data.DataLoader(data, batch_size=32, shuffle=True))

    step = 0
    while step < args.steps:
        for x, y in loader:
            with mp.autocast():
                loss = F.cross_entropy(fabric_model(x), y)
            if step == args.inject_inf_at:
                loss = loss * float("inf")
            mp.backward(loss)
            mp.clip_grad_norm_(1.0)
            mp.step()
            step += 1
            if step == args.steps:
                break
    stats = mp.stats()
    print(f"{stats.steps} steps, {stats.skipped_steps} skipped, scale {stats.scale:g}, loss {loss.item():.6f}")


if __name__ == "__main__":
    main()
