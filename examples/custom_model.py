"""Train your own model with mixprec's trainer: a factory that returns TaskParts.

    mixprec train --model examples.custom_model:build --policy mixed_bf16 --epochs 5
    mixprec compare --model examples.custom_model:build --policies fp32,mixed_bf16

The factory receives a mixprec.app.TaskConfig (batch_size, seed, device, size) and returns the model,
re-iterable training and evaluation data yielding (inputs, targets), a loss function, an optional
metric, and default hyperparameters. Run the command from the folder that contains ``examples/``.
"""

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from mixprec.app import TaskConfig, TaskParts, accuracy


def build(config: TaskConfig) -> TaskParts:
    # Two interleaved spirals: a small problem that still needs a non-linear model.
    generator = torch.Generator().manual_seed(1234)  # the data set is fixed; config.seed varies training
    angle = torch.rand(4000, generator=generator) * 4 * torch.pi
    label = torch.randint(0, 2, (4000,), generator=generator)
    radius = angle / (4 * torch.pi)
    x = torch.stack([radius * torch.cos(angle + torch.pi * label), radius * torch.sin(angle + torch.pi * label)], 1)
    x += 0.02 * torch.randn(x.shape, generator=generator)

    torch.manual_seed(config.seed)
    model = nn.Sequential(
        nn.Linear(2, 128), nn.GELU(), nn.LayerNorm(128), nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 2)
    )
    train = DataLoader(
        TensorDataset(x[:3200], label[:3200]),
        batch_size=config.batch_size or 128,
        shuffle=True,
        generator=torch.Generator().manual_seed(config.seed),  # lets the trainer replay the order on resume
    )
    test = DataLoader(TensorDataset(x[3200:], label[3200:]), batch_size=400)
    return TaskParts(
        model=model.to(config.device),
        train_data=train,
        eval_data=test,
        loss_fn=nn.functional.cross_entropy,
        metric=accuracy,
        defaults={"lr": 3e-3, "epochs": 2 if config.size == "tiny" else 20},
        description="an MLP on two interleaved spirals (examples/custom_model.py)",
    )
