"""Train a transformers GPT-2 with the Hugging Face Trainer under a mixprec policy: one class changed.

    python examples/transformers_example.py              # o2_bf16
    python examples/transformers_example.py o2_fp16      # any preset or policy string
    torchrun --standalone --nproc_per_node 2 examples/transformers_example.py  # DDP, 2 processes (each prints)

The model is built from a config (nothing is downloaded) and learns to count modulo 32. Everything is
the ordinary Trainer with fp16=False and bf16=False; the integration is ``MixprecTrainer(..., policy=...)``
in place of ``Trainer(...)``. Each training log carries ``loss_scale`` and ``skipped_steps``.
"""

import sys
import tempfile

import torch
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments

from mixprec.integrations.transformers import MixprecTrainer


class Counting(torch.utils.data.Dataset):
    """Sequences that count upwards modulo 32 from a random start."""

    def __init__(self, n: int, seed: int, length: int = 16) -> None:
        starts = torch.randint(0, 32, (n, 1), generator=torch.Generator().manual_seed(seed))
        self.ids = (starts + torch.arange(length)) % 32

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main(policy: str = "o2_bf16") -> None:
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=32, n_positions=16, n_embd=32, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0)
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            output_dir=out,
            max_steps=20,
            per_device_train_batch_size=8,
            gradient_accumulation_steps=2,
            learning_rate=1e-2,
            max_grad_norm=1.0,  # clips the true (unscaled) gradient norm
            logging_steps=5,
            save_strategy="no",
            use_cpu=True,
            report_to=[],
            disable_tqdm=True,
        )
        trainer = MixprecTrainer(  # the line mixprec changes: Trainer(...) -> MixprecTrainer(..., policy=...)
            model=GPT2LMHeadModel(config),
            args=args,
            train_dataset=Counting(512, seed=1),
            eval_dataset=Counting(64, seed=2),
            policy=policy,
        )
        trainer.train()
        evaluation = trainer.evaluate()
    stats = trainer.stats()
    print(f"policy {stats.policy}")
    print(
        f"eval_loss {evaluation['eval_loss']:.3f}, loss scale {stats.scale:g}, skipped steps {stats.skipped_steps} "
        f"of {stats.steps}, state {stats.bytes_per_param}"
    )


if __name__ == "__main__":
    main(*sys.argv[1:])
