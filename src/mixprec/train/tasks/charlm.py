"""charlm: a small GPT trained from scratch on the Python standard library's own source text.

The corpus is present on every machine with Python, so nothing is downloaded. Text is modelled as
UTF-8 bytes (a 256-symbol vocabulary, no tokenizer); every tenth file (in sorted order) is held out
for validation, so both splits span the library. Bits per character = loss / ln 2.

Example:
    >>> corpus = stdlib_corpus(max_bytes=200_000)
    >>> model = TinyGPT(GPTConfig(layers=2, width=64, heads=4, context=32))
    >>> x, y = corpus.batch("train", batch_size=4, context=32, generator=torch.Generator().manual_seed(0))
    >>> model(x).shape
    torch.Size([4, 32, 256])
"""

from __future__ import annotations

import math
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["Corpus", "GPTConfig", "TinyGPT", "bits_per_char", "lm_loss", "stdlib_corpus"]

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


@dataclass(frozen=True)
class GPTConfig:
    layers: int = 4
    width: int = 256
    heads: int = 4
    context: int = 128
    dropout: float = 0.0


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.heads = config.heads
        self.qkv = nn.Linear(config.width, 3 * config.width)
        self.proj = nn.Linear(config.width, config.width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, time, width = x.shape
        q, k, v = self.qkv(x).split(width, dim=2)
        q, k, v = (t.view(batch, time, self.heads, width // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(batch, time, width))


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(config.width)
        self.attn = CausalSelfAttention(config)
        self.ln2 = nn.LayerNorm(config.width)
        self.mlp = nn.Sequential(
            nn.Linear(config.width, 4 * config.width), nn.GELU(), nn.Linear(4 * config.width, config.width)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """A GPT-2-style decoder: byte embeddings, pre-norm blocks, tied output head."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.embed = nn.Embedding(VOCAB, config.width)
        self.position = nn.Embedding(config.context, config.width)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.layers))
        self.ln_f = nn.LayerNorm(config.width)
        self.lm_head = nn.Linear(config.width, VOCAB, bias=False)
        self.lm_head.weight = self.embed.weight  # tied, as in GPT-2
        self.apply(self._init)

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.embed(tokens) + self.position(positions)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def lm_loss(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-byte cross-entropy, computed in FP32, from logits or a transformers output's ``.logits``.

    Targets are already shifted by one byte (see :meth:`Corpus.batch`).
    """
    logits = outputs.logits if hasattr(outputs, "logits") else outputs
    return F.cross_entropy(logits.float().reshape(-1, VOCAB), targets.reshape(-1))


def bits_per_char(loss: float) -> float:
    return loss / math.log(2)
