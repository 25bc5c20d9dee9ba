"""digits: a small CNN on scikit-learn's bundled handwritten digits (1797 real 8x8 images, 10 classes).

The data ships inside scikit-learn, so nothing is downloaded. The split is stratified, 80/20, and
fixed (it does not depend on the training seed), so every policy and seed is scored on the same 360
test images.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from mixprec.app.task import TaskConfig, TaskParts, accuracy

__all__ = ["DigitsCNN", "build", "load_digits_split"]


def load_digits_split() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(train_x, train_y, test_x, test_y); images scaled to [0, 1], shape (N, 1, 8, 8)."""
    try:
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split
    except ImportError as exc:
        raise ValueError("task 'digits' needs scikit-learn: pip install 'mixprec[train]'") from exc
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32).reshape(-1, 1, 8, 8) / 16.0
    y = torch.tensor(digits.target, dtype=torch.int64)
    train_idx, test_idx = train_test_split(
        torch.arange(len(y)).numpy(), test_size=0.2, stratify=y.numpy(), random_state=0
    )
    return x[train_idx], y[train_idx], x[test_idx], y[test_idx]


class DigitsCNN(nn.Module):
    """Three 3x3 convolutions with batch norm, one pooling, a linear classifier (~100k parameters)."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, width, 3, padding=1),
            nn.BatchNorm2d(width),
            nn.ReLU(),
            nn.Conv2d(width, 2 * width, 3, padding=1),
            nn.BatchNorm2d(2 * width),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(2 * width, 4 * width, 3, padding=1),
            nn.BatchNorm2d(4 * width),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
        )
        self.classifier = nn.Linear(4 * width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


def build(config: TaskConfig) -> TaskParts:
    train_x, train_y, test_x, test_y = load_digits_split()
    torch.manual_seed(config.seed)
    model = DigitsCNN().to(config.device)
    generator = torch.Generator().manual_seed(config.seed)  # reseeded by the trainer every epoch
    train = DataLoader(
        TensorDataset(train_x, train_y), batch_size=config.batch_size or 64, shuffle=True, generator=generator
    )
    test = DataLoader(TensorDataset(test_x, test_y), batch_size=512)
    tiny = config.size == "tiny"
    return TaskParts(
        model=model,
        train_data=train,
        eval_data=test,
        loss_fn=nn.functional.cross_entropy,
        metric=accuracy,
        defaults={"lr": 3e-3, "weight_decay": 1e-4, "epochs": 2 if tiny else 15, "max_grad_norm": None},
        description=f"DigitsCNN on scikit-learn digits ({len(train_y)} train / {len(test_y)} test images)",
    )
