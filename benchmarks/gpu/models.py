"""The models the GPU check trains, as workloads: mixprec's TinyGPT, transformers' BERT-base and GPT-2 small,
all built from their configurations with random weights (nothing downloaded), on one fixed batch."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from benchmarks.gpu.steps import Workload

from mixprec.app.tasks.byte_corpus import lm_loss
from mixprec.app.tasks.tiny_gpt import GPTConfig, TinyGPT

__all__ = ["bert", "bert_config", "gpt2", "gpt2_config", "tiny_gpt"]


def tiny_gpt(config: GPTConfig, batch: int) -> Workload:
    def tokens(device: torch.device):
        gen = torch.Generator().manual_seed(0)
        x, y = torch.randint(0, 256, (2, batch, config.context), generator=gen)
        return x.to(device), y.to(device)

    return Workload(lambda: TinyGPT(config), tokens, lm_loss)


def bert_config(dry_run: bool, layers: int | None = None):
    """BERT-base (12 layers, width 768, 110M parameters); the dry run's: 2 layers, 32 wide."""
    from transformers import BertConfig

    if dry_run:
        tiny = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 64}
        return BertConfig(vocab_size=512, max_position_embeddings=64, **tiny)
    return BertConfig(**({"num_hidden_layers": layers} if layers else {}))


def bert(config, seq: int, batch: int) -> Workload:
    """``BertForSequenceClassification``, ``batch`` sequences of ``seq`` random tokens, two labels."""
    from transformers import BertForSequenceClassification

    def data(device: torch.device):
        gen = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, config.vocab_size, (batch, seq), generator=gen)
        return tokens.to(device), torch.randint(0, 2, (batch,), generator=gen).to(device)

    def loss(output, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(output.logits.float(), labels)

    return Workload(lambda: BertForSequenceClassification(config), data, loss)


def gpt2_config(dry_run: bool, layers: int | None = None):
    """GPT-2 small (12 layers, width 768, context 1024, 124M parameters); the dry run's: 2 layers, 32 wide."""
    from transformers import GPT2Config

    if dry_run:
        return GPT2Config(vocab_size=512, n_positions=64, n_embd=32, n_layer=2, n_head=2)
    return GPT2Config(**({"n_layer": layers} if layers else {}))


def gpt2(config, seq: int, batch: int) -> Workload:
    """``GPT2LMHeadModel`` (its 48 projections are transformers' ``Conv1D``), next-token loss in FP32."""
    from transformers import GPT2LMHeadModel

    def data(device: torch.device):
        gen = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, config.vocab_size, (batch, seq + 1), generator=gen)
        return tokens[:, :-1].to(device), tokens[:, 1:].to(device)

    def loss(output, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(output.logits.float().flatten(0, 1), targets.flatten())

    return Workload(lambda: GPT2LMHeadModel(config), data, loss)
