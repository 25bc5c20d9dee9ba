"""Bad input, table-driven, across the API and the CLI: one clear message that names the problem, a
non-zero exit and no traceback from the CLI, and no partial output left behind."""

import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import mixprec
import mixprec.app
from mixprec.app.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from mixprec.app.task import TaskConfig, build_task

MIXPREC = Path(sys.executable).with_name("mixprec")
REPO = Path(__file__).resolve().parents[2]


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))


def _pair() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(2, 4), torch.zeros(2, dtype=torch.long)


def _engine(policy="mixed_bf16", **kwargs) -> mixprec.MixedPrecision:
    model = _model()
    return mixprec.MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), policy, **kwargs)


def _trainer() -> mixprec.app.Trainer:
    model = _model()
    batches = [(torch.randn(8, 4), torch.randint(0, 2, (8,)))]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = mixprec.app.TrainData(batches, None, nn.functional.cross_entropy)
    return mixprec.app.Trainer(model, optimizer, data, "fp32", run=mixprec.app.RunOptions(progress=False))


def _write(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


class _Payload:
    """Unpickling this runs a shell command that creates a file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _pickle_checkpoint(tmp: Path) -> Path:
    return _write(tmp / "step-00000001.safetensors", pickle.dumps(_Payload(tmp / "executed")))


# (id, callable taking the temporary folder, exception type, phrases the message must hold)
API_CASES = [
    ("format name", lambda t: mixprec.get_format("fp17"), ValueError, ["'fp17'"]),
    ("quantize format", lambda t: mixprec.quantize(torch.ones(2), "fp17"), ValueError, ["'fp17'"]),
    (
        "quantize rounding",
        lambda t: mixprec.quantize(torch.ones(2), "fp16", rounding="banker"),
        ValueError,
        ["'banker'", "nearest"],
    ),
    ("quantize non-tensor", lambda t: mixprec.quantize([1.0], "fp16"), TypeError, ["list"]),
    ("policy name", lambda t: mixprec.get_policy("mixed_fp8"), ValueError, ["unknown policy", "mixed_bf16"]),
    ("policy key", lambda t: mixprec.get_policy("p=bf16,q=1"), ValueError, ["unknown key 'q'"]),
    ("policy dtype", lambda t: mixprec.get_policy("p=int8"), ValueError, ["int8"]),
    ("policy base", lambda t: mixprec.get_policy("base=nope"), ValueError, ["base='nope'", "is not a preset"]),
    ("policy fp8 history", lambda t: mixprec.get_policy("base=fp8,fp8=(history=0)"), ValueError, ["history"]),
    ("policy fp8 gemm", lambda t: mixprec.get_policy("base=fp8,fp8=(gemm=cublas)"), ValueError, ["'cublas'"]),
    ("policy device", lambda t: mixprec.get_policy("mixed_bf16", device="gpu0"), ValueError, ["'gpu0'"]),
    (
        "engine model",
        lambda t: mixprec.MixedPrecision("model", torch.optim.SGD([nn.Parameter(torch.ones(1))])),
        TypeError,
        ["model=", "str"],
    ),
    ("engine optimizer", lambda t: mixprec.MixedPrecision(_model(), "sgd"), TypeError, ["optimizer=", "str"]),
    ("engine accumulation", lambda t: _engine(accumulation_steps=0), ValueError, ["accumulation_steps", "0"]),
    ("engine pure without AdamW", lambda t: _engine("pure_bf16"), ValueError, ["mixprec.AdamW"]),
    (
        "engine repeated scaler",
        lambda t: _engine(num_losses=2, scaler=[mixprec.NoOpLossScaler()] * 2),
        ValueError,
        ["its own scaler"],
    ),
    ("backward shape", lambda t: _engine().backward(torch.ones(3)), ValueError, ["one-element loss", "(3,)"]),
    ("backward loss id", lambda t: _engine().backward(torch.ones(()), loss_id=2), ValueError, ["loss_id", "2"]),
    ("scheduler before step", lambda t: _engine().step_scheduler(None), RuntimeError, ["before any step()"]),
    (
        "state from another policy",
        lambda t: _engine("fp32").load_state_dict(_engine("mixed_bf16").state_dict()),
        ValueError,
        ["saved under policy", "same policy"],
    ),
    ("state keys", lambda t: _engine().load_state_dict({"scale": 1}), ValueError, ["expected keys", "state_dict()"]),
    ("scaler init", lambda t: mixprec.DynamicLossScaler(init_scale=-1.0), ValueError, ["init_scale", "-1"]),
    ("scaler growth", lambda t: mixprec.DynamicLossScaler(growth_factor=0.5), ValueError, ["growth_factor", "0.5"]),
    ("scaler hysteresis", lambda t: mixprec.DynamicLossScaler(hysteresis=0), ValueError, ["hysteresis", "0"]),
    ("scaler number", lambda t: _engine("mixed_fp16", scaler=1024.0), ValueError, ["scaler=", "1024.0", "DynamicLoss"]),
    (
        "scaler GradScaler",
        lambda t: _engine("mixed_fp16", scaler=torch.amp.GradScaler("cpu")),
        ValueError,
        ["received <torch.amp.grad_scaler.GradScaler", "mixprec.DynamicLossScaler(init_scale=...)"],
    ),
    ("clip negative", lambda t: _engine().clip_grad_norm_(-1.0), ValueError, ["max_norm", "positive", "-1.0"]),
    ("clip nan", lambda t: _engine().clip_grad_norm_(float("nan")), ValueError, ["max_norm", "positive", "nan"]),
    (
        "doctor keep string",
        lambda t: mixprec.diagnose(_model(), [_pair()], nn.functional.cross_entropy, keep="0.9"),
        ValueError,
        ["keep=", "'0.9'", "fraction"],
    ),
    (
        "doctor dict batches",
        lambda t: mixprec.diagnose(_model(), [{"x": torch.randn(2, 4)}], nn.functional.cross_entropy),
        ValueError,
        ["batch of type dict", "(inputs, targets)"],
    ),
    (
        "policy replace key",
        lambda t: mixprec.get_policy("mixed_bf16").replace(compute="fp16"),
        TypeError,
        ["'compute', not a Policy field", "compute_dtype", "get_policy('base=mixed_bf16,compute=fp16')"],
    ),
    ("doctor formats string", lambda t: mixprec.RangeWatch(_model(), formats="fp17"), ValueError, ["'fp17'"]),
    ("AdamW lr", lambda t: mixprec.AdamW(_model().parameters(), lr=-1.0), ValueError, ["lr", "-1"]),
    ("AdamW update", lambda t: mixprec.AdamW(_model().parameters(), update="round"), ValueError, ["'round'", "kahan"]),
    ("FP8 scaling", lambda t: mixprec.Fp8Recipe(scaling="lazy"), ValueError, ["scaling", "'lazy'"]),
    (
        "cast a non-module",
        lambda t: mixprec.cast_module("model", mixprec.get_policy("o2_bf16")),
        TypeError,
        ["nn.Module", "str"],
    ),
    (
        "fully_shard dtype",
        lambda t: mixprec.fully_shard(_model(), "o2_bf16", reduce_dtype=torch.int8),
        ValueError,
        ["reduce_dtype", "int8"],
    ),
    (
        "config batch size",
        lambda t: mixprec.app.TrainConfig(task="digits", batch_size=0),
        ValueError,
        ["'batch_size'", "0"],
    ),
    ("config type", lambda t: mixprec.app.TrainConfig(task="digits", steps="ten"), ValueError, ["'steps'", "'ten'"]),
    (
        "config parallel",
        lambda t: mixprec.app.TrainConfig(task="digits", parallel="zero3"),
        ValueError,
        ["'parallel'", "'zero3'", "fsdp"],
    ),
    ("task name", lambda t: build_task("digitz", TaskConfig(8, 0, "cpu", "tiny")), ValueError, ["'digitz'", "digits"]),
    (
        "trainer bad-batch action",
        lambda t: mixprec.app.BatchChecks(on_bad_batch="ignore"),
        ValueError,
        ["BatchChecks(on_bad_batch=...)", "'ignore'", "'skip'"],
    ),
    (
        "trainer log cadence",
        lambda t: mixprec.app.RunOptions(log_every=0),
        ValueError,
        ["RunOptions(log_every=...)", "received 0"],
    ),
    ("fit steps", lambda t: _trainer().fit(steps=0), ValueError, ["steps", "0"]),
    ("fit both lengths", lambda t: _trainer().fit(epochs=1, steps=1), ValueError, ["exactly one of"]),
    ("checkpoint missing", lambda t: load_checkpoint(t / "none.safetensors"), CheckpointError, ["no such checkpoint"]),
    (
        "checkpoint truncated",
        lambda t: load_checkpoint(_write(t / "c.safetensors", b"\x10\x00\x00")),
        CheckpointError,
        ["truncated or corrupt"],
    ),
    (
        "checkpoint foreign",
        lambda t: (save_file({"w": torch.ones(2)}, str(t / "f.safetensors")), load_checkpoint(t / "f.safetensors")),
        CheckpointError,
        ["not a mixprec checkpoint"],
    ),
    ("checkpoint pickle", lambda t: load_checkpoint(_pickle_checkpoint(t)), CheckpointError, ["truncated or corrupt"]),
]


@pytest.mark.parametrize(("case", "call", "error", "phrases"), API_CASES, ids=[c[0] for c in API_CASES])
def test_the_api_names_the_problem(tmp_path, case, call, error, phrases):
    with pytest.raises(error) as raised:
        call(tmp_path)
    message = str(raised.value)
    for phrase in phrases:
        assert phrase in message, f"{case}: {phrase!r} not in {message!r}"
    assert not (tmp_path / "executed").exists()  # nothing from a file was ever run


def _other_model_run(tmp: Path, identity: dict | None = None) -> Path:
    """A run folder whose checkpoint holds another model's weights (digits under its own config)."""
    run = tmp / "other"
    state = {"model": {"w": torch.ones(3)}, "optimizer": {}}
    save_checkpoint(run / "checkpoints", 1, state if identity is None else {"identity": identity, **state})
    mixprec.app.TrainConfig(task="digits", size="tiny", policy="fp32").save(run)
    return run


def _policy_file(tmp: Path, text: str) -> Path:
    return _write(tmp / "policy.json", text.encode())


# (id, arguments, with "{tmp}" for the temporary folder, phrases the one line must hold)
CLI_CASES = [
    ("train steps", ["train", "digits", "--steps", "0", "--out", "{tmp}/run"], ["--steps: received 0", "at least 1"]),
    ("train lr", ["train", "digits", "--lr", "-1", "--out", "{tmp}/run"], ["--lr: received -1", "at least 0"]),
    ("train lr inf", ["train", "digits", "--lr", "inf", "--out", "{tmp}/run"], ["--lr: received inf"]),
    (
        "train minutes",
        ["train", "digits", "--checkpoint-every-minutes", "0", "--out", "{tmp}/run"],
        ["--checkpoint-every-minutes: received 0", "above 0"],
    ),
    (
        "train collective timeout",
        ["train", "digits", "--collective-timeout", "-5", "--out", "{tmp}/run"],
        ["'collective_timeout'", "received -5.0", "positive finite number of seconds"],
    ),
    (
        "train stop signal",
        ["train", "digits", "--stop-signals", "SIGKILL", "--out", "{tmp}/run"],
        ["--stop-signals", "'SIGKILL'"],
    ),
    (
        "train clip to zero",
        ["train", "digits", "--max-grad-norm", "0", "--out", "{tmp}/run"],
        ["--max-grad-norm: received 0", "above 0"],
    ),
    ("train policy key", ["train", "digits", "--policy", "p=bf16,q=1", "--out", "{tmp}/run"], ["unknown key 'q'"]),
    (
        "train policy name",  # named as the run's setting, and said before the task's model is built
        ["train", "digits", "--policy", "mixd_bf16", "--out", "{tmp}/run"],
        ["error: policy='mixd_bf16': unknown policy", "Did you mean mixed_bf16"],
    ),
    (
        "compare policy name",
        ["compare", "digits", "--policies", "fp32,mixd_bf16", "--out", "{tmp}/run"],
        ["error: --policies 'mixd_bf16': unknown policy", "Did you mean mixed_bf16"],
    ),
    ("train device", ["train", "digits", "--device", "cuda", "--out", "{tmp}/run"], ["no CUDA device"]),
    ("train parallel", ["train", "digits", "--parallel", "zero3"], ["invalid choice: 'zero3'"]),
    (
        "train loss scale",
        ["train", "digits", "--loss-scale", "-4", "--out", "{tmp}/run"],
        ["--loss-scale: received -4", "2^-126 to 3.4e38"],
    ),
    (
        "train accumulation",
        ["train", "digits", "--accumulation-steps", "0", "--out", "{tmp}/run"],
        ["--accumulation-steps: received 0"],
    ),
    (
        "train missing policy file",
        ["train", "digits", "--policy", "{tmp}/none.json", "--out", "{tmp}/run"],
        ["none.json"],
    ),
    (
        "train corrupt policy file",
        ["train", "digits", "--policy", "{policy_file}", "--out", "{tmp}/run"],
        ["policy.json"],
    ),
    (
        "resume another run",
        ["train", "--out", "{foreign_run}", "--resume", "--steps", "2"],
        ["belongs to another run", "model 'Other 0123' there", "--allow-foreign-checkpoint"],
    ),
    (
        "resume without identity",
        ["train", "--out", "{other_run}", "--resume", "--steps", "2"],
        ["no usable checkpoint", "records no run identity"],
    ),
    (
        "resume corrupt checkpoint",
        ["train", "--out", "{corrupt_run}", "--resume", "--steps", "2"],
        ["no usable checkpoint"],
    ),
    ("export no run", ["export", "{tmp}/none"], ["is not a mixprec run folder"]),
    ("doctor task", ["doctor", "digitz", "--out", "{tmp}/run"], ["'digitz'"]),
    ("doctor steps", ["doctor", "digits", "--steps", "0", "--out", "{tmp}/run"], ["steps", "0"]),
    ("compare empty", ["compare", "digits", "--policies", ",", "--out", "{tmp}/run"], ["--policies"]),
    # refused by fit() after config.json was written: the run folder stayed
    (
        "train window longer than an epoch",
        ["train", "digits", "--size", "tiny", "--epochs", "1", "--accumulation-steps", "30", "--out", "{tmp}/run"],
        ["fewer than accumulation_steps=30"],
    ),
    ("bench suite", ["bench", "--suite", "nope", "--out", "{tmp}/run"], ["'nope'"]),
    # a seed that is not a number said "invalid literal for int() with base 10", naming no argument
    ("bench seeds", ["bench", "--seeds", "0,a", "--out", "{tmp}/run"], ["--seeds: received '0,a'"]),
    ("bench no seeds", ["bench", "--seeds", ",", "--out", "{tmp}/run"], ["--seeds: received ','"]),
    (  # the policy command takes the file as its SPEC: the error named a --policy it has not
        "policy file names a bad policy",
        ["policy", "{misnamed_policy_file}"],
        ["SPEC ", "policy.json: its 'policy' is not valid"],
    ),
    (
        "train policy file names a bad policy",
        ["train", "digits", "--policy", "{misnamed_policy_file}", "--out", "{tmp}/run"],
        ["policy.json: its 'policy' is not valid", "Did you mean mixed_fp16"],
    ),
    (
        "train loss scale past fp32",
        ["train", "digits", "--loss-scale", "1e39", "--out", "{tmp}/run"],
        ["received 1e39"],
    ),
    ("doctor unknown flag", ["doctor", "digits", "--policy", "x"], ["mixprec doctor: error: unrecognized arguments"]),
    # numeric flags: refused by name before anything runs (a batch size of 0 was read as the task's default)
    (
        "train batch size 0",
        ["train", "digits", "--batch-size", "0", "--out", "{tmp}/run"],
        ["--batch-size: received 0"],
    ),
    ("train batch size -5", ["train", "digits", "--batch-size", "-5", "--out", "{tmp}/run"], ["received -5"]),
    ("train lr nan", ["train", "digits", "--lr", "nan", "--out", "{tmp}/run"], ["--lr: received nan"]),
    # a seed past 64 bits said "Overflow when unpacking long long"
    (
        "train seed past 2^32",
        ["train", "digits", "--seed", "99999999999999999999", "--out", "{tmp}/run"],
        ["--seed: received 99999999999999999999", "from 0 to 4294967295"],
    ),
    ("doctor keep", ["doctor", "digits", "--keep", "2", "--out", "{tmp}/run"], ["--keep: received 2", "(0, 1]"]),
    ("serve seq", ["serve-bench", "{tmp}/none", "--seq", "0"], ["--seq: received 0"]),
]


def _argument(value: str, tmp: Path) -> str:
    if value == "{other_run}":
        return str(_other_model_run(tmp))
    if value == "{foreign_run}":
        return str(_other_model_run(tmp, {"policy": "fp32", "model": "Other 0123"}))
    if value == "{corrupt_run}":
        run = _other_model_run(tmp)
        checkpoint = run / "checkpoints" / "step-00000001.safetensors"
        checkpoint.write_bytes(checkpoint.read_bytes()[:100])  # truncated
        return str(run)
    if value == "{misnamed_policy_file}":
        return str(_policy_file(tmp, '{"policy": "mixd_fp16"}'))
    if value == "{policy_file}":
        return str(_policy_file(tmp, '{"policy": '))
    return value.replace("{tmp}", str(tmp))


@pytest.mark.parametrize(("case", "args", "phrases"), CLI_CASES, ids=[c[0] for c in CLI_CASES])
def test_the_cli_prints_one_line_exits_2_and_leaves_nothing(tmp_path, mixprec_cli, case, args, phrases):
    argv = [_argument(a, tmp_path) for a in args]
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    result = mixprec_cli(*argv, cwd=tmp_path)
    assert result.returncode == 2, (case, result.stdout[-500:], result.stderr[-2000:])
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr[-2000:]
    for phrase in phrases:
        assert phrase in lines[0], f"{case}: {phrase!r} not in {lines[0]!r}"
    after = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    assert after == before, f"{case}: left behind {sorted(set(after) - set(before))}"


def test_the_console_script_prints_the_same_one_line(tmp_path):
    # the cases above run the command's main() in this process; one goes through the installed script
    result = subprocess.run(
        [str(MIXPREC), "train", "digits", "--policy", "p=bf16,q=1", "--out", str(tmp_path / "run")],
        capture_output=True, text=True, timeout=120, cwd=tmp_path, check=False,
    )  # fmt: skip
    assert result.returncode == 2 and result.stdout == "", result
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mixprec train: error: ") and "unknown key 'q'" in lines[0], lines
    assert not (tmp_path / "run").exists()


def test_the_table_is_at_least_forty_inputs():
    assert len(API_CASES) + len(CLI_CASES) >= 40
