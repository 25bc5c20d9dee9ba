"""The hf task: a Hugging Face ``transformers`` GPT-2, trained from scratch on charlm's stdlib bytes.

It shows that mixprec works on the models people actually train, not only on its own TinyGPT: the
model's forward returns a transformers ``ModelOutput``, its projections are ``Conv1D`` modules and its
LayerNorms are kept in FP32 by the ``o2_*`` policies. The model is built from a ``GPT2Config`` object
with a 256-symbol byte vocabulary, so nothing is downloaded (no weights, no tokenizer, no hub access).
"""

from __future__ import annotations

import torch

from mixprec.app.task import TaskConfig, TaskParts
from mixprec.app.tasks.byte_corpus import VOCAB, byte_lm_parts, stdlib_corpus

__all__ = ["SIZES", "build"]

# size: (n_layer, n_embd, n_head, context, corpus bytes, batch size, batches per epoch, eval batches)
SIZES = {
    "default": (4, 192, 6, 128, 3_000_000, 24, 400, 20),
    "tiny": (1, 32, 2, 32, 200_000, 8, 8, 2),
}


def build(config: TaskConfig) -> TaskParts:
    try:
        from transformers import GPT2Config, GPT2LMHeadModel
    except ImportError:
        raise ValueError("task 'hf' needs transformers: pip install 'mixprec[hf]'") from None
    layers, width, heads, context, max_bytes, batch_size, batches, eval_batches = SIZES.get(
        config.size, SIZES["default"]
    )
    gpt2 = GPT2Config(
        vocab_size=VOCAB,
        n_positions=context,
        n_embd=width,
        n_layer=layers,
        n_head=heads,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=None,  # GPT-2's defaults (50256) lie outside the byte vocabulary
        eos_token_id=None,
        attn_implementation="sdpa",  # works under CPU autocast and with bf16/fp16 parameters
    )
    corpus = stdlib_corpus(max_bytes=max_bytes)
    torch.manual_seed(config.seed)  # the same weights for every policy
    name = f"transformers GPT2LMHeadModel {layers}x{width} ({heads} heads, context {context}, byte vocabulary)"
    return byte_lm_parts(GPT2LMHeadModel(gpt2), corpus, config, context, batch_size, batches, eval_batches, name)
