"""The charlm task: TinyGPT on the standard library's source bytes, as TaskParts for the trainer."""

from __future__ import annotations

import torch

from mixprec.train.task import TaskConfig, TaskParts, bits_per_char
from mixprec.train.tasks.charlm import Corpus, GPTConfig, TinyGPT, lm_loss, stdlib_corpus

__all__ = ["FixedWindows", "RandomWindows", "build", "byte_lm_parts"]


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


def byte_lm_parts(
    model: torch.nn.Module,
    corpus: Corpus,
    config: TaskConfig,
    context: int,
    batch_size: int,
    batches: int,
    eval_batches: int,
    name: str,
) -> TaskParts:
    """TaskParts for any next-byte language model on ``corpus`` (charlm's TinyGPT, hf's GPT-2)."""
    batch_size = config.batch_size or batch_size
    return TaskParts(
        model=model.to(config.device),
        train_data=RandomWindows(corpus, "train", batch_size, context, batches, config.seed),
        eval_data=FixedWindows(corpus, "valid", batch_size, context, eval_batches, config.seed),
        loss_fn=lm_loss,
        metric=bits_per_char,
        defaults={"lr": 1e-3, "weight_decay": 0.01, "epochs": 1 if config.size == "tiny" else 2, "max_grad_norm": 1.0},
        description=(
            f"{name} on {corpus.files} stdlib files "
            f"({len(corpus.train):,} train / {len(corpus.valid):,} validation bytes)"
        ),
    )


def build(config: TaskConfig) -> TaskParts:
    gpt, max_bytes, batch_size, batches, eval_batches = SIZES.get(config.size, SIZES["default"])
    corpus = stdlib_corpus(max_bytes=max_bytes)
    torch.manual_seed(config.seed)  # the same weights for every policy
    name = f"TinyGPT {gpt.layers}x{gpt.width} (context {gpt.context})"
    return byte_lm_parts(TinyGPT(gpt), corpus, config, gpt.context, batch_size, batches, eval_batches, name)
