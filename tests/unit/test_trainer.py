import dataclasses
import json
import logging
import os
import signal

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import mixprec
import mixprec.app
from mixprec.app import BatchChecks, RunOptions, TrainData, Trainer, TrainingInterrupted, UpdateOptions, accuracy
from mixprec.app.checkpoint import list_checkpoints, save_checkpoint
from mixprec.app.tasks.digits import DigitsCNN, load_digits_split

DIGITS = load_digits_split()


def make_trainer(
    out_dir,
    policy="o2_bf16",
    loss_fn=torch.nn.functional.cross_entropy,
    accumulation_steps=1,
    eval_every=None,
    device="cpu",
    adamw=None,
    **run_options,
):
    train_x, train_y, test_x, test_y = DIGITS
    torch.manual_seed(0)
    model = DigitsCNN(width=8).to(device)
    train = DataLoader(TensorDataset(train_x, train_y), batch_size=64, shuffle=True, generator=torch.Generator())
    test = DataLoader(TensorDataset(test_x, test_y), batch_size=512)
    optimizer = torch.optim.AdamW(model.parameters(), **{"lr": 3e-3, **(adamw or {})})
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + 0.05 * step))
    return Trainer(
        model,
        optimizer,
        TrainData(train, test, loss_fn, metric=accuracy),
        policy,
        scheduler=scheduler,
        update=UpdateOptions(max_grad_norm=1.0, accumulation_steps=accumulation_steps),
        run=RunOptions(out_dir=out_dir, progress=False, log_every=5, eval_every=eval_every, **run_options),
    )


def parameters(trainer):
    return [p.detach().clone() for p in trainer.model.parameters()] + [
        m.clone() for m in (trainer.mp.masters.state() if trainer.mp.masters else [])
    ]


def assert_bit_identical(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y)


@pytest.mark.parametrize("accumulation_steps", [1, 2])
def test_resume_continues_bit_identically(tmp_path, accumulation_steps, device):
    # 30 updates straight, against 15 (mid-epoch), stop, resume, 15 more: the run crosses an epoch boundary.
    straight = make_trainer(tmp_path / "straight", accumulation_steps=accumulation_steps, device=device)
    straight.fit(steps=30)
    first = make_trainer(tmp_path / "split", accumulation_steps=accumulation_steps, device=device)
    first.fit(steps=15)
    resumed = make_trainer(tmp_path / "split", accumulation_steps=accumulation_steps, device=device)
    result = resumed.fit(steps=30, resume=True)
    assert result.steps == 30
    assert_bit_identical(parameters(straight), parameters(resumed))
    assert straight.optimizer.param_groups[0]["lr"] == resumed.optimizer.param_groups[0]["lr"]


def _train_losses(run_dir) -> dict[int, float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if r["kind"] == "train"}


def test_a_run_resumed_between_two_records_logs_the_same_train_losses(tmp_path):
    # the record after a resume averaged only the batches since it (minilm: final train loss 1.2268 against the
    # uninterrupted run's 1.4405, with the same weights) before 2026-11-28: the checkpoint carries the sum now
    make_trainer(tmp_path / "straight").fit(steps=20)
    make_trainer(tmp_path / "split", checkpoint_every=13).fit(steps=20)  # log_every=5: 3 updates into a span
    (tmp_path / "split" / "checkpoints" / "step-00000020.safetensors").unlink()  # as if it died after update 13
    result = make_trainer(tmp_path / "split").fit(steps=20, resume=True)
    assert _train_losses(tmp_path / "split") == _train_losses(tmp_path / "straight")
    assert result.train_loss == _train_losses(tmp_path / "straight")[20]


def test_ctrl_c_saves_a_checkpoint_and_resume_matches(tmp_path):
    calls = {"n": 0}

    def interrupting_loss(outputs, targets):
        calls["n"] += 1
        if calls["n"] == 20:
            raise KeyboardInterrupt
        return torch.nn.functional.cross_entropy(outputs, targets)

    straight = make_trainer(tmp_path / "straight")
    straight.fit(steps=25)
    with pytest.raises(TrainingInterrupted) as stop:
        make_trainer(tmp_path / "split", loss_fn=interrupting_loss).fit(steps=25)
    assert stop.value.step == 19 and stop.value.checkpoint.name == "step-00000019.safetensors"
    resumed = make_trainer(tmp_path / "split")
    resumed.fit(steps=25, resume=True)
    assert_bit_identical(parameters(straight), parameters(resumed))


def test_a_stop_in_a_window_at_an_epoch_start_finishes_the_window_first(tmp_path):
    # 23 batches an epoch, 2 per update: the epoch's last batch is left out, the next epoch starts update 12's
    # window. A stop asked for there used to save mid-window (the window's gradients lost), the resume differed
    calls = {"n": 0}

    def stopping_loss(outputs, targets):
        calls["n"] += 1
        if calls["n"] == 23:  # the next epoch's first batch, the window's first micro-batch
            os.kill(os.getpid(), signal.SIGTERM)
        return torch.nn.functional.cross_entropy(outputs, targets)

    straight = make_trainer(tmp_path / "straight", accumulation_steps=2)
    straight.fit(steps=16)
    with pytest.raises(TrainingInterrupted) as stop:
        make_trainer(tmp_path / "split", loss_fn=stopping_loss, accumulation_steps=2).fit(steps=16)
    assert stop.value.step == 12  # after the window, finished in the next epoch
    resumed = make_trainer(tmp_path / "split", accumulation_steps=2)
    resumed.fit(steps=16, resume=True)
    assert_bit_identical(parameters(straight), parameters(resumed))


@pytest.mark.parametrize("epochs", [1, 2])
def test_epochs_with_a_window_that_does_not_divide_them_run_whole_epochs(tmp_path, epochs):
    # 23 batches an epoch, 2 per update: a window carried into the next epoch, so --epochs 2 ran 22 updates over
    # 44 batches and reported 1 epoch (--epochs 1: 0 epochs); now each epoch's odd batch is left out
    trainer = make_trainer(tmp_path, accumulation_steps=2)
    result = trainer.fit(epochs=epochs)
    assert (result.steps, result.epochs) == (11 * epochs, epochs)
    assert trainer.batch_in_epoch == 0
    resumed = make_trainer(tmp_path, accumulation_steps=2).fit(epochs=epochs + 1, resume=True)
    assert (resumed.steps, resumed.epochs) == (11 * (epochs + 1), epochs + 1)


def test_an_epoch_shorter_than_a_window_carries_its_windows_on(tmp_path):
    # 3 batches an epoch, 4 per update: every batch was left out as an epoch's tail, and fit(steps=2) spun forever
    x, y = torch.randn(48, 8), torch.randint(0, 3, (48,))
    model = torch.nn.Linear(8, 3)
    trainer = Trainer(
        model,
        torch.optim.SGD(model.parameters(), lr=0.1),
        TrainData(DataLoader(TensorDataset(x, y), batch_size=16), None, torch.nn.functional.cross_entropy),
        "fp32",
        update=UpdateOptions(accumulation_steps=4),
        run=RunOptions(out_dir=tmp_path, progress=False, stop_signals=()),
    )
    result = trainer.fit(steps=2)
    assert (result.steps, result.epochs, trainer.batch_in_epoch) == (2, 2, 2)  # 8 batches: 2 epochs and 2 batches


def _sigterm() -> None:
    os.kill(os.getpid(), signal.SIGTERM)


def test_a_second_stop_while_an_update_is_applied_waits_for_it(tmp_path):
    # the first SIGTERM in update 8's forward, the second inside its optimizer step, after the weights moved:
    # stopping there saved update 8's weights at update 7's position, and the resumed run applied batch 8 twice
    straight = make_trainer(tmp_path / "straight")
    straight.fit(steps=12)
    calls = {"loss": 0}

    def stopping_loss(outputs, targets):
        calls["loss"] += 1
        if calls["loss"] == 8:
            _sigterm()
        return torch.nn.functional.cross_entropy(outputs, targets)

    split = make_trainer(tmp_path / "split", loss_fn=stopping_loss)
    split.optimizer.register_step_post_hook(lambda *_: _sigterm() if calls["loss"] == 8 else None)
    with pytest.raises(TrainingInterrupted) as stop:
        split.fit(steps=12)
    assert stop.value.step == 8 and stop.value.checkpoint.name == "step-00000008.safetensors"
    resumed = make_trainer(tmp_path / "split")
    resumed.fit(steps=12, resume=True)
    assert_bit_identical(parameters(straight), parameters(resumed))


@pytest.fixture
def python_sigint():
    """Python's own SIGINT handler (KeyboardInterrupt) while the test runs, as in a terminal: a test run that a
    shell started in the background (``cmd &``) inherits SIGINT ignored, and Python keeps it so."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_a_ctrl_c_that_is_not_a_stop_signal_inside_an_update_saves_nothing_from_it(tmp_path, python_sigint):
    # SIGINT left out of the stop signals keeps Python's KeyboardInterrupt: raised inside update 8's optimizer
    # step, it used to save update 8's weights as step 7 (the resumed run applied batch 8 twice)
    straight = make_trainer(tmp_path / "straight")
    straight.fit(steps=12)
    split = make_trainer(tmp_path / "split", stop_signals=("SIGTERM",), checkpoint_every=5)
    sent = []

    def ctrl_c_once(*_) -> None:
        if split.updates_done == 7 and not sent:
            sent.append(True)  # first: the KeyboardInterrupt comes out of os.kill
            os.kill(os.getpid(), signal.SIGINT)

    split.optimizer.register_step_post_hook(ctrl_c_once)
    with pytest.raises(TrainingInterrupted, match="in the middle of an update; the newest checkpoint stands") as stop:
        split.fit(steps=12)
    assert stop.value.checkpoint.name == "step-00000005.safetensors" and stop.value.cut_short
    assert [p.name for p in list_checkpoints(tmp_path / "split" / "checkpoints")] == ["step-00000005.safetensors"]
    with pytest.raises(ValueError, match=r"last update was cut short.* resume=True"):  # the same Trainer, as in a
        split.fit(steps=12)  # notebook: it went on from the half-updated weights
    split.fit(steps=12, resume=True)
    assert_bit_identical(parameters(straight), parameters(split))


@pytest.mark.parametrize("resumed", [False, True], ids=["fresh", "resumed"])
def test_a_stop_at_once_in_the_first_update_keeps_the_starting_state(tmp_path, resumed):
    # two SIGTERMs in the first update's loss, after the forward moved the batch-norm statistics: the buffers and
    # random state of the start were not remembered, so the checkpoint held that update's statistics (a resumed
    # run's good checkpoint was overwritten with them)
    straight = make_trainer(tmp_path / "straight")
    straight.fit(steps=8)
    if resumed:
        make_trainer(tmp_path / "split").fit(steps=3)

    def stopping_loss(outputs, targets):
        if not calls["sent"]:
            calls["sent"] = True
            _sigterm()
            _sigterm()  # at once: KeyboardInterrupt here, in the middle of the update
        return torch.nn.functional.cross_entropy(outputs, targets)

    calls = {"sent": False}
    with pytest.raises(TrainingInterrupted) as stop:
        make_trainer(tmp_path / "split", loss_fn=stopping_loss).fit(steps=8, resume=resumed)
    assert stop.value.step == (3 if resumed else 0)
    resumed_run = make_trainer(tmp_path / "split")
    resumed_run.fit(steps=8, resume=True)
    assert_bit_identical(parameters(straight), parameters(resumed_run))
    assert all(torch.equal(a, b) for a, b in zip(straight.model.buffers(), resumed_run.model.buffers(), strict=True))


def test_each_run_that_dies_before_its_first_checkpoint_keeps_its_metrics(tmp_path):
    def crashing_loss(outputs, targets):
        calls["n"] += 1
        if calls["n"] == 7:
            raise RuntimeError("out of memory, say")
        return torch.nn.functional.cross_entropy(outputs, targets)

    for _ in range(2):
        calls = {"n": 0}
        with pytest.raises(RuntimeError, match="out of memory"):
            make_trainer(tmp_path, loss_fn=crashing_loss).fit(steps=20)
    make_trainer(tmp_path).fit(steps=5)
    kept = sorted(p.name for p in tmp_path.glob("metrics-earlier*.jsonl"))
    assert kept == ["metrics-earlier-2.jsonl", "metrics-earlier.jsonl"]  # the first death's were overwritten
    assert sorted(p.name for p in (tmp_path / "tensorboard").iterdir() if p.is_dir()) in ([], ["earlier", "earlier-2"])


def test_a_second_stop_while_the_stop_checkpoint_is_written_lets_it_finish(tmp_path):
    # it used to arrive after fit had put SIGTERM's default back: the process died, and the checkpoint with it
    def stopping_loss(outputs, targets):
        if not calls["stopped"]:
            calls["stopped"] = True
            _sigterm()
        return torch.nn.functional.cross_entropy(outputs, targets)

    calls = {"stopped": False}
    trainer = make_trainer(tmp_path, loss_fn=stopping_loss)
    trainer.optimizer.register_state_dict_pre_hook(lambda optimizer: _sigterm())  # while the checkpoint is made
    with pytest.raises(TrainingInterrupted) as stop:
        trainer.fit(steps=5)
    assert stop.value.step == 1 and stop.value.checkpoint.name == "step-00000001.safetensors"
    assert [p.name for p in list_checkpoints(tmp_path / "checkpoints")] == ["step-00000001.safetensors"]


def test_a_stop_after_the_last_update_still_ends_the_run_whole(tmp_path):
    # a SIGTERM while update 4's periodic checkpoint is written, 4 of 4: the run used to end interrupted, with no
    # final evaluation (and the CLI's exit 143 asked to resume a finished run)
    trainer = make_trainer(tmp_path, checkpoint_every=4)
    sent = []
    trainer.optimizer.register_state_dict_pre_hook(lambda _: None if sent else (sent.append(True), _sigterm()))
    result = trainer.fit(steps=4)
    assert result.steps == 4 and result.eval["accuracy"] > 0


def test_a_stop_during_the_final_evaluation_still_ends_the_run_whole(tmp_path):
    def interrupted_accuracy(outputs, targets):
        if not calls["sent"]:
            calls["sent"] = True
            _sigterm()  # SIGTERM's default used to be back by then: the process died
        return accuracy.batch(outputs, targets)

    calls = {"sent": False}
    trainer = make_trainer(tmp_path)
    trainer.data = dataclasses.replace(trainer.data, metric=dataclasses.replace(accuracy, batch=interrupted_accuracy))
    result = trainer.fit(steps=4)
    assert calls["sent"] and result.steps == 4 and result.eval["accuracy"] > 0
    assert [p.name for p in list_checkpoints(tmp_path / "checkpoints")] == ["step-00000004.safetensors"]


def test_a_new_run_where_one_crashed_before_its_first_checkpoint_sets_its_metrics_aside(tmp_path, caplog):
    def crashing_loss(outputs, targets):
        calls["n"] += 1
        if calls["n"] == 8:
            raise RuntimeError("out of memory, say")
        return torch.nn.functional.cross_entropy(outputs, targets)

    calls = {"n": 0}
    with pytest.raises(RuntimeError, match="out of memory"):
        make_trainer(tmp_path, loss_fn=crashing_loss).fit(steps=20)
    assert not list_checkpoints(tmp_path / "checkpoints")
    with caplog.at_level(logging.WARNING, logger="mixprec"):
        make_trainer(tmp_path).fit(steps=10)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["kind"] == "train"] == [5, 10]  # the crashed run's step 5 came first
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics-earlier.jsonl").read_text().splitlines()] == [5]
    assert "1 metric records of an earlier run that saved no checkpoint" in caplog.text


def test_resuming_a_run_past_the_length_asked_for_is_refused(tmp_path):
    make_trainer(tmp_path).fit(steps=6)
    with pytest.raises(ValueError, match=r"at update 6, past the 4 steps asked for.* more than 6 updates"):
        make_trainer(tmp_path).fit(steps=4, resume=True)
    assert make_trainer(tmp_path).fit(steps=8, resume=True).steps == 8


def test_a_second_fit_in_memory_keeps_the_first_ones_records():
    trainer = make_trainer(None)
    trainer.fit(steps=10)
    trainer.fit(steps=20)  # no run folder: nothing to set aside, the history goes on
    assert [r["step"] for r in trainer.log.records if r["kind"] == "train"] == [5, 10, 15, 20]


def test_a_resumed_runs_time_goes_on_from_its_records(tmp_path):
    make_trainer(tmp_path).fit(steps=10)
    make_trainer(tmp_path).fit(steps=20, resume=True)
    times = [json.loads(line)["time"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()
             if json.loads(line)["kind"] == "train"]  # fmt: skip
    assert len(times) == 4 and times == sorted(times)  # it used to start again from 0 at step 15


def test_metrics_file_and_final_checkpoint(tmp_path):
    trainer = make_trainer(tmp_path, policy="mixed_bf16", eval_every=10)
    result = trainer.fit(epochs=1)
    assert result.steps == 23 and result.epochs == 1
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval"]
    assert [r["step"] for r in train] == [5, 10, 15, 20, 23]
    assert [r["step"] for r in evals] == [10, 20, 23]
    assert set(train[0]) == {
        "kind",
        "step",
        "epoch",
        "loss",
        "samples_per_s",
        "ms_per_step",
        "time",
        "scale",
        "skipped_steps",
        "skipped_at",
        "lr",
    }
    assert evals[-1]["accuracy"] == result.eval["accuracy"] > 0.15  # chance is 0.10 after 23 small steps
    assert [p.name for p in list_checkpoints(tmp_path / "checkpoints")] == ["step-00000023.safetensors"]


def test_skipped_steps_are_recorded(tmp_path):
    trainer = make_trainer(tmp_path, policy="mixed_bf16")
    weight = trainer.model.classifier.weight
    calls = {"n": 0}

    def poison(grad):
        calls["n"] += 1
        return grad * float("nan") if calls["n"] in (3, 7) else grad

    weight.register_hook(poison)
    trainer.fit(steps=10)
    train = [r for r in trainer.log.records if r["kind"] == "train"]
    assert train[0]["skipped_at"] == [3] and train[1]["skipped_at"] == [7]
    assert train[-1]["skipped_steps"] == 2


def nan_batches():
    x = torch.randn(4, 1, 8, 8)
    bad = x.clone()
    bad[0, 0, 0, 0] = float("nan")
    y = torch.zeros(4, dtype=torch.int64)
    return [(x, y), (bad, y), (x, y)]


def test_nan_inputs_stop_with_a_clear_message_or_are_skipped(tmp_path):
    model = DigitsCNN(width=4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = TrainData(nan_batches(), None, torch.nn.functional.cross_entropy)
    trainer = Trainer(model, optimizer, data, "fp32", run=RunOptions(progress=False))
    with pytest.raises(ValueError, match=r"batch 2 of epoch 0 has NaN or inf in its inputs.*on_bad_batch='skip'"):
        trainer.fit(epochs=1)
    skipping = Trainer(
        model, optimizer, data, "fp32", run=RunOptions(progress=False), checks=BatchChecks(on_bad_batch="skip")
    )
    assert skipping.fit(steps=2).steps == 2 and skipping.skipped_batches == 1


def test_refuses_to_start_over_an_existing_run(tmp_path):
    make_trainer(tmp_path / "run").fit(steps=2)
    with pytest.raises(ValueError, match="already holds a run with checkpoints; resume it"):
        make_trainer(tmp_path / "run").fit(steps=2)
    with pytest.raises(ValueError, match="no checkpoint in"):
        make_trainer(tmp_path / "empty").fit(steps=2, resume=True)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({}, "exactly one of epochs= or steps="),
        ({"epochs": 1, "steps": 2}, "exactly one"),
        ({"steps": 0}, r"steps=...\) must be an integer >= 1"),
        ({"epochs": 1.5}, "epochs=..."),
    ],
)
def test_fit_arguments(tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        make_trainer(tmp_path).fit(**kwargs)


def test_trainer_is_exported_and_rejects_bad_options():
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = mixprec.app.TrainData([], None, torch.nn.functional.mse_loss)
    with pytest.raises(ValueError, match=r"BatchChecks\(on_bad_batch=...\): received 'ignore'"):
        mixprec.app.Trainer(model, optimizer, data, "fp32", checks=mixprec.app.BatchChecks(on_bad_batch="ignore"))
    with pytest.raises(TypeError, match=r"Trainer\(data=...\) needs a mixprec.app.TrainData; received \[\]"):
        mixprec.app.Trainer(model, optimizer, [], "fp32")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"Trainer\(run=...\) needs a mixprec.app.RunOptions; received \{\}"):
        mixprec.app.Trainer(model, optimizer, data, "fp32", run={})  # type: ignore[arg-type]


_LOSS = torch.nn.functional.mse_loss


@pytest.mark.parametrize(
    ("build", "error", "phrases"),
    [
        (lambda: TrainData(None, None, _LOSS), TypeError, ["TrainData(train_data=...)", "None (of type NoneType)"]),
        (lambda: TrainData([], 3, _LOSS), TypeError, ["TrainData(eval_data=...)", "3 (of type int)"]),
        (lambda: TrainData([], None, "mse"), TypeError, ["TrainData(loss_fn=...)", "'mse' (of type str)"]),
        (lambda: TrainData([], None, _LOSS, "accuracy"), TypeError, ["TrainData(metric=...)", "'accuracy'"]),
        (lambda: UpdateOptions(scaler=1024.0), TypeError, ["UpdateOptions(scaler=...)", "1024.0 (of type float)"]),
        (lambda: UpdateOptions(max_grad_norm=0), ValueError, ["UpdateOptions(max_grad_norm=...)", "0 (of type int)"]),
        (lambda: UpdateOptions(max_grad_norm=-1.0), ValueError, ["max_grad_norm", "-1.0", "Pass None to not clip"]),
        (lambda: UpdateOptions(accumulation_steps=0), ValueError, ["UpdateOptions(accumulation_steps=...)", "0"]),
        (lambda: UpdateOptions(reduce_in_fp32="yes"), TypeError, ["UpdateOptions(reduce_in_fp32=...)", "'yes'"]),
        (lambda: RunOptions(out_dir=3), TypeError, ["RunOptions(out_dir=...)", "3 (of type int)"]),
        (lambda: RunOptions(seed=1.5), TypeError, ["RunOptions(seed=...)", "1.5 (of type float)"]),
        (lambda: RunOptions(seed=2**64), ValueError, ["RunOptions(seed=...)", "0 to 2**32 - 1", str(2**64)]),
        (lambda: RunOptions(seed=-1), ValueError, ["RunOptions(seed=...)", "received -1"]),
        (lambda: RunOptions(eval_every=0), ValueError, ["RunOptions(eval_every=...)", "0", "Pass None to evaluate"]),
        (lambda: RunOptions(log_every=0), ValueError, ["RunOptions(log_every=...)", "0 (of type int)"]),
        (lambda: RunOptions(checkpoint_every=2.5), ValueError, ["RunOptions(checkpoint_every=...)", "2.5"]),
        (lambda: RunOptions(keep_checkpoints=True), ValueError, ["RunOptions(keep_checkpoints=...)", "True"]),
        (lambda: RunOptions(progress=None), TypeError, ["RunOptions(progress=...)", "None (of type NoneType)"]),
        (
            lambda: RunOptions(checkpoint_every_minutes=float("inf")),
            ValueError,
            ["RunOptions(checkpoint_every_minutes=...)", "inf", "Pass None"],
        ),
        (lambda: RunOptions(stop_signals=("SIGKILL",)), ValueError, ["RunOptions(stop_signals=...)", "'SIGKILL'"]),
        (lambda: RunOptions(stop_signals="SIGTERM"), TypeError, ["RunOptions(stop_signals=...)", "'SIGTERM'"]),
        (lambda: BatchChecks(check_inputs=1), TypeError, ["BatchChecks(check_inputs=...)", "1 (of type int)"]),
        (
            lambda: BatchChecks(on_bad_batch="ignore"),
            ValueError,
            ["BatchChecks(on_bad_batch=...)", "'ignore'", "'skip'"],
        ),
        (lambda: BatchChecks(trace_nonfinite="no"), TypeError, ["BatchChecks(trace_nonfinite=...)", "'no'"]),
    ],
)
def test_each_option_refuses_a_bad_value_naming_the_field_and_the_value(build, error, phrases):
    with pytest.raises(error) as raised:
        build()
    for phrase in phrases:
        assert phrase in str(raised.value)


def test_options_are_frozen_values_with_the_old_defaults():
    assert dataclasses.asdict(RunOptions()) == {
        "out_dir": None,
        "seed": 0,
        "eval_every": None,
        "log_every": 10,
        "checkpoint_every": None,
        "keep_checkpoints": 3,
        "checkpoint_every_minutes": None,
        "stop_signals": ("SIGINT", "SIGTERM", "SIGUSR1"),
        "allow_foreign_checkpoint": False,
        "progress": True,
        "compile": False,
    }
    assert dataclasses.asdict(UpdateOptions()) == {
        "scaler": None,
        "max_grad_norm": None,
        "accumulation_steps": 1,
        "reduce_in_fp32": False,
        "frozen": (),
        "frozen_updates": 0,
    }
    assert dataclasses.asdict(BatchChecks()) == {"check_inputs": True, "on_bad_batch": "stop", "trace_nonfinite": False}
    with pytest.raises(dataclasses.FrozenInstanceError):
        RunOptions().log_every = 5  # type: ignore[misc]


class _Overflowing(torch.nn.Module):
    """Finite inputs, non-finite output: a batch whose largest input exceeds 100 makes this module NaN."""

    def forward(self, x):
        return torch.where(x.abs().amax() > 100, torch.full_like(x, float("nan")), x)


def _poisoned_run(on_bad_batch, poison=True, policy="mixed_bf16"):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), _Overflowing(), torch.nn.Linear(8, 2))
    generator = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(5):
        batches.append((torch.randn(8, 4, generator=generator), torch.randint(0, 2, (8,), generator=generator)))
    if poison:
        batches[2][0][0, 0] = 1000.0  # finite input; the first Linear keeps it large, the next module NaNs
    else:
        del batches[2]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = TrainData(batches, None, torch.nn.functional.cross_entropy)
    checks = BatchChecks(on_bad_batch=on_bad_batch)
    return Trainer(model, optimizer, data, policy, run=RunOptions(progress=False), checks=checks)


def test_a_nan_made_by_the_forward_pass_stops_naming_the_module_or_drops_the_batch():
    stopping = _poisoned_run("stop")
    with pytest.raises(ValueError, match=r"batch 3 of epoch 0: the forward pass produced nan first in module '1'"):
        stopping.fit(epochs=1)
    assert stopping.updates_done == 2  # the two good batches before it, nothing after
    with pytest.raises(ValueError, match=r"first in module '1'.* Under fp16 .* `mixprec doctor` names the modules"):
        _poisoned_run("stop", policy="mixed_fp16").fit(epochs=1)
    skipping = _poisoned_run("skip")
    result = skipping.fit(steps=4)
    assert skipping.skipped_batches == 1 and result.steps == 4 and result.stats.skipped_steps == 0
    # dropping the batch is training without it: the same weights as a run whose data never had it
    clean = _poisoned_run("stop", poison=False)
    clean.fit(steps=4)
    assert_bit_identical(parameters(skipping), parameters(clean))


def test_checkpoints_by_wall_clock_as_well_as_by_updates(tmp_path, monkeypatch):
    clock = {"now": 0.0}
    monkeypatch.setattr("mixprec.app.lifecycle.time.monotonic", lambda: clock["now"])

    def slow_loss(outputs, targets):  # each micro-batch "takes" 20 seconds of wall clock
        clock["now"] += 20.0
        return torch.nn.functional.cross_entropy(outputs, targets)

    make_trainer(tmp_path, "fp32", slow_loss, checkpoint_every_minutes=1.0, keep_checkpoints=100).fit(steps=7)
    names = [p.name for p in list_checkpoints(tmp_path / "checkpoints")]
    assert names == [f"step-{step:08d}.safetensors" for step in (3, 6, 7)]  # every 60 s, and at the end


def test_a_checkpoint_of_another_run_is_refused_unless_allowed(tmp_path):
    make_trainer(tmp_path / "mine").fit(steps=3)
    make_trainer(tmp_path / "other", seed=1).fit(steps=4)
    (tmp_path / "other" / "checkpoints" / "step-00000004.safetensors").rename(
        tmp_path / "mine" / "checkpoints" / "step-00000004.safetensors"
    )  # a valid checkpoint, newer than this run's own: of a run with another seed
    with pytest.raises(mixprec.app.ForeignCheckpointError, match=r"belongs to another run \(seed 1 there, 0 here\)"):
        make_trainer(tmp_path / "mine").fit(steps=6, resume=True)
    allowed = make_trainer(tmp_path / "mine", allow_foreign_checkpoint=True)
    assert allowed.fit(steps=6, resume=True).steps == 6


def test_a_run_resumes_under_another_fp8_cast_or_shapes_but_not_another_scaling(tmp_path):
    # how the FP8 layers run (one compiled cast or eager passes; FP8 only where faster) changes no saved state
    make_trainer(tmp_path, "base=fp8,fp8=(scaling=delayed)").fit(steps=3)
    resumed = make_trainer(tmp_path, "base=fp8,fp8=(scaling=delayed,cast=compiled,shapes=all)")
    assert resumed.fit(steps=5, resume=True).steps == 5
    with pytest.raises(mixprec.app.ForeignCheckpointError, match=r"belongs to another run \(policy .*scaling=delayed"):
        make_trainer(tmp_path, "fp8").fit(steps=6, resume=True)


def test_a_run_resumes_with_another_adamw_kernel_but_not_with_another_learning_rate(tmp_path):
    make_trainer(tmp_path, adamw={"foreach": False}).fit(steps=3)  # torch's per-tensor loop, as runs did before
    resumed = make_trainer(tmp_path, adamw={"fused": True})
    assert resumed.fit(steps=5, resume=True).steps == 5
    assert resumed.optimizer.param_groups[0]["fused"] is True  # this run's kernel, not the checkpoint's loop
    with pytest.raises(mixprec.app.ForeignCheckpointError, match=r"\(optimizer lr 0.003 there, 0.001 here\)"):
        make_trainer(tmp_path, adamw={"fused": True, "lr": 1e-3}).fit(steps=7, resume=True)


def test_the_runs_adamw_is_fused_where_torch_has_the_kernel_and_compensated_under_pure_bf16():
    from mixprec.app.optimizer import adamw_for

    params = [torch.nn.Parameter(torch.ones(3))]
    assert adamw_for(mixprec.get_policy("mixed_bf16"), params, "cpu", lr=1e-3).defaults["fused"] is True
    assert adamw_for(mixprec.get_policy("fp32"), params, "meta", lr=1e-3).defaults["fused"] is False
    assert isinstance(adamw_for(mixprec.get_policy("pure_bf16"), params, "cpu", lr=1e-3), mixprec.AdamW)


def test_a_misnamed_or_edited_newest_checkpoint_is_skipped_with_one_line(tmp_path, caplog):
    make_trainer(tmp_path, checkpoint_every=1).fit(steps=3)
    folder = tmp_path / "checkpoints"
    (folder / "step-00000003.safetensors").rename(folder / "step-00000009.safetensors")
    trainer = make_trainer(tmp_path)
    with caplog.at_level(logging.WARNING, logger="mixprec"):
        trainer.fit(steps=4, resume=True)
    skipped = [r.message for r in caplog.records if r.message.startswith("Skipped a checkpoint")]
    assert len(skipped) == 1 and "holds step '3', not the step its name says; using step-00000002" in skipped[0]
    assert trainer.updates_done == 4


def test_a_damaged_newest_checkpoint_is_set_aside_so_pruning_keeps_the_ones_that_load(tmp_path, caplog):
    # left in place, the damaged step-4 counted as the newest: the run resumed from 2 and with keep=1 the save at
    # step 3 deleted the step-3 file it had just written and the step-2 one, leaving only the damaged file
    run = tmp_path / "run"
    make_trainer(run, checkpoint_every=2).fit(steps=4)
    folder = run / "checkpoints"
    damaged = folder / "step-00000004.safetensors"
    data = bytearray(damaged.read_bytes())
    data[-10] ^= 0xFF
    damaged.write_bytes(bytes(data))
    trainer = make_trainer(run, checkpoint_every=1, keep_checkpoints=1)
    with caplog.at_level(logging.WARNING, logger="mixprec"):
        trainer.fit(steps=3, resume=True)
    assert "checksum mismatch" in caplog.text and "set aside as step-00000004.safetensors.skipped" in caplog.text
    assert [p.name for p in list_checkpoints(folder)] == ["step-00000003.safetensors"]
    assert (folder / "step-00000004.safetensors.skipped").read_bytes() == bytes(data)  # kept for a look
    again = make_trainer(run, checkpoint_every=1)
    again.fit(steps=4, resume=True)  # resumes from the checkpoint the first resume wrote
    straight = make_trainer(tmp_path / "straight")
    straight.fit(steps=4)
    assert_bit_identical(parameters(straight), parameters(again))


def test_a_save_never_deletes_itself_for_a_checkpoint_named_past_it(tmp_path):
    save_checkpoint(tmp_path, 9, {"x": torch.tensor(9)})  # not this run's line: say, copied in by hand
    for step in (1, 2, 3):
        save_checkpoint(tmp_path, step, {"x": torch.tensor(step)}, keep=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == [f"step-0000000{n}.safetensors" for n in (2, 3, 9)]


def test_a_checkpoint_that_does_not_fit_is_skipped_and_leaves_the_trainer_as_it_was(tmp_path, caplog):
    reference = make_trainer(tmp_path / "reference", checkpoint_every=1)
    reference.fit(steps=2)
    trainer = make_trainer(tmp_path / "reference")
    state = trainer.state_dict()  # a valid file of this run whose optimizer state cannot be loaded
    state["optimizer"]["param_groups"] = []
    save_checkpoint(tmp_path / "reference" / "checkpoints", 3, state)
    with caplog.at_level(logging.WARNING, logger="mixprec"):
        trainer.fit(steps=3, resume=True)
    assert "does not fit this model and optimizer" in caplog.text and "using step-00000002" in caplog.text
    straight = make_trainer(tmp_path / "straight")
    straight.fit(steps=3)
    assert_bit_identical(parameters(straight), parameters(trainer))  # resumed at 2 as if 3 never existed


@pytest.mark.parametrize("ranks", [1, 2])
def test_under_torchrun_a_stop_signal_counts_from_the_ranks_next_agreement(tmp_path, ranks):
    # Under torchrun each rank gets its signal at its own moment. One that arrived on this rank while it logged or
    # evaluated must not end its loop at once: the other ranks, which have not seen it yet, would wait for ever in
    # the next update's all-reduce. It counts from the agreement after the next update, on every rank together.
    from mixprec.app.lifecycle import RunLifecycle
    from mixprec.app.progress import ProgressBar
    from mixprec.distributed import World

    trainer = make_trainer(tmp_path / "run")
    lifecycle = RunLifecycle(trainer, trainer.run_options, trainer.mp, World(rank=0, size=ranks))
    with lifecycle.running(10, ProgressBar(10, "training", False)):
        assert not lifecycle.stop_requested
        _sigterm()  # after this update's agreement, on this rank only
        assert lifecycle.stop_requested == (ranks == 1)  # in one process: at once
        lifecycle.after_update()  # the next update's agreement (max over the ranks' signals)
        assert lifecycle.stop_requested


def test_a_run_extended_on_resume_takes_the_new_plans_rate_from_its_first_update(tmp_path):
    # the optimizer's saved rate (the old plan's last) drove the first update after a resume whose schedule was
    # re-planned for a longer run
    first = make_trainer(tmp_path, policy="fp32", checkpoint_every=4)
    first.scheduler = torch.optim.lr_scheduler.LambdaLR(first.optimizer, lambda step: 1.0 - step / 4)  # 4 updates
    first.fit(steps=4)
    extended = make_trainer(tmp_path, policy="fp32", checkpoint_every=4)
    extended.scheduler = torch.optim.lr_scheduler.LambdaLR(extended.optimizer, lambda step: 1.0 - step / 8)
    taken = []
    extended.optimizer.register_step_pre_hook(
        lambda optimizer, args, kwargs: taken.append(optimizer.param_groups[0]["lr"])
    )
    extended.fit(steps=6, resume=True)
    assert taken == [3e-3 * (1.0 - 4 / 8), 3e-3 * (1.0 - 5 / 8)]  # the old plan gave 0.0 at its end


def test_every_skipped_step_between_two_records_is_listed():
    # skipped_at read the engine's last 32 overflow steps: with 44 skips before one record, 12 were missing (and
    # the scale plot's skip marks with them)
    torch.manual_seed(0)
    x, y = torch.randn(256, 8), torch.randint(0, 2, (256,))
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    trainer = Trainer(
        model, torch.optim.SGD(model.parameters(), lr=0.1),
        TrainData([(x[i : i + 8], y[i : i + 8]) for i in range(0, 256, 8)], None, torch.nn.functional.cross_entropy),
        "mixed_fp16",
        update=UpdateOptions(scaler=mixprec.DynamicLossScaler(init_scale=2.0**60, max_scale=2.0**60)),
        run=RunOptions(log_every=100, progress=False),
    )  # fmt: skip
    result = trainer.fit(steps=60)
    listed = [step for record in result.history if record["kind"] == "train" for step in record["skipped_at"]]
    assert result.stats.skipped_steps > 32 and len(listed) == result.stats.skipped_steps


class _SlowEvaluation:
    """Evaluation data that takes 0.3 s to start each pass."""

    def __init__(self, batches) -> None:
        self.batches = batches

    def __iter__(self):
        import time

        time.sleep(0.3)
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


def test_evaluations_are_not_counted_in_the_steps_time():
    # an evaluation after each step landed in the next record's ms/step and samples/s (502 ms against 24)
    torch.manual_seed(0)
    x, y = torch.randn(64, 8), torch.randint(0, 2, (64,))
    train = [(x[i : i + 8], y[i : i + 8]) for i in range(0, 64, 8)]
    model = torch.nn.Linear(8, 2)
    trainer = Trainer(
        model, torch.optim.SGD(model.parameters(), lr=0.1),
        TrainData(train, _SlowEvaluation(train[:1]), torch.nn.functional.cross_entropy), "fp32",
        run=RunOptions(log_every=2, eval_every=1, progress=False),
    )  # fmt: skip
    result = trainer.fit(steps=6)
    records = [record for record in result.history if record["kind"] == "train"]
    assert all(record["ms_per_step"] < 150 for record in records), records  # a step of a Linear(8, 2): well below
    assert records[-1]["time"] > 5 * 0.3 * 0.9  # the run's own clock counts them (5 evaluations before it)


def test_a_resumed_fits_speed_is_its_own(tmp_path):
    # the summary's speed was the median over every record of the run, the first fit's (on slow data) included
    torch.manual_seed(0)
    x, y = torch.randn(160, 8), torch.randint(0, 2, (160,))
    batches = [(x[i : i + 8], y[i : i + 8]) for i in range(0, 160, 8)]

    def trainer(data) -> Trainer:
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        data = TrainData(data, None, torch.nn.functional.cross_entropy)
        return Trainer(model, optimizer, data, "fp32", run=RunOptions(out_dir=tmp_path, log_every=5, progress=False))

    slow = trainer(_SlowEvaluation(batches))  # 0.3 s to start each pass over the data: slow first records
    slow.fit(steps=20)
    resumed = trainer(batches).fit(steps=25, resume=True)
    own = [r["ms_per_step"] for r in resumed.history if r["kind"] == "train" and r["step"] > 20]
    assert resumed.ms_per_step == own[0] and resumed.timed_steps == 5
