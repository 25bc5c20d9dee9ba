"""Part ``gpt2``: transformers' ``GPT2LMHeadModel`` (GPT-2 small, 124M parameters, from ``GPT2Config()`` with
random weights), batch 8 x 1024 tokens, the same table as the gpt part: every policy beside the hand-written
loops (``torch.autocast`` bf16, fp16 + GradScaler, FP32, the bf16-weights loop; fused AdamW), eager, and a
subset compiled while the compile budget lasts, timed in interleaved rounds, each with a short profile.

What it shows that the TinyGPT cannot: a model users bring, whose projections are transformers' ``Conv1D``
rather than ``nn.Linear``, with a 50257-token vocabulary whose logits dominate the step's memory.
"""

from __future__ import annotations

from benchmarks.gpu import models
from benchmarks.gpu.common import Part, Settings
from benchmarks.gpu.part_gpt import BF16_WEIGHTS_LOOP, Table, run_table

__all__ = ["run"]

POLICIES = ("fp32", "mixed_bf16", "mixed_fp16", "o2_bf16", "pure_bf16", "fp8")
COMPILED = (
    "torch autocast bf16",
    "mixed_bf16",
    "torch autocast fp16",
    "mixed_fp16",
    "o2_bf16",
    "pure_bf16",
    BF16_WEIGHTS_LOOP,
)


def run(settings: Settings, part: Part) -> None:
    config = models.gpt2_config(settings.dry_run)
    batch, seq = (2, 32) if settings.dry_run else (8, 1024)
    work = models.gpt2(config, seq, batch)
    params = sum(p.numel() for p in work.build().parameters())  # the tied head counted once
    part.meta.update(
        model=f"GPT2LMHeadModel, {config.n_layer} layers, width {config.n_embd}, vocab {config.vocab_size}"
    )
    table = Table(params, batch, seq, config.n_layer, config.n_embd, POLICIES, COMPILED)
    run_table(settings, part, work, table)
