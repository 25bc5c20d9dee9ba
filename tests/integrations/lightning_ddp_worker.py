"""Run by test_lightning.py under torchrun (two CPU processes): MixprecPrecision with strategy="ddp",
rank 0's loss infinite at update 3; prints each rank's counters, LR and parameter checksum."""

import gc
import os
import sys

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import mixprec
from mixprec.integrations.lightning import MixprecPrecision


class TinyClassifier(L.LightningModule):
    def __init__(self, inf_at=None):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 16), nn.GELU(), nn.Linear(16, 2))
        self.inf_at = inf_at

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, i):
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        if self.global_step == self.inf_at and self.global_rank == 0:
            loss = loss * float("inf")
        return loss

    def configure_optimizers(self):
        adamw = mixprec.AdamW if sys.argv[1] == "pure_bf16" else torch.optim.AdamW  # pure_bf16: compensated
        opt = adamw(self.parameters(), lr=1e-2)
        schedule = torch.optim.lr_scheduler.StepLR(opt, 1, 0.9)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


torch.manual_seed(0)
data = TensorDataset(torch.randn(256, 4), torch.randint(0, 2, (256,)))
plugin = MixprecPrecision(sys.argv[1])
model = TinyClassifier(inf_at=3)
trainer = L.Trainer(
    accelerator="cpu",
    devices=2,
    strategy="ddp",
    max_steps=8,
    plugins=[plugin],
    logger=False,
    enable_checkpointing=False,
    enable_progress_bar=False,
    enable_model_summary=False,
)
trainer.fit(model, DataLoader(data, batch_size=16))
s = plugin.stats()
masters = plugin.mixed_precision.fp32_state_dict()  # the exact weights (o2: the FP32 masters)
checksum = sum(v.double().sum().item() for v in masters.values() if v.is_floating_point())
dtypes = sorted({str(p.dtype) for p in model.parameters()})
lr = trainer.optimizers[0].param_groups[0]["lr"]
line = (f"RANK {trainer.global_rank} steps {s.steps} skipped {s.skipped_steps} scale {s.scale:g} lr {lr:.6f} "
        f"checksum {checksum:.10f} params {','.join(dtypes)}\n")  # fmt: skip
os.write(1, line.encode())  # one write: an unbuffered print writes text and newline apart, and the ranks interleave
if torch.distributed.is_initialized():
    gc.collect()  # DDP wrappers caught in reference cycles go now, while the group is alive
    torch.distributed.destroy_process_group()  # a gloo group left to interpreter exit can abort it (SIGABRT, seen 2x)
