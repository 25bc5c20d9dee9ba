"""The charlm task: TinyGPT trained from scratch on the standard library's source bytes."""

from __future__ import annotations

import torch

from mixprec.app.task import TaskConfig, TaskParts
from mixprec.app.tasks.byte_corpus import byte_lm_parts, stdlib_corpus
from mixprec.app.tasks.tiny_gpt import GPTConfig, TinyGPT

__all__ = ["SIZES", "build"]

SIZES = {
    "default": (GPTConfig(layers=4, width=192, heads=6, context=128), 3_000_000, 24, 400, 20),
    "tiny": (GPTConfig(layers=1, width=32, heads=2, context=32), 200_000, 8, 8, 2),
}


def build(config: TaskConfig) -> TaskParts:
    gpt, max_bytes, batch_size, batches, eval_batches = SIZES.get(config.size, SIZES["default"])
    corpus = stdlib_corpus(max_bytes=max_bytes)
    torch.manual_seed(config.seed)  # the same weights for every policy
    name = f"TinyGPT {gpt.layers}x{gpt.width} (context {gpt.context})"
    return byte_lm_parts(TinyGPT(gpt), corpus, config, gpt.context, batch_size, batches, eval_batches, name)
