"""Byte-level language modelling on the Python standard library's own source text (charlm and hf).

The corpus is present on every machine with Python, so nothing is downloaded. Text is modelled as
UTF-8 bytes (a 256-symbol vocabulary, no tokenizer); every tenth file (in sorted order) is held out
for validation, so both splits span the library. Bits per character = loss / ln 2.

Example:
    >>> corpus = stdlib_corpus(max_bytes=200_000)
    >>> x, y = corpus.batch("train", batch_size=4, context=32, generator=torch.Generator().manual_seed(0))
    >>> x.shape, y.shape
    (torch.Size([4, 32]), torch.Size([4, 32]))
"""

from __future__ import annotations

import math
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from mixprec.app.task import TaskConfig, TaskParts
from mixprec.app.task import bits_per_char as bits_per_char_metric

__all__ = [
    "VOCAB",
    "Corpus",
    "FixedWindows",
    "RandomWindows",
    "bits_per_char",
    "byte_lm_parts",
    "lm_loss",
    "stdlib_corpus",
]

VOCAB = 256  # bytes


@dataclass(frozen=True)
class Corpus:
    """Byte-level train and validation text as uint8 tensors."""

    train: torch.Tensor
    valid: torch.Tensor
    files: int

    def batch(
        self, split: str, batch_size: int, context: int, generator: torch.Generator | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Random windows of ``context`` bytes and the bytes that follow each position."""
        data = {"train": self.train, "valid": self.valid}[split]
        starts = torch.randint(0, len(data) - context - 1, (batch_size,), generator=generator)
        offsets = torch.arange(context + 1)
        windows = data[starts[:, None] + offsets].long()
        return windows[:, :-1], windows[:, 1:]


def stdlib_corpus(max_bytes: int | None = None, root: str | Path | None = None) -> Corpus:
    """The top-level ``*.py`` files of the running Python's standard library.

    Args:
        max_bytes: keep at most this many bytes in total (both splits), for quick runs.
        root: another directory of ``*.py`` files (tests use a small one).
    """
    directory = Path(root) if root is not None else Path(sysconfig.get_paths()["stdlib"])
    files = sorted(directory.glob("*.py"))
    if len(files) < 10:
        raise FileNotFoundError(
            f"charlm needs at least 10 *.py files in {directory}; found {len(files)}. "
            "Pass root= a directory of Python sources."
        )
    train, valid, total = bytearray(), bytearray(), 0
    for index, path in enumerate(files):
        data = path.read_bytes()
        if max_bytes is not None and total + len(data) > max_bytes:
            data = data[: max(0, max_bytes - total)]
        (valid if index % 10 == 9 else train).extend(data)
        total += len(data)
        if max_bytes is not None and total >= max_bytes:
            break
    return Corpus(train=_as_tensor(train), valid=_as_tensor(valid), files=len(files))


def _as_tensor(data: bytearray) -> torch.Tensor:
    return torch.frombuffer(data, dtype=torch.uint8).clone() if data else torch.zeros(0, dtype=torch.uint8)


def lm_loss(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-byte cross-entropy, computed in FP32, from logits or a transformers output's ``.logits``.

    Targets are already shifted by one byte (see :meth:`Corpus.batch`).
    """
    logits = outputs.logits if hasattr(outputs, "logits") else outputs
    return F.cross_entropy(logits.float().reshape(-1, VOCAB), targets.reshape(-1))


def bits_per_char(loss: float) -> float:
    return loss / math.log(2)


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
        metric=bits_per_char_metric,
        defaults={"lr": 1e-3, "weight_decay": 0.01, "epochs": 1 if config.size == "tiny" else 2, "max_grad_norm": 1.0},
        description=(
            f"{name} on {corpus.files} stdlib files "
            f"({len(corpus.train):,} train / {len(corpus.valid):,} validation bytes)"
        ),
    )
