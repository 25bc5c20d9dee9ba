"""Run by test_lightning.py under torchrun (two CPU processes): MixprecPrecision with strategy="ddp",
rank 0's loss infinite at update 3; prints each rank's counters, LR and parameter checksum."""

import sys

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

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
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
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
checksum = sum(p.detach().double().sum().item() for p in model.parameters())
lr = trainer.optimizers[0].param_groups[0]["lr"]
print(f"RANK {trainer.global_rank} steps {s.steps} skipped {s.skipped_steps} scale {s.scale:g} lr {lr:.6f} "
      f"checksum {checksum:.10f}", flush=True)  # fmt: skip
