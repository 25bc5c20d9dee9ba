"""mixprec train / compare / export, run as a user would, on tiny settings: in this process (main()), or as a
new process where signals, concurrent runs or a fresh import are the subject."""

import json
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from mixprec.app.checkpoint import list_checkpoints, load_checkpoint

MIXPREC = str(Path(sys.executable).with_name("mixprec"))
REPO = Path(__file__).resolve().parents[2]


def run_process(*args, cwd=REPO, timeout=300):
    """The installed script, for what only a new process shows."""
    return subprocess.run(
        [MIXPREC, *map(str, args)], capture_output=True, text=True, timeout=timeout, cwd=cwd, check=False
    )


@pytest.fixture
def run(mixprec_cli):
    """The command's main() in this process, from the repository root."""
    return mixprec_cli


def summary(stdout):
    return {line[:18].strip(): line[18:].strip() for line in stdout.splitlines() if line[:18].strip()}


def test_runs_started_in_the_same_second_get_folders_of_their_own(tmp_path, run, monkeypatch):
    monkeypatch.setattr(time, "strftime", lambda *_: "20261126-120000")  # both in one second
    for _ in range(2):
        assert run("train", "digits", "--size", "tiny", "--steps", "2", "--quiet", cwd=tmp_path).returncode == 0
    folders = sorted(p.name for p in (tmp_path / "runs").iterdir())
    assert folders == ["digits-auto-20261126-120000", "digits-auto-20261126-120000-2"]
    assert all(list_checkpoints(tmp_path / "runs" / name / "checkpoints") for name in folders)
    bad_policy = "base=mixed_bf16,fp32_modules=Nope"  # refused once the model is built, in the claimed folder
    assert run("train", "digits", "--size", "tiny", "--policy", bad_policy, cwd=tmp_path).returncode != 0
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == folders  # a run that never started leaves none


def test_a_relaunch_with_the_same_torchrun_id_leaves_the_earlier_run_as_it_was(tmp_path, run, monkeypatch):
    # torchrun names the default folder by its run id ("none" without a rendezvous id): a second launch is
    # refused there, and its cleanup used to delete the first run's folder, checkpoints and all
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    assert run("train", "digits", "--size", "tiny", "--steps", "2", "--quiet", cwd=tmp_path).returncode == 0
    again = run("train", "digits", "--size", "tiny", "--steps", "2", "--quiet", cwd=tmp_path)
    assert again.returncode == 2 and "already holds a run with checkpoints" in again.stderr
    assert list_checkpoints(tmp_path / "runs" / "digits-auto-none" / "checkpoints")


def test_resume_to_fewer_steps_than_the_run_has_is_refused_before_anything_is_written(tmp_path, run):
    # --steps is the run's total: "--resume --steps 10" on a run at 20 trained nothing and rewrote config.json
    assert run("train", "digits", "--size", "tiny", "--steps", "20", "--quiet", "--out", tmp_path).returncode == 0
    config = (tmp_path / "config.json").read_text()
    refused = run("train", "--out", tmp_path, "--resume", "--steps", "10")
    assert refused.returncode == 2 and "the run is at update 20, past the 10 steps asked for" in refused.stderr
    assert "ask for more than 20 updates" in refused.stderr and len(refused.stderr.strip().splitlines()) == 1
    assert (tmp_path / "config.json").read_text() == config


def test_a_damaged_newest_checkpoint_past_the_length_does_not_refuse_the_resume(tmp_path, run, caplog):
    # the length check read the step from the newest checkpoint's name: a damaged step-20, which the resume
    # skips for step-15, refused --steps 19
    args = ("--size", "tiny", "--checkpoint-every", "5", "--keep", "2", "--quiet", "--out", tmp_path)
    assert run("train", "digits", "--steps", "20", *args).returncode == 0
    damaged = tmp_path / "checkpoints" / "step-00000020.safetensors"
    data = bytearray(damaged.read_bytes())
    data[-100] ^= 0xFF
    damaged.write_bytes(bytes(data))
    with caplog.at_level("WARNING", logger="mixprec"):
        resumed = run("train", "--out", tmp_path, "--resume", "--steps", "19", "--quiet")
    assert resumed.returncode == 0, resumed.stderr
    assert "using step-00000015.safetensors" in caplog.text
    assert list_checkpoints(tmp_path / "checkpoints")[-1].name == "step-00000019.safetensors"
    refused = run("train", "--out", tmp_path, "--resume", "--steps", "18")  # past a checkpoint that loads: refused
    assert refused.returncode == 2 and "the run is at update 19, past the 18 steps" in refused.stderr


def test_resume_of_a_run_that_died_before_its_first_checkpoint_starts_it_over(tmp_path, run, caplog):
    # docs/training.md's requeue recipe resumes whenever config.json exists: a run killed before its first
    # checkpoint left one, and every requeued job failed with "nothing to resume"
    assert run("train", "digits", "--size", "tiny", "--steps", "3", "--quiet", "--out", tmp_path).returncode == 0
    shutil.rmtree(tmp_path / "checkpoints")  # as a SIGKILL before the first checkpoint leaves the folder:
    for written_at_the_end in ("report.md", "loss.png", "metric.png", "scale.png"):  # no report either
        (tmp_path / written_at_the_end).unlink()
    with caplog.at_level("WARNING", logger="mixprec"):
        assert run("train", "--out", tmp_path, "--resume", "--quiet").returncode == 0
    assert "holds no checkpoint (its run ended before the first)" in caplog.text
    assert [p.name for p in list_checkpoints(tmp_path / "checkpoints")] == ["step-00000003.safetensors"]


def test_train_writes_a_complete_run(tmp_path, run):
    result = run("train", "digits", "--size", "tiny", "--policy", "mixed_bf16", "--out", tmp_path / "run")
    assert result.returncode == 0, result.stderr
    progress = [line for line in result.stdout.splitlines() if line.startswith("training ")]
    assert progress and progress[-1].startswith("training 46/46 (100%)")  # without a terminal: plain lines
    lines = summary(result.stdout)
    assert lines["trained"].startswith("46 steps, 2 epochs")
    assert float(lines["eval accuracy"]) > 0.9
    assert lines["model state"].startswith("16.0 bytes/param")
    run_dir = tmp_path / "run"
    for name in ("config.json", "metrics.jsonl", "report.md", "loss.png", "metric.png", "scale.png"):
        assert (run_dir / name).is_file(), name
    assert [p.name for p in list_checkpoints(run_dir / "checkpoints")] == ["step-00000046.safetensors"]


def assert_same_weights(a, b):
    for key in a["model"]:
        assert torch.equal(a["model"][key], b["model"][key]), key
    for x, y in zip(a["mixed_precision"]["masters"], b["mixed_precision"]["masters"], strict=True):
        assert torch.equal(x, y)


def test_resume_from_the_cli_is_bit_identical(tmp_path, run):
    # A 20-step run keeps its step-10 checkpoint; a copy of the run stopped there resumes to step 20.
    args = ("train", "digits", "--size", "tiny", "--policy", "o2_bf16", "--steps", "20", "--checkpoint-every", "10")
    assert run(*args, "--out", tmp_path / "straight", "--quiet").returncode == 0
    stopped = tmp_path / "stopped"
    (stopped / "checkpoints").mkdir(parents=True)
    shutil.copy(tmp_path / "straight" / "config.json", stopped)
    shutil.copy(tmp_path / "straight" / "checkpoints" / "step-00000010.safetensors", stopped / "checkpoints")
    resumed = run("train", "--out", stopped, "--resume", "--quiet")
    assert resumed.returncode == 0, resumed.stderr
    assert summary(resumed.stdout)["trained"].startswith("20 steps")
    assert summary(resumed.stdout)["resumed"].startswith("from step 10; --steps/--epochs count the whole run")
    final = "checkpoints/step-00000020.safetensors"
    assert_same_weights(load_checkpoint(tmp_path / "straight" / final), load_checkpoint(stopped / final))


def test_compare_prints_one_table_and_a_report(tmp_path, run):
    result = run(
        "compare", "digits", "--size", "tiny", "--steps", "12", "--policies", "fp32,mixed_bf16,pure_bf16", "--out",
        tmp_path, "--quiet",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    rows = {line.split()[0]: line.split() for line in result.stdout.splitlines() if line.split()}
    assert {"fp32", "mixed_bf16", "pure_bf16"} <= rows.keys()
    assert rows["fp32"][1] == "fp32" and rows["mixed_bf16"][1] in ("native", "hybrid", "emulated")  # compute plan
    assert rows["fp32"][3] == "1.00x"  # speed relative to itself
    assert rows["pure_bf16"][7] == "12.0"  # bytes/param of model state
    assert float(rows["mixed_bf16"][5].rstrip("x")) < 1.0  # fewer activation bytes than FP32
    assert rows["fp32"][2].endswith("*") and "timed over fewer than 30 steps (fp32 12," in result.stdout  # says so
    plans = result.stdout[result.stdout.index("compute plans") :]
    assert "  mixed_bf16: " in plans and "bf16 kernels [" in plans  # each plan with its kernels and figures
    for name in ("report.md", "compare_loss.png", "compare_scale.png"):
        assert (tmp_path / name).is_file()
    assert "| mixed_bf16 |" in (tmp_path / "report.md").read_text()


def test_compare_refuses_a_policy_the_model_cannot_take_before_anything_trains(tmp_path, mixprec_cli):
    # found after fp32 had trained, whose folder then refused the corrected command
    out = tmp_path / "cmp"
    policies = "fp32;base=mixed_bf16,names=nonexistent"
    result = mixprec_cli("compare", "digits", "--size", "tiny", "--steps", "2", "--policies", policies, "--out", out)
    assert result.returncode == 2 and "--policies 'base=mixed_bf16,names=nonexistent'" in result.stderr
    assert "matches no module" in result.stderr and not out.exists()


def test_compare_takes_fp32_by_any_of_its_names_as_the_reference(tmp_path, run):
    # the reference was found by the literal name "fp32": with float32 every ratio was against the first run
    result = run("compare", "digits", "--size", "tiny", "--steps", "2", "--policies", "mixed_bf16,float32",
                 "--out", tmp_path, "--quiet")  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "speed vs float32" in result.stdout
    rows = {line.split()[0]: line.split() for line in result.stdout.splitlines() if line.split()}
    assert rows["float32"][3] == "1.00x" and rows["float32"][5] == "1.00x"  # speed and activations vs itself
    report = (tmp_path / "report.md").read_text()
    assert "mixed_bf16,float32" in report  # the configuration names the policies compared, not the first alone


def test_export_halves_the_file_and_reports_accuracy(tmp_path, run):
    assert run("train", "digits", "--size", "tiny", "--policy", "o2_bf16", "--out", tmp_path, "--quiet").returncode == 0
    result = run("export", tmp_path, "--dtype", "bf16", "--repeats", "2")
    assert result.returncode == 0, result.stderr
    fp32 = (tmp_path / "export" / "model-fp32.safetensors").stat().st_size
    half = (tmp_path / "export" / "model-bf16.safetensors").stat().st_size
    assert 0.45 < half / fp32 < 0.55
    rows = {line.split()[0]: line.split() for line in result.stdout.splitlines() if line.split()}
    assert abs(float(rows["bf16"][4]) - float(rows["fp32"][4])) < 0.02  # accuracy barely moves
    assert "accuracy change" in result.stdout


HELD_OUT = """
import torch
from torch import nn
from mixprec.app import TaskParts, accuracy

def build(config):
    torch.manual_seed(0)
    x = torch.randn(64, 8)
    batches = [(x[i:i + 16], torch.zeros(16, dtype=torch.long)) for i in range(0, 64, 16)]
    return TaskParts(model=nn.Linear(8, 2), train_data=batches, eval_data=[(x[:32], torch.zeros(32, dtype=torch.long))],
                     test_data=[(x[32:], torch.ones(32, dtype=torch.long))],  # the other label: another loss
                     loss_fn=nn.functional.cross_entropy, metric=accuracy, defaults={"lr": 1e-2})
"""


def test_export_evaluates_on_the_test_data_where_the_task_has_it(tmp_path, run):
    # it evaluated on the validation data that guided the run, while serve-bench (and the help) said test
    from safetensors.torch import load_file

    (tmp_path / "held_out.py").write_text(HELD_OUT)
    out = tmp_path / "run"
    trained = run("train", "--model", "held_out:build", "--steps", "2", "--out", out, "--quiet", cwd=tmp_path)
    assert trained.returncode == 0, trained.stderr
    result = run("export", out, "--dtype", "bf16", "--repeats", "1", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "in bf16 (on the test data)" in result.stdout
    weights = load_file(str(out / "export" / "model-fp32.safetensors"))
    torch.manual_seed(0)
    x = torch.randn(64, 8)  # the factory's inputs
    logits = x[32:] @ weights["weight"].T + weights["bias"]
    expected = torch.nn.functional.cross_entropy(logits, torch.ones(32, dtype=torch.long)).item()
    row = next(line.split() for line in result.stdout.splitlines() if line.startswith("fp32"))
    assert float(row[5]) == pytest.approx(expected, abs=1e-4)  # the loss column, on the test split


def test_users_own_model_from_a_factory(tmp_path, run):
    result = run(
        "train",
        "--model",
        "examples.custom_model:build",
        "--size",
        "tiny",
        "--policy",
        "mixed_bf16",
        "--out",
        tmp_path,
        "--quiet",
    )
    assert result.returncode == 0, result.stderr
    assert "two interleaved spirals" in result.stdout


@pytest.mark.parametrize("task", ["charlm", "hf"])
def test_language_model_tasks(tmp_path, run, task):
    result = run("train", task, "--size", "tiny", "--policy", "mixed_bf16", "--out", tmp_path, "--quiet")
    assert result.returncode == 0, result.stderr
    assert 0 < float(summary(result.stdout)["eval bits_per_char"]) < 8.5  # below uniform over bytes is 8


def test_sigterm_saves_says_how_to_resume_and_resume_is_bit_identical(tmp_path, run):
    # what Slurm preemption, Kubernetes, docker stop and systemd send first
    stop, code, said = signal.SIGTERM, 143, "interrupted by SIGTERM at step "
    args = ["train", "digits", "--policy", "mixed_bf16", "--steps", "80", "--checkpoint-every", "5", "--quiet"]
    process = subprocess.Popen(
        [MIXPREC, *args, "--out", str(tmp_path / "stopped")],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 120
    while not list_checkpoints(tmp_path / "stopped" / "checkpoints") and time.monotonic() < deadline:
        time.sleep(0.1)
    process.send_signal(stop)  # wherever it is: mid-step, mid-checkpoint, between steps
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == code, stderr
    assert said in stderr and f"mixprec train --out {tmp_path / 'stopped'} --resume" in stderr
    assert "Traceback" not in stderr
    step = int(stderr.split(said)[1].split(";")[0])
    assert 0 < step < 80
    assert list_checkpoints(tmp_path / "stopped" / "checkpoints")[-1].name == f"step-{step:08d}.safetensors"
    assert run("train", "--out", tmp_path / "stopped", "--resume", "--quiet").returncode == 0
    assert run(*args, "--out", tmp_path / "straight").returncode == 0
    final = "checkpoints/step-00000080.safetensors"
    assert_same_weights(load_checkpoint(tmp_path / "straight" / final), load_checkpoint(tmp_path / "stopped" / final))


def _started(tmp_path, *extra):
    args = ["train", "digits", "--policy", "fp32", "--steps", "100000", "--quiet", *extra]
    process = subprocess.Popen([MIXPREC, *args, "--out", str(tmp_path)], cwd=REPO, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not (tmp_path / "metrics.jsonl").is_file() and time.monotonic() < deadline:
        time.sleep(0.1)
    return process


@pytest.mark.parametrize(("stop", "code"), [(signal.SIGINT, 130), (signal.SIGUSR1, 138)])
def test_each_stop_signal_ends_in_a_checkpoint_with_the_shells_exit_code(tmp_path, stop, code):
    process = _started(tmp_path)
    process.send_signal(stop)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == code, stderr
    by = "" if stop == signal.SIGINT else f" by {stop.name}"
    assert f"mixprec train: interrupted{by} at step " in stderr and "checkpoint saved" in stderr
    assert list_checkpoints(tmp_path / "checkpoints")


def test_a_signal_left_out_of_stop_signals_keeps_its_usual_effect(tmp_path):
    process = _started(tmp_path, "--stop-signals", "SIGINT")
    process.send_signal(signal.SIGTERM)
    process.communicate(timeout=60)
    assert process.returncode == -signal.SIGTERM  # terminated by the signal itself: no handler, no checkpoint
    assert not list_checkpoints(tmp_path / "checkpoints")


def nan_factory_file(tmp_path):
    (tmp_path / "nanfactory.py").write_text(
        "import torch\n"
        "from mixprec.app import TaskParts\n"
        "def build(config):\n"
        "    x = torch.randn(64, 4); x[5, 1] = float('nan'); y = torch.zeros(64, dtype=torch.int64)\n"
        "    batches = [(x[i:i + 16], y[i:i + 16]) for i in range(0, 64, 16)]\n"
        "    return TaskParts(model=torch.nn.Linear(4, 2), train_data=batches, eval_data=batches,\n"
        "                     loss_fn=torch.nn.functional.cross_entropy)\n"
        "def wrong(config):\n"
        "    return 42\n"
    )


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (("train", "digitz"), ("mixprec train: error:", "'digitz'", "digits, charlm, hf")),
        (("train",), ("name a task",)),
        (("train", "digits", "--policy", "mixed_fp8"), ("unknown policy",)),
        (("train", "--model", "no_such_module:build"), ("cannot import 'no_such_module'",)),
        (("train", "--model", "nanfactory:missing"), ("has no callable 'missing'",)),
        (("train", "--model", "nanfactory:wrong"), ("returned int", "TaskParts")),
        (("train", "digits", "--batch-size", "0"), ("--batch-size: received 0",)),
        (("train", "--resume"), ("--resume needs --out",)),
        (("train", "--out", "{tmp}", "--resume"), ("is not a mixprec run folder",)),
        (("export", "{tmp}"), ("is not a mixprec run folder",)),
        (("compare", "digits", "--policies", "fp32,bogus"), ("'bogus'",)),
        (("compare", "digits", "--policies", "fp32,mixed_bf16,fp32"), ("--policies: received 'fp32' twice",)),
        (("train", "digits", "--out", "{file}"), ("--out", "is a file, not a folder")),
        (("train", "digits", "--device", "tpu"), ("config 'device': received 'tpu'", "auto, cpu, cuda or cuda:N")),
        (("train", "digits", "--device", "meta"), ("config 'device': received 'meta'",)),
        (("doctor", "digits", "--device", "xyz"), ("device: received 'xyz'",)),
    ],
)
def test_bad_input_is_one_line_and_exit_2(tmp_path, mixprec_cli, args, needles):
    nan_factory_file(tmp_path)
    (tmp_path / "a-file").write_text("not a folder")
    args = [
        str(a).replace("{tmp}", str(tmp_path / "notarun")).replace("{file}", str(tmp_path / "a-file")) for a in args
    ]
    result = mixprec_cli(*args, cwd=tmp_path)  # runs land in tmp_path/runs; factories import from tmp_path
    assert result.returncode == 2, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    if "--device" in args:  # refused before anything was written
        assert not (tmp_path / "runs").exists()


def test_an_out_folder_that_cannot_be_made_is_one_line_naming_it(tmp_path, mixprec_cli):
    (tmp_path / "a-file").write_text("not a folder")
    out = tmp_path / "a-file" / "run"  # a file in the folder's path: the machine refuses (exit 1)
    result = mixprec_cli("train", "digits", "--steps", "1", "--out", str(out), cwd=tmp_path)
    assert result.returncode == 1, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and f"--out {out}: cannot create this folder" in lines[0], result.stderr


def test_two_runs_started_into_one_folder_at_once_one_proceeds(tmp_path):
    args = ["train", "digits", "--policy", "fp32", "--steps", "60", "--quiet", "--out", str(tmp_path / "run")]
    processes = [
        subprocess.Popen([MIXPREC, *args, "--seed", str(seed)], cwd=REPO, stderr=subprocess.PIPE, text=True)
        for seed in (0, 1)
    ]
    errors = [p.communicate(timeout=180)[1] for p in processes]
    codes = [p.returncode for p in processes]
    assert sorted(codes) == [0, 2], errors
    loser = errors[codes.index(2)].strip().splitlines()
    assert len(loser) == 1 and ("in use by another mixprec run" in loser[0] or "already holds a run" in loser[0])
    winner_seed = codes.index(0)
    assert json.loads((tmp_path / "run" / "config.json").read_text())["seed"] == winner_seed  # one run's files
    assert {json.loads(line).get("step") for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()}


def test_a_run_of_a_user_model_resumes_from_the_folder_it_was_trained_in(tmp_path, run):
    # the run's config names examples.custom_model:build, importable from the repository root, where these run
    out = tmp_path / "custom"
    done = run("train", "--model", "examples.custom_model:build", "--steps", "2", "--quiet", "--out", out)
    assert done.returncode == 0, done.stderr[-2000:]
    # a new process, as a user resumes: it imports the factory again, from the current folder
    done = run_process("train", "--out", out, "--resume", "--steps", "3", "--quiet")
    assert done.returncode == 0, done.stderr[-2000:]


def test_resume_refuses_flags_that_would_train_another_run_and_keeps_a_new_length(tmp_path, run):
    out = tmp_path / "run"
    done = run("train", "digits", "--size", "tiny", "--steps", "2", "--policy", "mixed_fp16", "--quiet", "--out", out)
    assert done.returncode == 0, done.stderr[-2000:]
    for flags, said in [
        (["--policy", "fp32"], "received --policy 'fp32', but the run has 'mixed_fp16'"),
        (["charlm"], "received the task 'charlm', but the run has 'digits'"),
        (["--lr", "0.5"], "received --lr 0.5, but the run has the task's default"),
        (["--seed", "3"], "received --seed 3, but the run has 0"),
        # a flag given with its default's value is given too (it was taken for absent, and ignored)
        (["--size", "default"], "received --size 'default', but the run has 'tiny'"),
    ]:
        done = run("train", *flags, "--out", out, "--resume", "--steps", "4")
        assert done.returncode == 2 and said in done.stderr, (flags, done.stderr)
        assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr
    # the same values as the run's, and a new length and checkpoint count, are taken; config.json keeps them
    done = run(
        "train", "--out", out, "--resume", "--policy", "mixed_fp16", "--accumulation-steps", "1", "--steps", "4",
        "--keep", "2", "--quiet",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    saved = json.loads((out / "config.json").read_text())  # what a later plain --resume continues to
    assert (saved["steps"], saved["keep_checkpoints"], saved["policy"]) == (4, 2, "mixed_fp16")
    assert re.search(r"trained\s+4 steps", done.stdout), done.stdout
