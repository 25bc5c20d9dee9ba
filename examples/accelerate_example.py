"""mixprec inside an Accelerate loop: Accelerate places the model, shards the data and runs the processes;
mixprec sets the precision. Keep Accelerate's own mixed precision off.

    python examples/accelerate_example.py                          # one process
    accelerate launch --multi_gpu --num_processes 2 examples/accelerate_example.py  # two processes (gloo on CPUs)
    torchrun --nproc_per_node 2 examples/accelerate_example.py     # the same, through torchrun

`--inject-inf-at STEP` makes rank 0's loss infinite at that step: every rank skips the same update
(mixprec agrees the overflow flag across ranks), and the replicas stay identical.
"""

import argparse
import os
import sys

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from torch import nn

import mixprec


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policy", default="mixed_fp16")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--inject-inf-at", type=int, default=None)
    args = parser.parse_args()

    accelerator = Accelerator(cpu=True, mixed_precision="no")  # the precision is mixprec's
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4)).to(accelerator.device)  # before mixprec
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mp = mixprec.MixedPrecision(model, optimizer, policy=args.policy)  # before prepare: exact FP32 masters
    data = torch.utils.data.TensorDataset(torch.randn(256, 16), torch.randint(0, 4, (256,)))
    loader = accelerator.prepare(torch.utils.data.DataLoader(data, batch_size=32, shuffle=True))
    ddp_model = accelerator.prepare(model)  # DDP under torchrun; the optimizer stays mixprec's

    step = 0
    while step < args.steps:
        for x, y in loader:
            with mp.autocast():
                loss = F.cross_entropy(ddp_model(x), y)
            if step == args.inject_inf_at and accelerator.process_index == 0:
                loss = loss * float("inf")
            mp.backward(loss)
            mp.clip_grad_norm_(1.0)
            mp.step()
            step += 1
            if step == args.steps:
                break
    stats = mp.stats()
    checksum = sum(p.detach().double().sum().item() for p in model.parameters())
    print(
        f"rank {accelerator.process_index}/{accelerator.num_processes}: {stats.steps} steps, "
        f"{stats.skipped_steps} skipped, scale {stats.scale:g}, checksum {checksum:.10f}, loss {loss.item():.4f}"
    )
    accelerator.end_training()  # destroys the process group


if __name__ == "__main__":
    main()
    # Under load, a gloo worker process sometimes aborts during interpreter teardown, after its work is
    # done ("terminate called without an active exception", pytorch/pytorch#190489); leave without it.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
