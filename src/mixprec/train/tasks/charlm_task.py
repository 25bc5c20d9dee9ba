"""The charlm task: TinyGPT on the standard library's source bytes, as TaskParts for the trainer."""

from __future__ import annotations

import torch

from mixprec.train.task import TaskConfig, TaskParts, bits_per_char
from mixprec.train.tasks.charlm import Corpus, GPTConfig, TinyGPT, lm_loss, stdlib_corpus

__all__ = ["RandomWindows", "build"]


class RandomWindows:
    """``batches`` random (input, next-byte target) windows per pass; reseed ``generator`` to replay a pass."""

    def __init__(self, corpus: Corpus, split: str, batch_size: int, context: int, batches: int, seed: int) -> None:
        self.corpus, self.split = corpus, split
        self.batch_size, self.context, self.batches = batch_size, context, batches
        self.generator = torch.Generator().manual_seed(seed)

    def __len__(self) -> int:
        return self.batches

    def __iter__(self):
        for _ in range(self.batches):
            yield self.corpus.batch(self.split, self.batch_size, self.context, self.generator)


class FixedWindows(RandomWindows):
    """The same windows on every pass: a stable validation set."""

    def __iter__(self):
        self.generator.manual_seed(10_007)
        return super().__iter__()


SIZES = {
    "default": (GPTConfig(layers=4, width=192, heads=6, context=128), 3_000_000, 24, 400, 20),
    "tiny": (GPTConfig(layers=1, width=32, heads=2, context=32), 200_000, 8, 8, 2),
}


def build(config: TaskConfig) -> TaskParts:
    gpt, max_bytes, batch_size, batches, eval_batches = SIZES.get(config.size, SIZES["default"])
    corpus = stdlib_corpus(max_bytes=max_bytes)
    torch.manual_seed(config.seed)
    batch_size = config.batch_size or batch_size
    return TaskParts(
        model=TinyGPT(gpt).to(config.device),
        train_data=RandomWindows(corpus, "train", batch_size, gpt.context, batches, config.seed),
        eval_data=FixedWindows(corpus, "valid", batch_size, gpt.context, eval_batches, config.seed),
        loss_fn=lm_loss,
        metric=bits_per_char,
        defaults={"lr": 1e-3, "weight_decay": 0.01, "epochs": 1 if config.size == "tiny" else 2, "max_grad_norm": 1.0},
        description=(
            f"TinyGPT {gpt.layers}x{gpt.width} (context {gpt.context}) on {corpus.files} stdlib files "
            f"({len(corpus.train):,} train / {len(corpus.valid):,} validation bytes)"
        ),
    )
