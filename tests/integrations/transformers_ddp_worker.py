"""Run by test_transformers.py, under torchrun (two CPU processes, DDP) and alone (the one-process reference):
MixprecTrainer under o2_bf16 on a global batch of 16 (8 per rank), 2 micro-batches per update, plain SGD.

Each rank builds its model from its own seed, so only rank 0's weights are the reference's. Rank 0's loss is
infinite at update 1. Three runs: accumulation in 16 bits (DDP's ``no_sync``) with a checkpoint at update 2;
a resume from that checkpoint; accumulation in FP32 (``sync_each_batch``). Each run writes its FP32 weights to
``<out>/<run>-<rank or single>.safetensors`` and one line with its counters and LR."""

import gc
import os
import sys
from pathlib import Path

import torch
import transformers
from accelerate.state import AcceleratorState
from safetensors.torch import save_file
from torch import nn

from mixprec.integrations.transformers import MixprecTrainer

GLOBAL_BATCH, ACCUMULATE, UPDATES = 16, 2, 4
OUT = Path(sys.argv[1])
RANK, WORLD = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


class Regression(nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.LayerNorm(32), nn.Linear(32, 1))
        self.poison = False

    def forward(self, x, y):
        loss = nn.functional.mse_loss(self.net(x).float().squeeze(-1), y)
        return {"loss": loss * float("inf") if self.poison else loss}


class Pairs(torch.utils.data.Dataset):
    def __init__(self, n: int = GLOBAL_BATCH * ACCUMULATE * UPDATES) -> None:
        generator = torch.Generator().manual_seed(1)
        self.x = torch.randn(n, 8, generator=generator)
        self.y = self.x @ torch.linspace(-1, 1, 8)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "y": self.y[i]}


class PoisonOnRankZero(transformers.TrainerCallback):
    def on_step_begin(self, args, state, control, model=None, **kwargs):
        model.poison = state.global_step == 1 and RANK == 0


def train(name: str, resume: str | None = None, **options) -> None:
    args = transformers.TrainingArguments(
        output_dir=str(OUT / name),
        use_cpu=True,
        report_to=[],
        disable_tqdm=True,
        per_device_train_batch_size=GLOBAL_BATCH // WORLD,
        per_device_eval_batch_size=GLOBAL_BATCH // WORLD,
        gradient_accumulation_steps=ACCUMULATE,
        max_steps=UPDATES,
        optim="sgd",
        learning_rate=0.1,
        seed=0,
        label_names=["y"],  # evaluate() computes the loss
        ddp_find_unused_parameters=False,
        **options,
    )
    model = Regression(seed=100 + RANK)
    trainer = MixprecTrainer(
        model=model,
        args=args,
        train_dataset=Pairs(),
        eval_dataset=Pairs(GLOBAL_BATCH),
        callbacks=[PoisonOnRankZero()],
        policy="o2_bf16",
    )
    trainer.train(resume_from_checkpoint=resume)
    eval_loss = trainer.evaluate()["eval_loss"]  # in the policy's region, through the DDP-wrapped model
    stats = trainer.stats()
    weights = {k: v.contiguous() for k, v in trainer.mixed_precision.fp32_state_dict().items()}
    save_file(weights, str(OUT / f"{name}-{RANK if WORLD > 1 else 'single'}.safetensors"))
    lr = trainer.optimizer.param_groups[0]["lr"]
    line = (f"RUN {name} RANK {RANK} steps {stats.steps} skipped {stats.skipped_steps} lr {lr:.6f} "
            f"params {model.net[0].weight.dtype} eval {eval_loss:.6f}\n")  # fmt: skip
    os.write(1, line.encode())  # one write: the ranks' lines do not interleave
    AcceleratorState._reset_state(True)  # Accelerate keeps one process-wide state; the process group stays


train("accumulate16", save_strategy="steps", save_steps=2)
train("resumed", resume=str(OUT / "accumulate16" / "checkpoint-2"), save_strategy="no")
train(
    "accumulate32",
    save_strategy="no",
    accelerator_config={"gradient_accumulation_kwargs": {"sync_each_batch": True}},
)
if torch.distributed.is_initialized():
    gc.collect()  # DDP wrappers caught in reference cycles go now, while the group is alive
    torch.distributed.destroy_process_group()  # a gloo group left to interpreter exit can abort it (SIGABRT)
