"""Run by test_lightning.py under torchrun (two CPU processes): MixprecPrecision with ModelParallelStrategy
(FSDP2, data parallel), the model sharded by mixprec.fully_shard in configure_model, rank 0's loss infinite
at updates 2 and 6, gradients clipped to norm 1.

Per case (a policy and the micro-batches per update), three fits: 2 epochs (8 updates) straight; 1 epoch and a
checkpoint; a fresh model resumed from it to 2. Rank 0 writes the gathered full model and optimizer states of
the straight and the resumed fit as safetensors under OUT_DIR/POLICY-ACCUMULATE/; every rank prints its counters
and LR after each fit. All cases run in one launch: starting the processes costs more than a case.

    torchrun --nproc_per_node 2 lightning_fsdp_worker.py OUT_DIR POLICY-ACCUMULATE... [refusals]
"""

import gc
import os
import sys
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from safetensors.torch import save_file
from torch import nn
from torch.utils.data import DataLoader, Subset, TensorDataset

import mixprec
from mixprec.integrations.lightning import MixprecPrecision
from mixprec.parallel import gather_state

EPOCHS, INF_AT = 2, (2, 6)  # epochs of 4 updates; the checkpoint falls between the two


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(16)
        self.linear = nn.Linear(16, 16)

    def forward(self, x):
        return x + self.linear(self.norm(x))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 16)
        self.blocks = nn.ModuleList([Block(), Block()])  # fully_shard's units, then the root
        self.head = nn.Linear(16, 2)

    def forward(self, x):
        x = self.first(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class Classifier(L.LightningModule):
    """Also built by the test, in one process on the global batch, as the reference."""

    def __init__(self, policy: str, shard: bool = True, loose: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.model = Net()
        self.loose = nn.Linear(2, 2) if loose else None  # a parameter configure_model leaves unsharded
        self.policy, self.shard = policy, shard

    def configure_model(self):
        if self.shard and self.policy == "pure_bf16":  # the plugin's helper: shards for the plugin's own policy
            self.trainer.precision_plugin.fully_shard(self.model, mesh=self.device_mesh["data_parallel"])
        elif self.shard:
            mixprec.fully_shard(self.model, self.policy, mesh=self.device_mesh["data_parallel"])

    def forward(self, x):
        return self.model(x)  # the sharded root: its hook gathers the weights outside the units

    def training_step(self, batch, i):
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        if self.global_step in INF_AT and self.global_rank == 0:
            loss = loss * float("inf")
        return loss

    def validation_step(self, batch, i):  # in the policy's region (forward_context), on the sharded model
        x, y = batch
        self.log("val_loss", nn.functional.cross_entropy(self(x), y), sync_dist=True)

    def configure_optimizers(self):
        adamw = mixprec.AdamW if self.policy == "pure_bf16" else torch.optim.AdamW  # pure_bf16: compensated
        opt = adamw(self.parameters(), lr=1e-2)
        schedule = torch.optim.lr_scheduler.StepLR(opt, 1, 0.9)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def data() -> TensorDataset:
    generator = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(128, 4, generator=generator), torch.randint(0, 2, (128,), generator=generator))


def trainer_for(plugin: MixprecPrecision, epochs: int, **options) -> L.Trainer:
    return L.Trainer(
        max_epochs=epochs,
        plugins=[plugin],
        gradient_clip_val=1.0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **options,
    )


def fit(
    policy: str, epochs: int, ckpt_path=None, accumulate: int = 1
) -> tuple[L.Trainer, Classifier, MixprecPrecision]:
    """Rank r trains on samples r, r + 2, ...: update k's batches are together the one-process run's k-th
    batch of 32 (sequential; no sampler of Lightning's, which would shuffle), in ``accumulate`` micro-batches."""
    plugin, model = MixprecPrecision(policy), Classifier(policy)
    strategy = ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1)
    options = {"accelerator": "cpu", "devices": 2, "strategy": strategy, "use_distributed_sampler": False}
    trainer = trainer_for(plugin, epochs, accumulate_grad_batches=accumulate, **options)
    share = Subset(data(), range(int(os.environ["RANK"]), len(data()), 2))
    trainer.fit(
        model,
        DataLoader(share, batch_size=16 // accumulate),
        DataLoader(Subset(share, range(32)), batch_size=16),
        ckpt_path=ckpt_path,
    )
    return trainer, model, plugin


def report(out: Path, case: str, name: str, trainer: L.Trainer, model: Classifier, plugin: MixprecPrecision) -> None:
    s = plugin.stats()
    lr = trainer.optimizers[0].param_groups[0]["lr"]
    model_state, optimizer_state = gather_state(model, trainer.optimizers[0])  # collective; full on rank 0
    line = f"RANK {trainer.global_rank} {case} {name} steps {s.steps} skipped {s.skipped_steps} scale {s.scale:g}"
    line += f" lr {lr:.8f} val_loss {float(trainer.callback_metrics.get('val_loss', float('nan'))):.6f}"
    os.write(1, (line + "\n").encode())  # one write: the ranks' lines do not interleave
    if trainer.global_rank == 0:
        flat = {f"model/{k}": v for k, v in model_state.items()}
        for index, values in optimizer_state["state"].items():
            flat.update({f"optimizer/{index}/{k}": v for k, v in values.items() if torch.is_tensor(v)})
        (out / case).mkdir(exist_ok=True)
        save_file({k: v.contiguous() for k, v in flat.items()}, str(out / case / f"{name}.safetensors"))


def refusals() -> None:
    """ModelParallelStrategy with tensor parallelism, the model left unsharded, the model sharded for
    another policy than the plugin's, a parameter left out of the sharding: each rank prints the ValueError
    of fit."""
    data_parallel = {"data_parallel_size": 2, "tensor_parallel_size": 1}
    cases = (
        ({"data_parallel_size": 1, "tensor_parallel_size": 2}, "o2_bf16", "o2_bf16", False),
        (data_parallel, "o2_bf16", None, False),
        (data_parallel, "o2_bf16", "mixed_bf16", False),
        (data_parallel, "mixed_bf16", "mixed_bf16", True),
    )
    for sizes, policy, shard, loose in cases:
        plugin, model = MixprecPrecision(policy), Classifier(shard or policy, shard=shard is not None, loose=loose)
        trainer = trainer_for(plugin, 1, accelerator="cpu", devices=2, strategy=ModelParallelStrategy(**sizes))
        try:
            trainer.fit(model, DataLoader(data(), batch_size=16))
        except ValueError as error:
            os.write(1, f"RANK {trainer.global_rank} REFUSED {error}\n".encode())


def run_case(out: Path, case: str) -> None:
    policy, accumulate = case.rsplit("-", 1)
    report(out, case, "straight", *fit(policy, EPOCHS, accumulate=int(accumulate)))
    trainer = fit(policy, 1, accumulate=int(accumulate))[0]
    checkpoint = out / case / "epoch1.ckpt"
    trainer.save_checkpoint(checkpoint)  # a distributed checkpoint: a folder of shards and meta.pt
    report(out, case, "resumed", *fit(policy, EPOCHS, ckpt_path=checkpoint, accumulate=int(accumulate)))


def main() -> None:
    out = Path(sys.argv[1])
    for case in sys.argv[2:]:
        if case == "refusals":
            refusals()
        else:
            run_case(out, case)


if __name__ == "__main__":
    main()
    if torch.distributed.is_initialized():
        gc.collect()  # sharded modules caught in reference cycles go now, while the group is alive
        torch.distributed.destroy_process_group()  # a gloo group left to interpreter exit can abort it (torch 2.11)
