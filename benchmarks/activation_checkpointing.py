"""Activation checkpointing under a policy: a MiniLM-shaped BERT (6 layers, 384 wide, batch 16 x 128 tokens),
one training step with and without ``gradient_checkpointing_enable()``: the CPU time per step, the two
interleaved, median of 4. Memory is not printed: on the CPU the allocator keeps freed pages, so the process's
peak RSS depends on which run came first. Needs transformers.

    python benchmarks/activation_checkpointing.py mixed_bf16
"""

import sys
import time
import warnings

import torch
import transformers

import mixprec

warnings.filterwarnings("ignore")
CONFIG = transformers.BertConfig(
    vocab_size=30522, hidden_size=384, num_hidden_layers=6, num_attention_heads=12, intermediate_size=1536
)


def make(policy: str, checkpointing: bool):
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(CONFIG)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    return model, mixprec.MixedPrecision(model, torch.optim.AdamW(model.parameters(), lr=1e-5), policy)


def main(policy: str) -> None:
    torch.set_num_threads(2)
    ids = torch.randint(0, CONFIG.vocab_size, (16, 128), generator=torch.Generator().manual_seed(0))
    labels = torch.randint(0, 2, (16,), generator=torch.Generator().manual_seed(1))

    def step(model, mp) -> None:
        with mp.autocast():
            loss = model(input_ids=ids, labels=labels).loss
        mp.backward(loss)
        mp.step()
        model.zero_grad(set_to_none=True)

    runs = {checkpointing: make(policy, checkpointing) for checkpointing in (False, True)}
    for model, mp in runs.values():  # warm-up
        step(model, mp)
    times: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(4):
        for checkpointing, (model, mp) in runs.items():
            start = time.process_time()
            step(model, mp)
            times[checkpointing].append(time.process_time() - start)

    def median(values: list) -> float:
        return sorted(values)[len(values) // 2]

    for checkpointing in (False, True):
        print(f"{policy} checkpointing={checkpointing}: step {median(times[checkpointing]) * 1000:.0f} ms CPU")
    print(f"checkpointing: {median(times[True]) / median(times[False]):.2f}x the step time")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "mixed_bf16")
