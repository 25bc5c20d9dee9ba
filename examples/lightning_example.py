"""Train an unchanged LightningModule under a mixprec policy: one plugin in the Trainer.

    python examples/lightning_example.py              # o2_bf16
    python examples/lightning_example.py o2_fp16      # any preset or policy string

Everything below the LightningModule is ordinary Lightning; the integration is the ``plugins=[...]``
line. The plugin logs ``mixprec/loss_scale`` and ``mixprec/skipped_steps``; ``plugin.stats()`` has the rest.
"""

import sys

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import mixprec
from mixprec.engine import needs_compensated_optimizer
from mixprec.integrations.lightning import MixprecPrecision


class RingClassifier(L.LightningModule):
    def __init__(self, adamw: type[torch.optim.Optimizer] = torch.optim.AdamW) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(2, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 2))
        self.adamw = adamw

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, label = batch
        loss = nn.functional.cross_entropy(self(x), label)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, label = batch
        self.log("val_acc", (self(x).argmax(1) == label).float().mean())

    def configure_optimizers(self):
        optimizer = self.adamw(self.parameters(), lr=3e-3)
        schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=1e-2, total_steps=self.trainer.max_steps)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def rings(n: int, seed: int) -> TensorDataset:
    """Points in the plane, labelled by whether they lie outside the circle of radius 1.2."""
    x = torch.randn(n, 2, generator=torch.Generator().manual_seed(seed))
    return TensorDataset(x, (x.norm(dim=1) > 1.2).long())


def main(policy: str = "o2_bf16") -> None:
    torch.manual_seed(0)
    train = DataLoader(rings(2048, 1), batch_size=64, shuffle=True)
    val = DataLoader(rings(512, 2), batch_size=512)
    plugin = MixprecPrecision(policy)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=40,
        gradient_clip_val=1.0,  # clips the true (unscaled) gradient norm
        plugins=[plugin],  # the line mixprec adds
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    # pure_bf16 keeps no FP32 masters: its updates need mixprec.AdamW (compensated); every other policy, any AdamW
    adamw = mixprec.AdamW if needs_compensated_optimizer(mixprec.get_policy(policy)) else torch.optim.AdamW
    trainer.fit(RingClassifier(adamw), train, val)
    stats = plugin.stats()
    print(f"policy {stats.policy}")
    print(
        f"val_acc {trainer.callback_metrics['val_acc']:.3f}, loss scale {stats.scale:g}, skipped steps "
        f"{stats.skipped_steps} of {stats.steps}, state {stats.bytes_per_param}"
    )


if __name__ == "__main__":
    main(*sys.argv[1:])
