"""MixprecPrecision, the Lightning precision plugin: skipped steps, FP32 tracking, exact resume, clipping,
the refusals, and the example script."""

import importlib.util
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

L = pytest.importorskip("lightning")

import mixprec  # noqa: E402
import mixprec.compute  # noqa: E402
import mixprec.persist  # noqa: E402
from mixprec.integrations.lightning import GatedScheduler, MixprecPrecision  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "lightning_example.py"
BATCHES = 4  # per epoch


class Regression(L.LightningModule):
    """A two-layer MLP on a fixed linear target; ``inf_at``: the global step whose loss is multiplied by inf."""

    def __init__(self, inf_at: int | None = None, lr: float = 1e-2, gamma: float = 0.5) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
        self.inf_at, self.lr, self.gamma = inf_at, lr, gamma

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self(x).float(), y)
        return loss * float("inf") if self.global_step == self.inf_at else loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self(x).float(), y))

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.lr)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=self.gamma)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def _data(batches: int = BATCHES) -> torch.utils.data.DataLoader:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(16 * batches, 8, generator=generator)
    y = x @ torch.linspace(-1, 1, 8).unsqueeze(1)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=16)


def _trainer(plugin=None, epochs: int = 1, **options) -> "L.Trainer":
    return L.Trainer(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        max_epochs=epochs,
        plugins=[plugin] if plugin is not None else None,
        **options,
    )


class Record(L.Callback):
    """After every batch: the weights, the optimizer's step count, the scheduler's, the LR, the loss, the scale."""

    def __init__(self, plugin=None) -> None:
        self.plugin, self.rows = plugin, []

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        optimizer = trainer.optimizers[0]
        state = optimizer.state[optimizer.param_groups[0]["params"][0]]
        self.rows.append(
            {
                "weights": [p.detach().clone() for p in module.parameters()],
                "optimizer_steps": int(state["step"]) if "step" in state else 0,
                "scheduler_steps": trainer.lr_scheduler_configs[0].scheduler.last_epoch,
                "lr": optimizer.param_groups[0]["lr"],
                "loss": float(outputs["loss"]) if outputs else None,  # None: a training_step that returned None
                "scale": self.plugin.stats().scale if self.plugin is not None else None,
            }
        )


def test_an_overflowing_step_is_skipped_with_its_optimizer_and_scheduler_steps():
    plugin = MixprecPrecision("mixed_fp16", mixprec.DynamicLossScaler(init_scale=1024.0))
    record = Record(plugin)
    trainer = _trainer(plugin, callbacks=[record], log_every_n_steps=1)  # the metrics at every update
    trainer.fit(Regression(inf_at=2), _data())
    before, skipped, after = record.rows[1], record.rows[2], record.rows[3]

    assert all(torch.equal(a, b) for a, b in zip(before["weights"], skipped["weights"], strict=True))
    assert (before["optimizer_steps"], skipped["optimizer_steps"], after["optimizer_steps"]) == (2, 2, 3)
    assert (before["scheduler_steps"], skipped["scheduler_steps"], after["scheduler_steps"]) == (2, 2, 3)
    assert skipped["lr"] == before["lr"] == 1e-2 * 0.5**2 and after["lr"] == 1e-2 * 0.5**3
    assert (before["scale"], skipped["scale"]) == (1024.0, 512.0)
    assert not any(torch.equal(a, b) for a, b in zip(skipped["weights"], after["weights"], strict=True))
    assert isinstance(trainer.lr_scheduler_configs[0].scheduler, GatedScheduler)
    # the user sees the scale and the skipped count as metrics
    assert trainer.callback_metrics["mixprec/loss_scale"].item() == 512.0
    assert trainer.callback_metrics["mixprec/skipped_steps"].item() == 1.0
    assert plugin.stats().skipped_steps == 1 and plugin.stats().applied_steps == BATCHES - 1


class SkipsBatchOne(Regression):
    def training_step(self, batch, batch_idx):  # None: Lightning's "skip this batch", no update
        return None if batch_idx == 1 else super().training_step(batch, batch_idx)


def test_a_training_step_returning_none_moves_no_schedule():
    # the gate kept the previous update's verdict: after an applied update the scheduler stepped with no update
    plugin = MixprecPrecision("mixed_fp16", mixprec.DynamicLossScaler(init_scale=1024.0))
    record = Record(plugin)
    _trainer(plugin, epochs=2, callbacks=[record]).fit(SkipsBatchOne(), _data())
    steps = [(row["optimizer_steps"], row["scheduler_steps"]) for row in record.rows]
    assert steps == [(1, 1), (1, 1), (2, 2), (3, 3), (4, 4), (4, 4), (5, 5), (6, 6)]


def test_o2_bf16_tracks_the_fp32_loss_curve():
    curves = {}
    for name, plugin in (("fp32", None), ("o2_bf16", MixprecPrecision("o2_bf16"))):
        record = Record()
        model = Regression(gamma=1.0)
        trainer = _trainer(plugin, epochs=4, callbacks=[record])
        trainer.fit(model, _data())
        curves[name] = [row["loss"] for row in record.rows]
        if plugin is not None:
            assert model.net[0].weight.dtype == torch.float32 and trainer.precision == "bf16-mixed"  # handed back
            trainer.validate(model, _data(1), verbose=False)  # evaluation runs in the policy's region
            assert torch.isfinite(trainer.callback_metrics["val_loss"])
    fp32, bf16 = curves["fp32"], curves["o2_bf16"]
    assert fp32[-1] < 0.5 * fp32[0] and bf16[-1] < 0.5 * bf16[0]
    last_fp32, last_bf16 = sum(fp32[-BATCHES:]), sum(bf16[-BATCHES:])
    assert abs(last_bf16 - last_fp32) <= 0.05 * last_fp32


def _resumable(plugin_policy: str) -> tuple:
    plugin = MixprecPrecision(plugin_policy, mixprec.DynamicLossScaler(init_scale=2.0**14, growth_interval=2))
    return plugin, Regression(inf_at=5, gamma=0.9)


def test_checkpoint_and_resume_equal_the_uninterrupted_run_bit_for_bit(tmp_path):
    plugin, model = _resumable("o2_fp16")
    _trainer(plugin, epochs=3).fit(model, _data())  # 12 steps, one of them skipped

    first_plugin, first_model = _resumable("o2_fp16")
    first = _trainer(first_plugin, epochs=1)
    first.fit(first_model, _data())
    first.save_checkpoint(tmp_path / "epoch1.ckpt")
    resumed_plugin, resumed_model = _resumable("o2_fp16")
    resumed = _trainer(resumed_plugin, epochs=3)
    resumed.fit(resumed_model, _data(), ckpt_path=tmp_path / "epoch1.ckpt")

    assert resumed.global_step == 3 * BATCHES
    for name, value in model.state_dict().items():
        assert torch.equal(value, resumed_model.state_dict()[name]), name
    exact, exact_resumed = plugin.mixed_precision.fp32_state_dict(), resumed_plugin.mixed_precision.fp32_state_dict()
    assert all(torch.equal(exact[name], exact_resumed[name]) for name in exact)
    assert any(not torch.equal(exact[name].half().float(), exact[name]) for name in exact)  # masters matter
    stats, resumed_stats = plugin.stats(), resumed_plugin.stats()
    assert (stats.scale, stats.skipped_steps, stats.steps) == (resumed_stats.scale, resumed_stats.skipped_steps, 12)
    assert stats.skipped_steps >= 1
    assert resumed_plugin.state_dict()["scalers"] == plugin.state_dict()["scalers"]


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed", "32"])
def test_lightnings_own_precision_flag_with_the_plugin_is_one_clear_error(precision):
    # Lightning refuses this itself, in Trainer(); the plugin's repr makes its message name both settings.
    flag = {"32": "32-true"}.get(precision, precision)
    both = rf"Received both `precision={flag}` and `plugins=MixprecPrecision\(policy='o2_bf16'\)`\. Choose one\."
    with pytest.raises(ValueError, match=both):
        L.Trainer(accelerator="cpu", precision=precision, plugins=[MixprecPrecision("o2_bf16")])


@pytest.mark.parametrize("algorithm", ["norm", "value"])
def test_gradient_clipping_sees_the_unscaled_gradients(algorithm):
    clip = {"norm": 0.05, "value": 0.002}[algorithm]
    weights = {}
    for name, plugin, clip_val in (
        ("fp32", None, clip),
        ("scaled", MixprecPrecision("fp32", mixprec.StaticLossScaler(2.0**20)), clip),
        ("unclipped", None, None),
    ):
        model = Regression(gamma=1.0)
        _trainer(plugin, gradient_clip_val=clip_val, gradient_clip_algorithm=algorithm).fit(model, _data())
        weights[name] = [p.detach() for p in model.parameters()]
    for reference, scaled, unclipped in zip(weights["fp32"], weights["scaled"], weights["unclipped"], strict=True):
        torch.testing.assert_close(scaled, reference, rtol=1e-6, atol=1e-7)  # 2**20 is exact: same gradients
        assert not torch.allclose(reference, unclipped, rtol=1e-3, atol=1e-5)  # the clip was active


def test_gradient_accumulation_makes_one_update_per_window():
    weights, steps = {}, {}
    for name, plugin in (("fp32", None), ("scaled", MixprecPrecision("fp32", mixprec.StaticLossScaler(2.0**10)))):
        model = Regression(gamma=0.5)
        trainer = _trainer(plugin, accumulate_grad_batches=2)
        trainer.fit(model, _data())
        weights[name] = [p.detach() for p in model.parameters()]
        steps[name] = trainer.lr_scheduler_configs[0].scheduler.last_epoch
        if plugin is not None:
            assert plugin.stats().steps == BATCHES // 2
    assert steps["fp32"] == steps["scaled"] == BATCHES // 2
    for reference, scaled in zip(weights["fp32"], weights["scaled"], strict=True):
        torch.testing.assert_close(scaled, reference, rtol=1e-6, atol=1e-7)


def test_o2_accumulates_micro_batches_in_fp32_as_mixed_precision_does():
    # the bf16 .grad rounded the sum at each micro-batch: on a small MLP, 32 micro-batches gave an update
    # gradient 5.96e-3 off FP32's (relative L2) against 2.57e-3 summed in FP32
    plugin, model = MixprecPrecision("o2_bf16"), Regression()
    _trainer(plugin, accumulate_grad_batches=BATCHES).fit(model, _data())
    assert plugin.mixed_precision.accumulate_in_fp32
    reference = Regression()
    optimizer, _ = reference.configure_optimizers().values()
    mp = mixprec.MixedPrecision(reference, optimizer, "o2_bf16", accumulation_steps=BATCHES, accumulate_in_fp32=True)
    for x, y in _data():
        with mp.autocast():
            mp.backward(torch.nn.functional.mse_loss(reference(x).float(), y))
        mp.step()
    exact, expected = plugin.mixed_precision.fp32_state_dict(), mp.fp32_state_dict()
    assert all(torch.equal(exact[name], expected[name]) for name in expected)


class PureBf16WithTorchAdamW(Regression):
    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class Manual(Regression):
    def __init__(self) -> None:
        super().__init__()
        self.automatic_optimization = False


class WithLBFGS(Regression):
    def configure_optimizers(self):
        return torch.optim.LBFGS(self.parameters())


class AlreadyHalf(Regression):
    def __init__(self) -> None:
        super().__init__()
        self.net.half()


class StepsEveryTwoBatches(Regression):
    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.1)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step", "frequency": 2}}


class WarmsUpInOptimizerStep(Regression):
    """Lightning's warm-up recipe: the learning rate set from trainer.global_step, which counts skipped updates."""

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure):
        optimizer.step(closure=optimizer_closure)
        for group in optimizer.param_groups:
            group["lr"] = 0.1 * min(1.0, (self.trainer.global_step + 1) / 8)


@pytest.mark.parametrize(
    ("policy", "module", "message"),
    [
        ("mixed_fp16", WarmsUpInOptimizerStep, r"overrides LightningModule\.optimizer_step\. .*allow_optimizer_step"),
        ("pure_bf16", PureBf16WithTorchAdamW, r"the AdamW that configure_optimizers returned: .*as mixprec\.AdamW"),
        ("mixed_bf16", Manual, r"manual optimization .* Use automatic optimization"),
        ("mixed_bf16", StepsEveryTwoBatches, r"steps every 2 batches .* Use frequency=1"),
        ("mixed_bf16", WithLBFGS, r"LBFGS re-evaluates the loss"),
        ("o2_bf16", AlreadyHalf, r"needs a model with FP32 parameters .* 'net\.0\.weight'.* fit a freshly built one"),
    ],
)
def test_what_the_plugin_cannot_train_correctly_is_refused_with_the_fix(policy, module, message):
    with pytest.raises(ValueError, match=message):
        _trainer(MixprecPrecision(policy)).fit(module(), _data(1))


def test_an_optimizer_step_override_trains_once_allowed():
    module = WarmsUpInOptimizerStep()
    _trainer(MixprecPrecision("mixed_bf16", allow_optimizer_step_override=True)).fit(module, _data(2))
    assert module.trainer.global_step == 2


class PureBf16Again(Regression):
    """A module a pure_bf16 fit left in bf16, fitted again: pure_bf16 keeps no FP32 masters, so weights already
    in the policy's dtype are taken as they are (casting them from FP32 would give the same bits)."""

    def __init__(self) -> None:
        super().__init__()
        self.net.bfloat16()

    def configure_optimizers(self):
        return mixprec.AdamW(self.parameters(), lr=1e-2)


def test_a_module_already_in_pure_bf16s_dtype_fits_again_under_pure_bf16():
    module = PureBf16Again()
    before = [p.detach().clone() for p in module.parameters()]
    _trainer(MixprecPrecision("pure_bf16")).fit(module, _data(2))
    assert all(p.dtype == torch.bfloat16 for p in module.parameters())
    assert not all(torch.equal(a, b) for a, b in zip(before, module.parameters(), strict=True))  # it trained


def test_a_bad_policy_fails_when_the_plugin_is_made():
    with pytest.raises(ValueError, match="unknown"):
        MixprecPrecision("o3_fp12")


def test_the_example_runs():
    done = subprocess.run([sys.executable, str(EXAMPLE)], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "skipped steps" in done.stdout, done.stdout


def test_validate_before_fit_leaves_the_weights_for_exact_masters():
    model = Regression(gamma=1.0)
    plugin = MixprecPrecision("o2_bf16")
    trainer = _trainer(plugin, epochs=1)
    trainer.validate(model, _data(1), verbose=False)  # in the policy's region, parameters untouched
    assert all(p.dtype == torch.float32 for p in model.parameters())
    trainer = _trainer(MixprecPrecision("o2_bf16"), epochs=1)
    trainer.fit(model, _data())  # MixedPrecision would refuse 16-bit parameters (masters rounded from bf16)
    assert model.net[0].weight.dtype == torch.float32  # handed back after the fit, with the masters' values


def _ddp_run(policy: str) -> subprocess.CompletedProcess:
    worker = Path(__file__).with_name("lightning_ddp_worker.py")
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    return subprocess.run(
        [torchrun, "--standalone", "--nproc_per_node", "2", str(worker), policy],
        capture_output=True,
        text=True,
        timeout=240,
    )


def test_ddp_ranks_skip_the_same_update_and_stay_identical():
    # o2: DDP wrapped again around the cast model, its buckets for bf16 gradients (FP32-parameter policies
    # keep Lightning's own wrapper; mixed_fp16's skip agreement under DDP: tests/integrations/test_accelerate.py)
    policy, scale, params = "o2_bf16", "1", "torch.float32"  # every rank's module handed back in FP32 after the fit
    done = _ddp_run(policy)
    assert done.returncode == 0, done.stderr[-3000:]
    pattern = r"RANK (\d) steps (\d+) skipped (\d+) scale (\S+) lr (\S+) checksum (\S+) params (torch\.[a-z0-9]+)"
    ranks = re.findall(pattern, done.stdout)
    assert sorted(r[0] for r in ranks) == ["0", "1"], done.stdout
    for _, steps, skipped, got_scale, lr, _, got_params in ranks:  # rank 1's loss was finite: it skipped with rank 0
        assert (steps, skipped, got_scale, got_params) == ("8", "1", scale, params)
        assert float(lr) == pytest.approx(1e-2 * 0.9**7, rel=1e-4)  # 7 applied updates moved the schedule, not 8
    assert ranks[0][5] == ranks[1][5]  # identical replicas: the exact FP32 weights (o2: masters) agree


def _fsdp_worker():
    path = Path(__file__).with_name("lightning_fsdp_worker.py")
    spec = importlib.util.spec_from_file_location("lightning_fsdp_worker", path)
    worker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(worker)
    return worker


FSDP_CASES = [("o2_bf16", 1), ("pure_bf16", 1), ("mixed_fp16", 1), ("o2_bf16", 2)]


@pytest.fixture(scope="module")
def fsdp_launch(tmp_path_factory):
    """One torchrun launch of two CPU processes for every case and the refusals (lightning_fsdp_worker.py):
    its stdout and its folder."""
    out = tmp_path_factory.mktemp("lightning-fsdp")
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    cases = [f"{policy}-{accumulate}" for policy, accumulate in FSDP_CASES]
    command = [torchrun, "--standalone", "--nproc_per_node", "2", _fsdp_worker().__file__, str(out), *cases, "refusals"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout, out


@pytest.mark.parametrize(("policy", "accumulate"), FSDP_CASES)
def test_fsdp2_under_model_parallel_strategy_skips_together_tracks_one_process_and_resumes_exactly(
    policy, accumulate, fsdp_launch
):
    # two CPU processes, the model sharded by mixprec.fully_shard in configure_model, rank 0's loss infinite
    # at updates 2 and 6, clipping at norm 1 (the gradient norm combined over the ranks' shards); each update
    # 32 samples, in 1 or 2 micro-batches per rank (accumulate_grad_batches)
    worker, (stdout, out) = _fsdp_worker(), fsdp_launch
    case = f"{policy}-{accumulate}"
    pattern = rf"RANK (\d) {case} (\w+) steps (\d+) skipped (\d+) scale (\S+) lr (\S+) val_loss (\S+)"
    ranks = re.findall(pattern, stdout)
    assert sorted((rank, fit) for rank, fit, *_ in ranks) == [
        ("0", "resumed"), ("0", "straight"), ("1", "resumed"), ("1", "straight")
    ], stdout  # fmt: skip
    scale = "16384" if policy == "mixed_fp16" else "1"  # 2^16 halved at each skip
    for *_, steps, skipped, got_scale, lr, _ in ranks:  # rank 1's loss was finite: it skipped with rank 0
        assert (steps, skipped, got_scale) == ("8", "2", scale)
        assert float(lr) == pytest.approx(1e-2 * 0.9**6, rel=1e-6)  # 6 applied updates moved the schedule
    val_losses = {val_loss for *_, val_loss in ranks}  # evaluated in the policy's region on the sharded model
    assert len(val_losses) == 1 and 0 < float(val_losses.pop()) < 1, ranks

    straight = load_file(out / case / "straight.safetensors")
    resumed = load_file(out / case / "resumed.safetensors")
    assert straight.keys() == resumed.keys() and any(k.startswith("optimizer/") for k in straight)
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)  # the epoch-1 checkpoint loses nothing

    plugin, model = MixprecPrecision(policy), worker.Classifier(policy, shard=False)  # one process, batch 32
    trainer = worker.trainer_for(
        plugin, worker.EPOCHS, accelerator="cpu", devices=1, accumulate_grad_batches=accumulate
    )
    trainer.fit(model, torch.utils.data.DataLoader(worker.data(), batch_size=32 // accumulate))
    assert plugin.stats().skipped_steps == 2
    exact = plugin.mixed_precision.fp32_state_dict()  # o2: the masters; FSDP2's FP32 shards are its masters
    diffs = [(straight[f"model/{k}"].float() - v).abs() for k, v in exact.items()]
    if policy == "pure_bf16":  # bf16 weights: another summation order flips last bits, one step 2^-7 near 1
        mean = (sum(d.sum() for d in diffs) / sum(d.numel() for d in diffs)).item()
        # measured 5.2e-5 (largest: one bf16 step, 7.8e-3, at a LayerNorm weight of 1.04); clipping by each
        # rank's own norm instead: 1.2e-3
        assert mean < 3e-4, mean
    else:  # 16-bit gradient reductions and summation order: measured 1.8e-4 (o2_bf16), 2.9e-5 (mixed_fp16);
        worst = max(d.max().item() for d in diffs)  # clipping by each rank's own norm instead: 4.4e-3, 4.2e-3
        assert worst < 1e-3, worst


def test_what_model_parallel_strategy_cannot_train_correctly_is_refused_on_every_rank(fsdp_launch):
    stdout, _ = fsdp_launch
    refused = re.findall(r"RANK 0 REFUSED (.*)", stdout)
    assert len(refused) == 4 and len(re.findall(r"RANK 1 REFUSED", stdout)) == 4, stdout
    tensor_parallel, unsharded, other_policy, partly = refused
    assert "tensor_parallel_size=2" in tensor_parallel and "tensor_parallel_size=1)" in tensor_parallel
    assert "not sharded" in unsharded and "every rank would train its own model" in unsharded
    assert 'mixprec.fully_shard(self.model, policy, mesh=self.device_mesh["data_parallel"])' in unsharded
    assert "sharded by mixprec.fully_shard for 'params=float32,compute=bfloat16" in other_policy
    assert "pass the same policy to both" in other_policy
    assert "trainable parameter 'loose.weight' (and 1 more) is not" in partly and "Shard the whole model" in partly


class PoisonedBatch(Regression):
    """No Python branch on the step in training_step (a compiled step would recompile at every step): the
    overflow comes from the data, an inf in one batch."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        return torch.nn.functional.mse_loss(self(x).float(), y)


@pytest.mark.parametrize(
    ("compile_options", "warned"),
    [
        ({}, "without emulate_precision_casts"),
        ({"options": {"emulate_precision_casts": True}}, None),
        ({"backend": "aot_eager"}, None),
    ],
)
def test_a_module_compiled_so_that_the_emulated_roundings_are_lost_is_warned_about(
    kernel_cache, compile_options, warned
):
    # warned at setup, before anything compiles (no batch is trained: limit_train_batches=0)
    kernel_cache(torch.float16, matmul="emulated")
    model = torch.compile(PoisonedBatch(), **compile_options)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _trainer(MixprecPrecision("mixed_fp16"), limit_train_batches=0).fit(model, _poisoned_data())
    notes = [str(w.message) for w in caught if "emulated fp16" in str(w.message)]
    if warned is None and "inductor" not in compile_options.get("backend", "inductor"):
        assert notes == []  # aot_eager runs the traced casts as they are
    elif warned is None:  # inductor with the option: warned only where inductor ignores it (torch 2.11 on the CPU)
        assert len(notes) == (0 if mixprec.compute.inductor_keeps_casts("cpu") else 1), notes
    else:
        assert len(notes) == 1 and warned in notes[0] and "options={'emulate_precision_casts': True}" in notes[0]


def _poisoned_data() -> torch.utils.data.DataLoader:
    loader = _data()
    loader.dataset.tensors[0][2 * 16, 0] = float("inf")  # the first sample of the third batch
    return loader


def test_a_compiled_lightning_module_keeps_the_policys_emulated_roundings_and_skips(kernel_cache):
    # fp16 matmuls emulated (seeded kernel cache): FP32 products rounded to fp16; with emulate_precision_casts
    # inductor keeps those roundings, so the compiled fit follows the eager one: the same skips and scale
    # (without the option: the same skips here, weights 6.4e-6 apart)
    kernel_cache(torch.float16, matmul="emulated")
    runs = {}
    for name in ("eager", "compiled"):
        plugin, model = MixprecPrecision("mixed_fp16", mixprec.DynamicLossScaler(growth_interval=4)), PoisonedBatch()
        if name == "compiled":  # Lightning compiles training_step itself (from_compiled); the region stays outside
            model = torch.compile(model, options={"emulate_precision_casts": True})
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _trainer(plugin, epochs=3).fit(model, _poisoned_data())
        runs[name] = plugin
    eager, compiled = runs["eager"], runs["compiled"]
    assert compiled.mixed_precision.model._compiler_ctx is not None  # it did run compiled
    assert not [w for w in caught if "without emulate_precision_casts" in str(w.message)]  # compiled with it
    if not mixprec.compute.inductor_keeps_casts("cpu"):
        return  # torch 2.11 on the CPU: inductor drops the roundings whatever the option (docs/integrations.md)
    exact_stats, fast_stats = eager.stats(), compiled.stats()
    assert exact_stats.skipped_steps >= 3  # the poisoned batch in each epoch
    assert (fast_stats.skipped_steps, fast_stats.scale) == (exact_stats.skipped_steps, exact_stats.scale)
    exact, fast = eager.mixed_precision.fp32_state_dict(), compiled.mixed_precision.fp32_state_dict()
    worst = max((fast[name] - exact[name]).abs().max().item() for name in exact)
    assert worst <= 2e-6, worst  # measured 7.2e-7 (inductor's FP32 reorderings); without the option: 6.4e-6


def test_after_an_o2_fit_the_module_is_fp32_with_the_masters_values_and_fits_again():
    model = Regression(gamma=1.0)
    plugin = MixprecPrecision("o2_bf16")
    _trainer(plugin).fit(model, _data())
    exact = plugin.mixed_precision.fp32_state_dict()
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert all(torch.equal(exact[name], p) for name, p in model.named_parameters())
    assert not all(torch.equal(exact[n], p.bfloat16().float()) for n, p in model.named_parameters())  # not rounded
    _trainer().fit(model, _data())  # a plain FP32 fit after it: no "mat1 and mat2 must have the same dtype"

    kept = Regression(gamma=1.0)
    _trainer(MixprecPrecision("o2_bf16", fp32_after_fit=False)).fit(kept, _data())
    assert kept.net[0].weight.dtype == torch.bfloat16


def test_a_second_fit_with_the_same_plugin_continues_the_scale_and_counters():
    plugin = MixprecPrecision("mixed_fp16", mixprec.DynamicLossScaler(init_scale=1024.0))
    model = Regression(inf_at=1)
    _trainer(plugin).fit(model, _data())
    assert (plugin.stats().scale, plugin.stats().skipped_steps) == (512.0, 1)
    model.inf_at = None
    _trainer(plugin, epochs=2).fit(model, _data())  # a new Trainer: two more epochs
    assert (plugin.stats().scale, plugin.stats().skipped_steps) == (512.0, 1)
    assert plugin.stats().applied_steps == 3 * BATCHES - 1


class HookReadsGradients(Regression):
    """Reads the gradients in on_before_optimizer_step as users do: Lightning's grad_norm, and a clip of its own."""

    def __init__(self, clip: float | None = None) -> None:
        super().__init__(gamma=1.0)
        self.clip, self.norms = clip, []

    def on_before_optimizer_step(self, optimizer):
        from lightning.pytorch.utilities import grad_norm

        self.norms.append(float(grad_norm(self, norm_type=2).get("grad_2.0_norm_total", 0.0)))
        if self.clip is not None:
            torch.nn.utils.clip_grad_norm_(self.parameters(), self.clip)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_under_o2_user_code_sees_and_clips_the_unscaled_gradients():
    fp32 = HookReadsGradients()
    _trainer(max_steps=1).fit(fp32, _data())
    o2 = HookReadsGradients()
    _trainer(MixprecPrecision("o2_bf16"), max_steps=1).fit(o2, _data())
    assert o2.norms[0] > 0 and abs(o2.norms[0] / fp32.norms[0] - 1) < 0.02  # the true norm, from bf16 roundings

    start = [p.detach().clone() for p in Regression().parameters()]
    clipped = HookReadsGradients(clip=1e-3)
    _trainer(MixprecPrecision("o2_bf16", fp32_after_fit=True), max_steps=1).fit(clipped, _data())
    moved = torch.cat([(p - s).flatten() for p, s in zip(clipped.parameters(), start, strict=True)]).norm()
    assert 0 < moved <= 0.1 * 1e-3 * 1.01  # the master took the clipped gradient: lr x 1e-3


class FailsBeforeTheUpdate(L.Callback):
    def on_before_optimizer_step(self, trainer, module, optimizer):
        raise KeyError("the user's own error")


def test_a_fit_that_fails_mid_step_raises_its_own_error_and_hands_back_fp32():
    model = Regression()
    with pytest.raises(KeyError, match="the user's own error"):
        _trainer(MixprecPrecision("o2_bf16"), callbacks=[FailsBeforeTheUpdate()]).fit(model, _data())
    assert all(p.dtype == torch.float32 for p in model.parameters())
