"""mixprec inside an Accelerate loop: Accelerate places the model, shards the data and runs the processes;
mixprec sets the precision. Keep Accelerate's own mixed precision off.

    python examples/accelerate_example.py                          # one process
    accelerate launch --multi_gpu --num_processes 2 examples/accelerate_example.py  # two processes (gloo on CPUs)
    torchrun --nproc_per_node 2 examples/accelerate_example.py     # the same, through torchrun

`--inject-inf-at STEP` makes rank 0's loss infinite at that step: every rank skips the same update
(mixprec agrees the overflow flag across ranks), and the replicas stay identical.

`--fsdp` shards the model with FSDP2 through mixprec.fully_shard (before MixedPrecision, with the same
policy) instead of DDP; Accelerate then launches the processes and shards the data, and the model is not
passed to `prepare` (it would wrap the sharded model in DDP, which cannot take FSDP2's parameters).
"""

import argparse
import os
import sys

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from torch import nn

import mixprec
from mixprec.parallel import gather_state


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policy", default="mixed_fp16")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--inject-inf-at", type=int, default=None)
    parser.add_argument("--fsdp", action="store_true", help="FSDP2 through mixprec.fully_shard instead of DDP")
    args = parser.parse_args()

    accelerator = Accelerator(cpu=True, mixed_precision="no")  # the precision is mixprec's
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4)).to(accelerator.device)  # before mixprec
    if args.fsdp:
        mixprec.fully_shard(model, args.policy)  # FSDP2 carries out the policy's parameter dtypes
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    mp = mixprec.MixedPrecision(model, optimizer, policy=args.policy)  # before prepare: exact FP32 masters
    data = torch.utils.data.TensorDataset(torch.randn(256, 16), torch.randint(0, 4, (256,)))
    loader = accelerator.prepare(torch.utils.data.DataLoader(data, batch_size=32, shuffle=True))
    ddp_model = model if args.fsdp else accelerator.prepare(model)  # DDP; the optimizer stays mixprec's

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
    # the whole model: each rank's replica under DDP; under FSDP2 the shards gathered (a collective)
    weights = gather_state(model, optimizer)[0] if args.fsdp else dict(model.named_parameters())
    checksum = f"{sum(p.detach().double().sum().item() for p in weights.values()):.10f}" if weights else "on rank 0"
    print(
        f"rank {accelerator.process_index}/{accelerator.num_processes}: {stats.steps} steps, "
        f"{stats.skipped_steps} skipped, scale {stats.scale:g}, checksum {checksum}, loss {loss.item():.4f}"
    )
    accelerator.end_training()  # destroys the process group


if __name__ == "__main__":
    main()
    # Under load, a gloo worker process sometimes aborts during interpreter teardown, after its work is
    # done ("terminate called without an active exception", pytorch/pytorch#190489); leave without it.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
