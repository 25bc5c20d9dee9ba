"""What the integrations cost: a training step under Lightning and the Hugging Face Trainer with mixprec
against the same framework with its own precision flag, same model and data, interleaved, CPU time.

    python benchmarks/integration_step.py [--rounds 5] [--steps 10] [--frameworks lightning,hf] [--tiny] [--out DIR]

Pairs (each framework): its FP32 training against mixprec's ``fp32`` policy (the adapter's own cost: the
region, the loss-scale check, the gated scheduler, the logged statistics), and its bf16 mixed precision
(Lightning ``bf16-mixed``, ``TrainingArguments(bf16=True)``) against ``mixed_bf16`` (what a user switching
gets on this machine, kernel choices included). The model is a 4-layer GPT-2 (transformers), 256 wide,
batch 8 x 128 tokens, AdamW. Each fit runs ``--steps`` updates; a callback takes the CPU time of each
update after the first 2, and a round's figure is their median. A mode 5x slower than its pair in the
first round (PyTorch's bf16 kernels on CPUs without bf16 units) runs that round only; its ratio is that
round's. Needs the lightning and hf extras.

Writes OUT/integration_step.json (default benchmarks/results) with the machine.
"""

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from mixprec.app.machine import machine_info

VOCAB, WARMUP = 512, 2
SIZE = {"seq": 128, "batch": 8, "width": 256, "layers": 4}  # --tiny: a model that only shows the script runs
TINY = {"seq": 16, "batch": 2, "width": 32, "layers": 1}


def _gpt():
    import transformers

    torch.manual_seed(0)
    width, layers = SIZE["width"], SIZE["layers"]
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=SIZE["seq"], n_embd=width, n_layer=layers, n_head=4)
    return transformers.GPT2LMHeadModel(config)


def _tokens(steps: int) -> torch.Tensor:
    shape = (steps * SIZE["batch"], SIZE["seq"])
    return torch.randint(0, VOCAB, shape, generator=torch.Generator().manual_seed(1))


class _StepClock:
    """CPU time of every update, from the start of its batch to the end of its optimizer step."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._start = 0.0

    def start(self) -> None:
        self._start = time.process_time()

    def stop(self) -> None:
        self.times.append(time.process_time() - self._start)

    def median_ms(self) -> float:
        return 1e3 * statistics.median(self.times[WARMUP:])


def lightning_fit(mode: str, steps: int) -> float:
    import lightning as L

    from mixprec.integrations.lightning import MixprecPrecision

    clock = _StepClock()

    class Clock(L.Callback):
        def on_train_batch_start(self, *args):
            clock.start()

        def on_train_batch_end(self, *args):
            clock.stop()

    class LM(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = _gpt()

        def training_step(self, batch, i):
            (ids,) = batch
            return self.model(input_ids=ids, labels=ids).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    options = {"plugins": [MixprecPrecision(mode.split()[1])]} if mode.startswith("mixprec") else {"precision": mode}
    quiet = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=steps, callbacks=[Clock()], **quiet, **options)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(_tokens(steps)), batch_size=SIZE["batch"])
    trainer.fit(LM(), data)
    return clock.median_ms()


def hf_fit(mode: str, steps: int, out: Path) -> float:
    import transformers
    from accelerate.state import AcceleratorState

    from mixprec.integrations.transformers import MixprecTrainer

    clock = _StepClock()

    class Clock(transformers.TrainerCallback):
        def on_step_begin(self, *args, **kwargs):
            clock.start()

        def on_step_end(self, *args, **kwargs):
            clock.stop()

    class Tokens(torch.utils.data.Dataset):
        def __init__(self):
            self.ids = _tokens(steps)

        def __len__(self):
            return len(self.ids)

        def __getitem__(self, i):
            return {"input_ids": self.ids[i], "labels": self.ids[i]}

    mixprec_policy = mode.split()[1] if mode.startswith("mixprec") else None
    args = transformers.TrainingArguments(
        str(out), max_steps=steps, per_device_train_batch_size=SIZE["batch"], learning_rate=1e-4, use_cpu=True,
        bf16=mode == "bf16=True", save_strategy="no", report_to=[], logging_steps=steps, disable_tqdm=True,
    )  # fmt: skip
    kwargs = {"model": _gpt(), "args": args, "train_dataset": Tokens(), "callbacks": [Clock()]}
    trainer = MixprecTrainer(**kwargs, policy=mixprec_policy) if mixprec_policy else transformers.Trainer(**kwargs)
    trainer.train()
    AcceleratorState._reset_state(True)  # Accelerate keeps one process-wide state
    return clock.median_ms()


PAIRS = {
    "lightning": [("32-true", "mixprec fp32"), ("bf16-mixed", "mixprec mixed_bf16")],
    "hf": [("fp32", "mixprec fp32"), ("bf16=True", "mixprec mixed_bf16")],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frameworks", default="lightning,hf")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--tiny", action="store_true", help="a 1-layer, 32-wide model: checks the script runs")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = parser.parse_args()
    if args.steps <= WARMUP:
        parser.error(f"--steps must exceed the {WARMUP} untimed warm-up updates; received {args.steps}")
    if args.tiny:
        SIZE.update(TINY)
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    records = []
    for framework in args.frameworks.split(","):
        modes = [mode for pair in PAIRS[framework] for mode in pair]
        rounds: dict[str, list[float]] = {mode: [] for mode in modes}
        partner = {a: b for pair in PAIRS[framework] for a, b in (pair, pair[::-1])}
        for r in range(args.rounds):  # interleaved: every mode once per round
            for mode in modes:
                if r and rounds[mode][0] > 5 * rounds[partner[mode]][0]:
                    continue  # 5x slower than its pair in round 1 (bf16 kernels on CPUs without bf16 units)
                fit = lightning_fit if framework == "lightning" else lambda m, s: hf_fit(m, s, Path(tempfile.mkdtemp()))
                rounds[mode].append(fit(mode, args.steps))
                print(f"round {r + 1}  {framework:9} {mode:20} {rounds[mode][-1]:8.1f} ms CPU/step", flush=True)
        for own, ours in PAIRS[framework]:
            ratios = [b / a for a, b in zip(rounds[own], rounds[ours], strict=False)]  # the rounds both ran
            record = {"framework": framework, "framework_mode": own, "mixprec_mode": ours,
                      "framework_ms": statistics.median(rounds[own]), "mixprec_ms": statistics.median(rounds[ours]),
                      "ratio": statistics.median(ratios), "ratios": ratios,
                      "ratio_of_medians": statistics.median(rounds[ours]) / statistics.median(rounds[own]),
                      "rounds": {own: len(rounds[own]), ours: len(rounds[ours])}}  # fmt: skip
            records.append(record)
            print(f"{framework:9} {ours:20} / {own:12} {record['ratio']:.3f}x (per round {min(ratios):.3f}-"
                  f"{max(ratios):.3f}, of medians {record['ratio_of_medians']:.3f})  "
                  f"({record['mixprec_ms']:.1f} vs {record['framework_ms']:.1f} ms CPU/step)")  # fmt: skip
    path = out / "integration_step.json"
    summary = {"machine": machine_info(), "steps": args.steps, "size": SIZE, "records": records}
    path.write_text(json.dumps(summary, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
