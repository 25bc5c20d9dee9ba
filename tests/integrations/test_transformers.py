"""MixprecTrainer, the Hugging Face Trainer adapter: skipped steps, FP32 tracking, exact resume, clipping of the
true gradients, gradient accumulation, the refusals, and the example script. Tiny models built from code or a
config; nothing is downloaded."""

import dataclasses
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from accelerate.state import AcceleratorState, GradientState  # noqa: E402

import mixprec  # noqa: E402
import mixprec.compute  # noqa: E402
import mixprec.persist  # noqa: E402
from mixprec.integrations.transformers import STATE_NAME, GatedScheduler, MixprecTrainer  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "transformers_example.py"
# the installed transformers' name: gradient checkpointing was renamed activation checkpointing after 5.17
_CHECKPOINTING_ARGUMENT = (
    "activation_checkpointing"
    if "activation_checkpointing" in {f.name for f in dataclasses.fields(transformers.TrainingArguments)}
    else "gradient_checkpointing"
)
BATCH = 8


@pytest.fixture(autouse=True)
def fresh_accelerator_state():
    yield
    AcceleratorState._reset_state(True)  # Accelerate keeps one process-wide state
    GradientState._reset_state()  # and one of gradient syncing, which a test may leave unsynced


@pytest.fixture(autouse=True)
def seeded_cpu_kernels(kernel_cache):
    """The CPU kernels the timing probe picks on the development machine, seeded rather than measured: these
    tests are about the Trainer, and the probe takes seconds per dtype on a busy machine (the example's
    subprocess reads the same cache)."""
    kernel_cache(torch.bfloat16, attention="gemm")
    kernel_cache(torch.float16, matmul="emulated", conv="emulated", attention="emulated")


class Regression(nn.Module):
    """An MLP with a LayerNorm (FP32 under o2) on a fixed linear target; returns {"loss": ...} as HF models do.
    ``poison``: the loss is multiplied by inf (set by InjectInf for one update)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.LayerNorm(32), nn.Linear(32, 1))
        self.poison = False

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        loss = nn.functional.mse_loss(self.net(x).float().squeeze(-1), y)
        return {"loss": loss * float("inf") if self.poison else loss}


class Pairs(torch.utils.data.Dataset):
    def __init__(self, n: int = 8 * BATCH) -> None:
        generator = torch.Generator().manual_seed(1)
        self.x = torch.randn(n, 8, generator=generator)
        self.y = self.x @ torch.linspace(-1, 1, 8)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "y": self.y[i]}


class Counting(torch.utils.data.Dataset):
    """Token sequences that count upwards modulo 32 from a random start: a GPT-2 learns them in a few steps."""

    def __init__(self, n: int = 64, length: int = 16) -> None:
        starts = torch.randint(0, 32, (n, 1), generator=torch.Generator().manual_seed(2))
        self.ids = (starts + torch.arange(length)) % 32

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _gpt2() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=32,
        n_positions=16,
        n_embd=32,
        n_layer=2,
        n_head=2,
        bos_token_id=0,
        eos_token_id=0,
        resid_pdrop=0,
        embd_pdrop=0,
        attn_pdrop=0,
    )
    return transformers.GPT2LMHeadModel(config)


def _args(tmp_path: Path, **options) -> "transformers.TrainingArguments":
    settings = {
        "output_dir": str(tmp_path),
        "use_cpu": True,
        "report_to": [],
        "disable_tqdm": True,
        "per_device_train_batch_size": BATCH,
        "max_steps": 4,
        "logging_steps": 1,
        "save_strategy": "no",
        "learning_rate": 1e-2,
        "seed": 0,
    }
    return transformers.TrainingArguments(**{**settings, **options})


def _train(tmp_path, policy=None, scaler=None, model=None, data=None, callbacks=None, resume=None, **options):
    """A Trainer (``policy=None``: transformers' own, FP32) or a MixprecTrainer, trained; returns it."""
    parts = {
        "model": model if model is not None else Regression(),
        "args": _args(tmp_path, **options),
        "train_dataset": data if data is not None else Pairs(),
        "callbacks": callbacks,
    }
    fp32 = policy is None
    trainer = transformers.Trainer(**parts) if fp32 else MixprecTrainer(**parts, policy=policy, scaler=scaler)
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def _logs(trainer, key: str) -> list[float]:
    return [row[key] for row in trainer.state.log_history if "loss" in row]


class InjectInf(transformers.TrainerCallback):
    """Poisons the loss of the update at ``global_step == at``."""

    def __init__(self, at: int | None) -> None:
        self.at = at

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        model.poison = state.global_step == self.at


class Record(transformers.TrainerCallback):
    """After every update: weights, the optimizer's step count, the scheduler's, the LR, the scale."""

    def __init__(self) -> None:
        self.trainer, self.rows = None, []

    def on_step_end(self, args, state, control, model=None, optimizer=None, lr_scheduler=None, **kwargs):
        adam = optimizer.state[optimizer.param_groups[0]["params"][0]]
        self.rows.append(
            {
                "weights": [p.detach().clone() for p in model.parameters()],
                "optimizer_steps": int(adam["step"]) if "step" in adam else 0,
                "scheduler_steps": lr_scheduler.last_epoch,
                "lr": optimizer.param_groups[0]["lr"],
                "scale": self.trainer.stats().scale if self.trainer is not None else None,
            }
        )


def test_an_overflowing_step_is_skipped_with_its_optimizer_and_scheduler_steps(tmp_path):
    record = Record()
    model = Regression()
    trainer = MixprecTrainer(
        model=model,
        args=_args(tmp_path),
        train_dataset=Pairs(),
        callbacks=[InjectInf(at=2), record],
        policy="mixed_fp16",
        scaler=mixprec.DynamicLossScaler(init_scale=1024.0),
    )
    record.trainer = trainer
    trainer.train()
    before, skipped, after = record.rows[1], record.rows[2], record.rows[3]

    assert all(torch.equal(a, b) for a, b in zip(before["weights"], skipped["weights"], strict=True))
    assert (before["optimizer_steps"], skipped["optimizer_steps"], after["optimizer_steps"]) == (2, 2, 3)
    assert (before["scheduler_steps"], skipped["scheduler_steps"], after["scheduler_steps"]) == (2, 2, 3)
    assert skipped["lr"] == before["lr"] == pytest.approx(1e-2 * (1 - 2 / 4)) and after["lr"] < before["lr"]
    assert (before["scale"], skipped["scale"], after["scale"]) == (1024.0, 512.0, 512.0)
    assert not any(torch.equal(a, b) for a, b in zip(skipped["weights"], after["weights"], strict=True))
    assert isinstance(trainer.lr_scheduler, GatedScheduler)
    # the Trainer's logs carry the scale and the skipped count; the logged loss and norm are the true ones
    assert _logs(trainer, "loss_scale") == [1024.0, 1024.0, 512.0, 512.0]
    assert _logs(trainer, "skipped_steps") == [0, 0, 1, 1]
    assert _logs(trainer, "grad_norm")[0] == pytest.approx(_logs(_train(tmp_path / "fp32"), "grad_norm")[0], rel=1e-2)
    assert trainer.stats().skipped_steps == 1 and trainer.stats().applied_steps == 3


class Dtypes(transformers.TrainerCallback):
    """The dtype of the model's logits and of a Linear layer's output inside it, seen from training start (after
    MixedPrecision installed its output cast)."""

    def __init__(self) -> None:
        self.seen = {}

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        model.register_forward_hook(lambda module, args, output: self.seen.update(logits=output.logits.dtype))
        model.transformer.h[0].mlp.c_fc.register_forward_hook(
            lambda module, args, output: self.seen.update(inner=output.dtype)
        )


def test_o2_bf16_tracks_the_fp32_loss_curve(tmp_path):
    curves, dtypes = {}, Dtypes()
    for policy in (None, "o2_bf16"):
        model = _gpt2()
        trainer = _train(tmp_path / str(policy), policy, model=model, data=Counting(), callbacks=[dtypes], max_steps=24)
        curves[policy] = _logs(trainer, "loss")
    assert dtypes.seen == {"logits": torch.float32, "inner": torch.bfloat16}  # the region: bf16 inside, FP32 out
    assert model.transformer.h[0].mlp.c_fc.weight.dtype == torch.bfloat16  # cast by the policy
    assert model.transformer.ln_f.weight.dtype == torch.float32  # norms stay FP32 under o2
    assert trainer.optimizer.param_groups[0]["params"][0].dtype == torch.float32  # AdamW steps FP32 masters
    assert torch.isfinite(torch.tensor(trainer.evaluate(Counting(16))["eval_loss"]))  # evaluation in the region

    fp32, bf16 = curves[None], curves["o2_bf16"]
    assert fp32[-1] < 0.6 * fp32[0] and bf16[-1] < 0.6 * bf16[0]
    last_fp32, last_bf16 = sum(fp32[-4:]), sum(bf16[-4:])
    assert abs(last_bf16 - last_fp32) <= 0.03 * last_fp32  # measured: 0.06% (loss 3.28 -> 1.07 in 24 steps)


def _resumable(tmp_path, resume=None, **options):
    record = Record()
    scaler = mixprec.DynamicLossScaler(init_scale=2.0**14, growth_interval=2)
    trainer = MixprecTrainer(
        model=Regression(),
        args=_args(tmp_path, max_steps=11, save_strategy="steps", save_steps=4, **options),
        train_dataset=Pairs(),
        callbacks=[InjectInf(at=5), record],
        policy="o2_fp16",
        scaler=scaler,
    )
    record.trainer = trainer
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def test_checkpoint_and_resume_equal_the_uninterrupted_run_bit_for_bit(tmp_path):
    whole = _resumable(tmp_path / "whole")  # 11 steps over two epochs, one skipped; checkpoints at 4 and 8
    saved = mixprec.persist.read_checkpoint_file(str(tmp_path / "whole" / "checkpoint-4" / STATE_NAME))  # a str too
    assert saved["policy"] == str(whole.policy) and len(saved["masters"]) == 4 and saved["counters"]["steps"] == 4

    resumed = _resumable(tmp_path / "resumed", resume=str(tmp_path / "whole" / "checkpoint-4"))
    assert resumed.state.global_step == 11
    for name, value in whole.model.state_dict().items():
        assert torch.equal(value, resumed.model.state_dict()[name]), name
    exact, exact_resumed = whole.mixed_precision.fp32_state_dict(), resumed.mixed_precision.fp32_state_dict()
    assert all(torch.equal(exact[name], exact_resumed[name]) for name in exact)
    assert any(not torch.equal(exact[name].half().float(), exact[name]) for name in exact)  # masters matter
    stats, resumed_stats = whole.stats(), resumed.stats()
    assert (stats.scale, stats.skipped_steps, stats.steps) == (resumed_stats.scale, resumed_stats.skipped_steps, 11)
    assert 5 in stats.recent_overflow_steps and stats.scale != 2.0**14  # the injected overflow, and fp16's own
    assert resumed.lr_scheduler.get_last_lr() == whole.lr_scheduler.get_last_lr()
    assert _logs(resumed, "loss") == _logs(whole, "loss")  # the first 4 from the checkpoint's trainer_state.json
    assert _logs(resumed, "loss_scale") == _logs(whole, "loss_scale")


def test_a_damaged_mixprec_state_is_refused_on_resume_with_the_file_and_the_fix(tmp_path):
    _resumable(tmp_path / "whole")
    checkpoint = tmp_path / "damaged" / "checkpoint-4"
    shutil.copytree(tmp_path / "whole" / "checkpoint-4", checkpoint)
    state = checkpoint / STATE_NAME
    data = bytearray(state.read_bytes())
    data[-3] ^= 0x01  # one bit of a tensor (a master weight, a scale): the file still parses
    state.write_bytes(bytes(data))
    message = rf"cannot resume from {re.escape(str(checkpoint))}: .*checksum mismatch.* earlier checkpoint-N, or delete"
    with pytest.raises(ValueError, match=message):
        _resumable(tmp_path / "resumed", resume=str(checkpoint))


def test_a_checkpoint_of_an_earlier_version_resumes_from_its_mixprec_state_pt(tmp_path):
    whole = _resumable(tmp_path / "whole")
    checkpoint = tmp_path / "legacy" / "checkpoint-4"
    shutil.copytree(tmp_path / "whole" / "checkpoint-4", checkpoint)
    state = mixprec.persist.read_checkpoint_file(checkpoint / STATE_NAME)
    torch.save(state, checkpoint / "mixprec_state.pt")  # what earlier versions wrote
    (checkpoint / STATE_NAME).unlink()
    resumed = _resumable(tmp_path / "resumed", resume=str(checkpoint))
    exact, exact_resumed = whole.mixed_precision.fp32_state_dict(), resumed.mixed_precision.fp32_state_dict()
    assert all(torch.equal(exact[name], exact_resumed[name]) for name in exact)  # the masters came back
    assert resumed.stats().scale == whole.stats().scale


@pytest.mark.parametrize("flag", ["fp16", "bf16"])
def test_the_trainers_own_half_precision_with_mixprec_is_one_clear_error(tmp_path, flag):
    message = (
        rf"MixprecTrainer: received TrainingArguments\({flag}=True\) together with policy='o2_bf16'; two "
        r"mixed-precision systems would fight .* set fp16=False and bf16=False.* bf16=True policy='mixed_bf16' "
        r".* Not policy='bf16': a lone dtype means it everywhere"
    )
    with pytest.raises(ValueError, match=message):
        MixprecTrainer(model=Regression(), args=_args(tmp_path, **{flag: True}), policy="o2_bf16")


def test_max_grad_norm_clips_the_unscaled_gradients(tmp_path):
    runs = {
        "fp32": (None, None, 0.05),
        "scaled": ("fp32", mixprec.StaticLossScaler(2.0**20), 0.05),  # 2**20 is exact: the same gradients
        "fp16": ("mixed_fp16", mixprec.StaticLossScaler(2.0**10), 0.05),
        "unclipped": (None, None, 0.0),
        "measured": ("mixed_fp16", mixprec.StaticLossScaler(2.0**10), 0.0),  # max_grad_norm=0: logged, not clipped
    }
    weights, norms = {}, {}
    for name, (policy, scaler, clip) in runs.items():
        trainer = _train(tmp_path / name, policy, scaler, optim="sgd", max_grad_norm=clip)
        weights[name] = [p.detach().float() for p in trainer.model.parameters()]
        norms[name] = _logs(trainer, "grad_norm")
    assert norms["fp32"][0] > 10 * 0.05  # the clip is active
    assert norms["scaled"] == pytest.approx(norms["fp32"], rel=1e-6)  # the true norm, not 2**20 times it
    assert norms["fp16"] == pytest.approx(norms["fp32"], rel=1e-2)
    assert norms["measured"] == pytest.approx(norms["unclipped"], rel=1e-2)
    for reference, scaled, fp16, unclipped, measured in zip(*weights.values(), strict=True):
        torch.testing.assert_close(scaled, reference, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(fp16, reference, rtol=1e-2, atol=1e-3)
        assert not torch.allclose(reference, unclipped, rtol=1e-3, atol=1e-5)
        torch.testing.assert_close(measured, unclipped, rtol=1e-2, atol=1e-3)


@pytest.mark.parametrize("kind", ["mean_loss", "loss_over_tokens"])
def test_gradient_accumulation_matches_fp32(tmp_path, kind):
    # mean_loss: the Trainer divides each micro-batch's loss by the accumulation steps; loss_over_tokens: a
    # GPT-2 divides its summed loss by num_items_in_batch, the tokens of the whole accumulated batch
    build, data = (Regression, Pairs) if kind == "mean_loss" else (_gpt2, Counting)
    options = {"optim": "sgd", "gradient_accumulation_steps": 2, "per_device_train_batch_size": BATCH // 2}
    weights, steps = {}, {}
    for name, policy, scaler in (
        ("fp32", None, None),
        ("scaled", "fp32", mixprec.StaticLossScaler(2.0**10)),
        ("o2_fp16", "o2_fp16", mixprec.DynamicLossScaler(init_scale=2.0**10)),
    ):
        trainer = _train(tmp_path / name, policy, scaler, model=build(), data=data(), **options)
        exact = trainer.mixed_precision.fp32_state_dict() if policy else trainer.model.state_dict()
        weights[name] = [exact[n] for n, _ in trainer.model.named_parameters()]
        steps[name] = trainer.lr_scheduler.last_epoch
        if policy is not None:
            assert trainer.stats().steps == 4 and trainer.stats().skipped_steps == 0  # one update per 2 batches
    assert steps == {"fp32": 4, "scaled": 4, "o2_fp16": 4}
    for reference, scaled, fp16 in zip(weights["fp32"], weights["scaled"], weights["o2_fp16"], strict=True):
        torch.testing.assert_close(scaled, reference, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(fp16, reference, rtol=1e-2, atol=2e-3)


def test_pure_bf16_gets_mixprec_adamw_from_the_trainers_adamw(tmp_path, monkeypatch):
    monkeypatch.setenv("MIXPREC_SINGLE_PASS", "0")  # the eager Kahan step: no kernel to compile in a test
    trainer = _train(tmp_path, "pure_bf16", weight_decay=0.1)
    inner = trainer.mixed_precision.optimizer
    assert isinstance(inner, mixprec.AdamW)
    assert [group["weight_decay"] for group in inner.param_groups] == [0.1, 0.0]  # biases and norms: none
    assert trainer.model.net[0].weight.dtype == torch.bfloat16 and trainer.stats().applied_steps == 4


def test_load_best_model_at_end_brings_the_masters_of_that_checkpoint(tmp_path):
    options = {"eval_strategy": "steps", "eval_steps": 2, "save_strategy": "steps", "save_steps": 2, "max_steps": 6}
    trainer = MixprecTrainer(
        model=Regression(),
        # the highest loss is best: an earlier checkpoint than the last
        args=_args(
            tmp_path,
            load_best_model_at_end=True,
            metric_for_best_model="loss",
            greater_is_better=True,
            label_names=["y"],
            **options,
        ),
        train_dataset=Pairs(),
        eval_dataset=Pairs(16),
        policy="o2_bf16",
    )
    trainer.train()
    best = trainer.state.best_model_checkpoint
    # the best checkpoint's masters and scale; the run's counters (6 updates, as global_step), not the checkpoint's
    assert best is not None and int(best.rsplit("-", 1)[1]) < 6
    assert trainer.stats().steps == trainer.state.global_step == 6
    exact = trainer.mixed_precision.fp32_state_dict()
    for name, param in trainer.model.named_parameters():
        assert torch.equal(exact[name].to(param.dtype), param), name


def test_evaluate_before_train_and_a_second_train_continue_the_same_run(tmp_path, monkeypatch):
    # a fresh kernel cache: the bf16 probe runs inside the Trainer's evaluation, under no_grad
    monkeypatch.setenv("MIXPREC_CACHE_DIR", str(tmp_path / "unmeasured"))
    trainer = MixprecTrainer(
        model=Regression(),
        args=_args(tmp_path, label_names=["y"]),
        train_dataset=Pairs(),
        eval_dataset=Pairs(16),
        policy="o2_bf16",
    )
    before = trainer.evaluate()["eval_loss"]  # in the policy's region, on the model as it is (FP32)
    assert trainer.model.net[0].weight.dtype == torch.float32
    trainer.train()
    trainer.train()  # the same MixedPrecision and optimizer: 4 more updates
    assert trainer.stats().steps == 8 and trainer.model.net[0].weight.dtype == torch.bfloat16
    assert trainer.evaluate()["eval_loss"] < before


class Bf16Model(Regression):
    def __init__(self) -> None:
        super().__init__()
        self.net.bfloat16()


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            {_CHECKPOINTING_ARGUMENT: True, f"{_CHECKPOINTING_ARGUMENT}_kwargs": {"use_reentrant": True}},
            r"reentrant checkpoint recomputes the forward outside the policy's region",
        ),
        ({"auto_find_batch_size": True}, r"set per_device_train_batch_size yourself"),
        ({"optim": "lomo"}, r"optim='lomo'.* updates inside the backward pass"),
    ],
)
def test_what_the_trainer_cannot_guarantee_is_refused_when_made(tmp_path, options, message):
    with pytest.raises(ValueError, match=message):
        MixprecTrainer(model=Regression(), args=_args(tmp_path, **options), policy="mixed_bf16")


def test_accelerates_own_mixed_precision_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    with pytest.raises(ValueError, match=r"Accelerate's mixed precision is on .* --mixed_precision no"):
        MixprecTrainer(model=Regression(), args=_args(tmp_path), policy="mixed_bf16")


@pytest.mark.parametrize(
    ("policy", "model", "options", "message"),
    [
        (
            "pure_bf16",
            Regression,
            {"optim": "sgd"},
            r"the SGD the Trainer built \(optim='sgd'\): .*optim='adamw_torch' \(built as mixprec\.AdamW\)",
        ),
        ("o2_bf16", Bf16Model, {}, r"needs a model with FP32 parameters"),
    ],
)
def test_what_mixed_precision_refuses_is_refused_at_train_with_the_trainer_named(
    tmp_path, policy, model, options, message
):
    with pytest.raises(ValueError, match=rf"MixprecTrainer\(policy='{policy}'\): MixedPrecision refused .*{message}"):
        _train(tmp_path, policy, model=model(), **options)


def test_a_model_sharded_with_fsdp2_is_refused_when_made(tmp_path):
    # under torchrun the Trainer would wrap the DTensor parameters in DDP, which cannot take them
    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model = mixprec.fully_shard(Regression(), "mixed_bf16")
        with pytest.raises(ValueError, match=r"FSDP2-sharded parameters .* mixprec\.fully_shard .* loop of your own"):
            MixprecTrainer(model=model, args=_args(tmp_path), policy="mixed_bf16")
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.filterwarnings("ignore::FutureWarning")  # transformers' own gradient_checkpointing_enable rename
@pytest.mark.parametrize("policy", ["mixed_bf16", "base=o2_fp16,kernels=emulated"])
def test_activation_checkpointing_trains_exactly_as_without(tmp_path, policy):
    plain = _train(tmp_path / "plain", policy, model=_gpt2(), data=Counting())
    recomputing = _train(
        tmp_path / "recomputing", policy, model=_gpt2(), data=Counting(), **{_CHECKPOINTING_ARGUMENT: True}
    )
    assert recomputing.model.transformer.h[0].gradient_checkpointing  # the layers did recompute
    assert _logs(recomputing, "loss") == _logs(plain, "loss")
    for a, b in zip(plain.model.parameters(), recomputing.model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_lbfgs_a_bad_policy_and_a_bad_scaler_are_refused(tmp_path):
    model = Regression()
    lbfgs = (torch.optim.LBFGS(model.parameters()), None)
    with pytest.raises(ValueError, match=r"LBFGS re-evaluates the loss inside step\(\)"):
        MixprecTrainer(model=model, args=_args(tmp_path), train_dataset=Pairs(), optimizers=lbfgs).train()
    with pytest.raises(ValueError, match="unknown"):
        MixprecTrainer(model=Regression(), args=_args(tmp_path), policy="o3_fp12")
    with pytest.raises(TypeError, match=r"needs a mixprec\.LossScaler or None; received 1024"):
        MixprecTrainer(model=Regression(), args=_args(tmp_path), scaler=1024)


def test_the_example_runs():
    done = subprocess.run([sys.executable, str(EXAMPLE)], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "skipped steps" in done.stdout, done.stdout


def _ddp_worker(out: Path, processes: int) -> dict[str, dict]:
    """The DDP worker's runs on ``processes`` CPU processes: {"<run> <rank>": counters, LR, dtype, weights}."""
    worker = str(Path(__file__).with_name("transformers_ddp_worker.py"))
    launch = [str(Path(sys.executable).with_name("torchrun")), "--standalone", "--nproc_per_node", "2"]
    command = [*launch, worker, str(out)] if processes == 2 else [sys.executable, worker, str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    pattern = r"RUN (\S+) RANK (\d) steps (\d+) skipped (\d+) lr (\S+) params (\S+) eval (\S+)"
    runs = {}
    for name, rank, steps, skipped, lr, params, eval_loss in re.findall(pattern, done.stdout):
        tag = rank if processes == 2 else "single"
        weights = load_file(str(out / f"{name}-{tag}.safetensors"))
        counts = (int(steps), int(skipped), params)
        runs[f"{name} {tag}"] = {"counts": counts, "lr": float(lr), "eval": float(eval_loss), "weights": weights}
    assert len(runs) == 3 * processes, done.stdout
    return runs


def test_ddp_ranks_skip_together_stay_identical_resume_and_match_one_process(tmp_path):
    # 2 ranks x 8 examples == 1 process x 16 (o2_bf16, 2 micro-batches per update); rank 0's loss is infinite
    # at update 1, and each rank built its model from its own seed
    ranks, single = _ddp_worker(tmp_path / "ddp", 2), _ddp_worker(tmp_path / "single", 1)
    for run in ("accumulate16", "resumed", "accumulate32"):
        zero, one, alone = ranks[f"{run} 0"], ranks[f"{run} 1"], single[f"{run} single"]
        # every rank skipped the update only rank 0 overflowed, and the schedule counts 3 applied updates of 4
        assert zero["counts"] == one["counts"] == alone["counts"] == (4, 1, "torch.bfloat16")
        assert zero["lr"] == one["lr"] == alone["lr"] == pytest.approx(0.1 * (1 - 3 / 4))
        assert zero["eval"] == one["eval"]
        for name, weight in zero["weights"].items():
            assert torch.equal(weight, one["weights"][name]), name  # replicas: rank 1 took rank 0's weights
            # the one-process run on the whole batch, up to bf16 gradient roundings (accumulation in bf16, a
            # bf16 all-reduce); a rank's own gradients or seed would miss by 1e-2 or more
            torch.testing.assert_close(weight, alone["weights"][name], rtol=0, atol=2e-3)
    # resumed from update 2 == uninterrupted, bit for bit
    for rank in "01":
        resumed, whole = ranks[f"resumed {rank}"]["weights"], ranks[f"accumulate16 {rank}"]["weights"]
        assert all(torch.equal(resumed[name], whole[name]) for name in whole)


def test_torch_compile_keeps_the_policys_emulated_roundings_and_skips(tmp_path, caplog):
    # fp16 matmuls emulated (this file's kernel cache): FP32 products rounded to fp16, roundings inductor fuses
    # away unless told to keep them; without them, the scaler's first overflows never happened (1 skip, not 3)
    runs = {}
    for name, options in (("eager", {}), ("compiled", {"torch_compile": True})):
        with caplog.at_level("WARNING"):
            trainer = _train(tmp_path / name, "mixed_fp16", callbacks=[InjectInf(at=2)], **options)
        runs[name] = trainer
        AcceleratorState._reset_state(True)
    eager, compiled = runs["eager"], runs["compiled"]
    assert type(compiled.model_wrapped).__name__ == "OptimizedModule"  # Accelerate compiled it in prepare
    keeps = mixprec.compute.inductor_keeps_casts("cpu")
    assert ("drops 16-bit round trips" in caplog.text) != keeps  # warned where inductor cannot keep them
    if not keeps:  # torch 2.11 on the CPU: the compiled run computes some fp16 ops in FP32, as it warned
        return
    fast_stats, exact_stats = compiled.stats(), eager.stats()
    assert (fast_stats.skipped_steps, fast_stats.scale) == (exact_stats.skipped_steps, exact_stats.scale)
    assert exact_stats.skipped_steps == 3  # two at the initial scale, one injected
    torch.testing.assert_close(_logs(compiled, "loss"), _logs(eager, "loss"), rtol=1e-5, atol=0)
    exact, fast = eager.mixed_precision.fp32_state_dict(), compiled.mixed_precision.fp32_state_dict()
    for name in exact:
        torch.testing.assert_close(fast[name], exact[name], rtol=1e-5, atol=1e-6)


def test_a_loss_the_trainer_computes_gets_no_warning_about_a_loss_inside_the_compiled_model(tmp_path, caplog):
    inline = "CrossEntropyLoss() made inside the compiled forward"
    warns_here = inline in (mixprec.compute.dropped_roundings_note(True, torch.float16, "cpu") or "")
    for loss_func, warned in ((None, warns_here), (lambda outputs, labels, num_items_in_batch=None: outputs, False)):
        caplog.clear()
        trainer = MixprecTrainer(
            model=Regression(),
            args=_args(tmp_path, torch_compile=True),
            train_dataset=Pairs(),
            policy="mixed_fp16",
            compute_loss_func=loss_func,  # the Trainer takes the labels away: the model computes no loss
        )
        with caplog.at_level("WARNING"):
            trainer.create_optimizer()
        assert (inline in caplog.text) == warned
        AcceleratorState._reset_state(True)


class GradientNorm(transformers.TrainerCallback):
    """In on_pre_optimizer_step, as users log or clip: the norm of the model's gradients, and how many it sees."""

    def __init__(self) -> None:
        self.norms, self.missing = [], []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        grads = [p.grad for p in model.parameters() if p.requires_grad]
        self.missing.append(sum(g is None for g in grads))
        self.norms.append(float(torch.cat([g.float().flatten() for g in grads if g is not None]).norm()))


def test_under_o2_a_callback_sees_every_unscaled_gradient(tmp_path):
    fp32, o2 = GradientNorm(), GradientNorm()
    _train(tmp_path / "fp32", None, callbacks=[fp32], max_steps=1)
    _train(tmp_path / "o2", "o2_bf16", callbacks=[o2], max_steps=1)
    assert o2.missing == [0]  # none is None, though o2 keeps them on the FP32 masters
    assert o2.norms[0] == pytest.approx(fp32.norms[0], rel=2e-2)  # the true norm, from their bf16 roundings
