"""Every argument and file checked at the boundary (issue 34, class 3): paths, signal sets, seeds, cache and config
entries, metrics, factories; a malformed one is measured again or refused naming the file and the key."""

import json

import pytest
import torch

import mixprec.app
from mixprec.compute import kernel_plan
from mixprec.compute.kernels import CACHE_VERSION, FAMILIES, machine_key

TINY = ("--size", "tiny", "--steps", "2", "--quiet")


def _one_line_error(finished, *needles):
    assert finished.returncode == 2, (finished.stdout, finished.stderr)
    lines = finished.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in finished.stderr, finished.stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


@pytest.mark.parametrize(
    "value, needles",
    [
        ("", ("--out", "empty path")),
        ("a" * 300, ("--out", "longer than this system allows", "(300 characters)")),
        ("/".join(["d"] * 2100), ("--out", "4096 bytes")),
    ],
    ids=["empty", "a name past 255 bytes", "a path past 4096 bytes"],
)
def test_a_path_is_checked_before_anything_runs(mixprec_cli, tmp_path, value, needles):
    line = _one_line_error(mixprec_cli("train", "digits", "--out", value, *TINY, cwd=tmp_path), *needles)
    assert len(line) < 400  # the echo is cut
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("name", ["SIGSEGV", "SIGCHLD", "SIGPIPE", "SIGWINCH", "SIGKILL", "SIGRTMIN", "NOPE"])
def test_only_signals_a_run_can_stop_on_are_accepted(mixprec_cli, tmp_path, name):
    # SIGSEGV was accepted: its handler returned into the faulting instruction, a loop at 100% CPU, deaf to SIGTERM
    finished = mixprec_cli("train", "digits", "--stop-signals", f"SIGTERM,{name}", *TINY, cwd=tmp_path)
    _one_line_error(finished, "--stop-signals", name, "SIGTERM, SIGHUP")
    with pytest.raises(ValueError, match="not a signal a run can stop on"):
        mixprec.app.RunOptions(stop_signals=("SIGTERM", name))


def test_a_factory_that_fails_is_named_as_the_failure(mixprec_cli, tmp_path):
    finished = mixprec_cli("train", "--model", "os:getcwd", *TINY, cwd=tmp_path)
    _one_line_error(finished, "task 'os:getcwd': the factory getcwd(config) failed (TypeError:", "TaskParts")


def test_a_policy_or_config_file_with_a_key_given_twice_is_refused(mixprec_cli, tmp_path):
    policy = tmp_path / "advice.json"
    policy.write_text('{"policy": "fp32", "loss_scale": 1024, "policy": "mixed_fp16"}')
    finished = mixprec_cli("train", "digits", "--policy", policy, *TINY, cwd=tmp_path)
    _one_line_error(finished, str(policy), "the key 'policy' is given twice")

    run = tmp_path / "run"
    assert mixprec_cli("train", "digits", "--out", run, *TINY, cwd=tmp_path).returncode == 0
    text = (run / "config.json").read_text()
    (run / "config.json").write_text(text.replace('"seed": 0,', '"seed": 0,\n  "seed": 7,'))
    finished = mixprec_cli("train", "--out", run, "--resume", "--steps", "3", "--quiet", cwd=tmp_path)
    _one_line_error(finished, "config.json", "the key 'seed' is given twice")


def test_a_batch_size_edited_into_config_json_is_not_resumed_silently(mixprec_cli, tmp_path):
    run = tmp_path / "run"
    assert mixprec_cli("train", "digits", "--out", run, "--batch-size", "32", *TINY, cwd=tmp_path).returncode == 0
    config = json.loads((run / "config.json").read_text())
    (run / "config.json").write_text(json.dumps({**config, "batch_size": 16}))
    finished = mixprec_cli("train", "--out", run, "--resume", "--steps", "4", "--quiet", cwd=tmp_path)
    _one_line_error(finished, "belongs to another run", "batch size 32 there, 16 here")


def test_metrics_with_binary_bytes_are_refused_naming_the_file_and_line(mixprec_cli, tmp_path):
    run = tmp_path / "run"
    assert mixprec_cli("train", "digits", "--out", run, *TINY, cwd=tmp_path).returncode == 0
    lines = (run / "metrics.jsonl").read_bytes().splitlines()
    (run / "metrics.jsonl").write_bytes(b"\n".join([lines[0], b"\xff\xfe\x00garbage", *lines[1:]]) + b"\n")
    finished = mixprec_cli("train", "--out", run, "--resume", "--steps", "3", "--quiet", cwd=tmp_path)
    _one_line_error(finished, "metrics.jsonl: line 2 is not a metrics record", "move it away")


class _Timer:
    def __call__(self, family, candidate):
        return {"native": 5.0, "emulated": 1.0}.get(candidate, 1.0)


@pytest.mark.parametrize(
    "timings",
    [{"matmul": {"native": "fast"}}, {"matmul": ["x"]}, "slow", {"matmul": {"native": float("nan")}}],
    ids=["a string for a figure", "a list for a family", "a string for the table", "NaN"],
)
def test_a_malformed_kernel_cache_entry_is_measured_again(tmp_path, timings):
    # a string for a figure crashed the compute plan's reason: "Unknown format code 'f' for object of type 'str'"
    entry = {"choices": dict.fromkeys(FAMILIES, "native"), "timings_ms": timings}
    cache = {"version": CACHE_VERSION, "entries": {machine_key(torch.float16): entry}}
    (tmp_path / "kernels.json").write_text(json.dumps(cache))
    plan = kernel_plan(torch.float16, timer=_Timer(), cache_dir=tmp_path)
    assert plan.source == "measured"
    assert "native 5.00 ms" in plan.describe()  # formats every figure (the malformed one crashed here)
    saved = json.loads((tmp_path / "kernels.json").read_text())["entries"][machine_key(torch.float16)]
    assert all(isinstance(ms, float) for figures in saved["timings_ms"].values() for ms in figures.values())


def test_a_run_under_auto_resumes_under_the_policy_it_trained_with(mixprec_cli, tmp_path, monkeypatch):
    # 'auto' was decided again at each resume, by the kernel probe: timing noise, another cache or another machine
    # made the run's own checkpoint "another run's" (and the message said to remove it)
    run = tmp_path / "run"
    assert mixprec_cli("train", "digits", "--policy", "auto", "--out", run, *TINY, cwd=tmp_path).returncode == 0
    trained = json.loads((run / "config.json").read_text())["policy"]
    assert trained != "auto" and "compute=" in trained
    slow = tmp_path / "slow-bf16"  # a cache where bf16 GEMMs are 9x slower than FP32: 'auto' would pick fp32 now
    slow.mkdir()
    entry = {"choices": dict.fromkeys(FAMILIES, "native"), "timings_ms": {"matmul": {"native": 9.0, "fp32": 1.0}}}
    cache = {"version": CACHE_VERSION, "entries": {machine_key(torch.bfloat16): entry}}
    (slow / "kernels.json").write_text(json.dumps(cache))
    monkeypatch.setenv("MIXPREC_CACHE_DIR", str(slow))
    finished = mixprec_cli("train", "--out", run, "--resume", "--steps", "4", "--quiet", cwd=tmp_path)
    assert finished.returncode == 0, finished.stderr
    assert json.loads((run / "config.json").read_text())["policy"] == trained
    # the same command line with --resume added (a Slurm requeue): its --policy auto was refused against the
    # policy auto had decided
    again = mixprec_cli("train", "digits", "--policy", "auto", "--out", run, "--resume", "--steps", "5", "--quiet",
                        cwd=tmp_path)  # fmt: skip
    assert again.returncode == 0, again.stderr
    assert json.loads((run / "config.json").read_text())["policy"] == trained


def test_a_run_from_a_policy_file_resumes_with_the_same_file(mixprec_cli, tmp_path):
    advice = tmp_path / "policy.json"
    advice.write_text(json.dumps({"policy": "mixed_fp16", "loss_scale": 1024.0}))
    run = tmp_path / "run"
    first = mixprec_cli("train", "digits", "--policy", advice, "--steps", "2", "--quiet", "--out", run, cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    again = mixprec_cli("train", "digits", "--policy", advice, "--steps", "3", "--quiet", "--out", run, "--resume",
                        cwd=tmp_path)  # fmt: skip
    assert again.returncode == 0, again.stderr  # was: "received --policy '.../policy.json', but the run has ..."
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"policy": "mixed_bf16"}))
    refused = mixprec_cli("train", "digits", "--policy", other, "--steps", "4", "--out", run, "--resume", cwd=tmp_path)
    assert refused.returncode == 2 and "but the run has 'mixed_fp16'" in refused.stderr, refused.stderr


@pytest.mark.parametrize(
    "args, needles",
    [
        (("train", "digits", "--out", "bad\udcff", *TINY), ("--out", "not UTF-8")),
        (("demo", "--seed", "-5", "--steps", "1"), ("--seed", "from 0 to 4294967295")),
        (("demo", "--seed", "99999999999999999999", "--steps", "1"), ("--seed", "from 0 to 4294967295")),
        (("doctor", "digits", "--seed", "-3"), ("--seed", "from 0 to 4294967295")),
        (("train", "digits", "--stop-signals", "", *TINY), ("--stop-signals", "empty signal name", "'none'")),
        (("train", "digits", "--stop-signals", "SIGINT,,SIGTERM", *TINY), ("--stop-signals", "empty signal name")),
        (("compare", "digits", "--policies", "fp32,float32", *TINY), ("'fp32' and 'float32' are the same policy",)),
        (("train", "--model", "syntax_error:build", *TINY), ("importing 'syntax_error' failed (SyntaxError",)),
        (("train", "--model", "exits:build", *TINY), ("the factory build(config) failed (SystemExit: 0)",)),
        (("doctor", "digits", "--steps", "1", "--apply", "a" * 245 + ".json"), ("--apply", "longer than")),
    ],
)
def test_more_arguments_checked_before_anything_runs(mixprec_cli, tmp_path, args, needles):
    (tmp_path / "syntax_error.py").write_text("def build(:\n")
    (tmp_path / "exits.py").write_text("import sys\n\ndef build(config):\n    sys.exit(0)\n")
    _one_line_error(mixprec_cli(*args, cwd=tmp_path), *needles)
    written = [p.name for p in tmp_path.rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    assert sorted(written) == ["exits.py", "syntax_error.py"]  # nothing written


def test_hand_edited_files_are_named_with_the_key(mixprec_cli, tmp_path):
    run = tmp_path / "run"
    assert mixprec_cli("train", "digits", "--out", run, *TINY, cwd=tmp_path).returncode == 0
    config = json.loads((run / "config.json").read_text())
    (run / "config.json").write_text(json.dumps({**config, "seed": -1}))
    finished = mixprec_cli("train", "--out", run, "--resume", "--steps", "3", "--quiet", cwd=tmp_path)
    _one_line_error(finished, "config.json", "config 'seed'")
    (run / "config.json").write_text(json.dumps(config))
    with (run / "metrics.jsonl").open("a") as log:  # valid JSON, as the last line: not a torn write
        log.write('{"kind": "eval", "step": 3, "loss": null, "accuracy": [1]}\n')
    finished = mixprec_cli("train", "--out", run, "--resume", "--steps", "3", "--quiet", cwd=tmp_path)
    _one_line_error(finished, "metrics.jsonl: line", "'loss' is None, not a number")
