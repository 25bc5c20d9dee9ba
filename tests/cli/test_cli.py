"""The ``mixprec`` command as a user runs it: its main() in this process (tests/cli/conftest.py), or the
installed script where the process itself is the subject."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

import mixprec

MIXPREC = Path(sys.executable).with_name("mixprec")


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(MIXPREC), *args], capture_output=True, text=True, timeout=120, check=False)


def assert_one_line_error(result, *needles: str) -> None:
    assert result.returncode == 2, result
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_version_and_help():
    assert run("--version").stdout.strip() == f"mixprec {mixprec.__version__}"
    helped = run("--help")
    assert helped.returncode == 0
    for command in ("formats", "policy", "demo"):
        assert command in helped.stdout


_NO_TORCH = """
import sys
from mixprec.app.cli.main import main
for argv in {argvs!r}:
    try:
        main(argv)
    except SystemExit:
        pass
print(sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.")))
"""


def test_help_and_usage_errors_answer_without_importing_torch():
    argvs = [
        ["--help"],
        ["train", "--help"],
        ["compare", "--bogus"],
        ["train", "digits", "--size", "huge"],
        ["train", "digits", "--steps", "0"],
        ["train", "digits", "--lr", "inf"],
        ["export", "/nonexistent/run"],
    ]
    result = subprocess.run(
        [sys.executable, "-c", _NO_TORCH.format(argvs=argvs)], capture_output=True, text=True, check=True, timeout=60
    )
    assert result.stdout.strip().splitlines()[-1] == "[]", result.stdout[-500:]
    for said in ("invalid choice: 'huge'", "unrecognized arguments: --bogus", "--steps: received 0", "received inf"):
        assert said in result.stderr, result.stderr
    assert "is not a mixprec run folder" in result.stderr, result.stderr


def test_the_library_and_the_cli_load_without_torchs_compiler():
    """torch._dynamo (1.4 s of every start) loads only when something compiles: FSDP2 and
    torch.distributed.checkpoint, which import it, are imported where used."""
    code = (
        "import sys, mixprec, mixprec.app.run, mixprec.app.export, mixprec.app.serve_bench\n"
        "for name in mixprec.__all__: getattr(mixprec, name)\n"
        "print(sorted(m for m in ('torch._dynamo', 'torch.distributed.fsdp', 'torch.distributed.checkpoint') "
        "if m in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert result.stdout.strip().splitlines()[-1] == "[]", result.stdout[-500:]


def test_the_help_lists_exactly_the_built_in_tasks(mixprec_cli):
    run = mixprec_cli
    from mixprec.app.cli.train_cmd import TASK_NAMES
    from mixprec.app.task import BUILTIN_TASKS

    assert tuple(BUILTIN_TASKS) == TASK_NAMES
    assert f"a built-in task ({', '.join(BUILTIN_TASKS)})" in " ".join(run("train", "--help").stdout.split())


def test_import_mixprec_loads_names_on_first_use():
    result = subprocess.run(
        [sys.executable, "-c", "import sys, mixprec; print('torch' in sys.modules); print(mixprec.Policy.__name__)"],
        capture_output=True, text=True, check=True, timeout=60,
    )  # fmt: skip
    assert result.stdout.split() == ["False", "Policy"]
    assert set(mixprec.__all__) <= set(dir(mixprec))
    for name in mixprec.__all__:
        assert getattr(mixprec, name) is not None
    with pytest.raises(AttributeError, match="module 'mixprec' has no attribute 'Trainerr'"):
        mixprec.Trainerr  # noqa: B018


def test_python_dash_m():
    result = subprocess.run([sys.executable, "-m", "mixprec", "--version"], capture_output=True, text=True, check=True)
    assert result.stdout.startswith("mixprec ")


def test_formats_table(mixprec_cli):
    run = mixprec_cli
    result = run("formats")
    assert result.returncode == 0
    rows = {line.split()[0]: line for line in result.stdout.splitlines()[2:]}
    assert list(rows) == list(mixprec.FORMATS)
    assert "65504" in rows["fp16"] and "5.96e-08" in rows["fp16"] and "usually needed" in rows["fp16"]
    assert "448" in rows["fp8_e4m3"] and "no (saturates)" in rows["fp8_e4m3"]
    assert "not needed" in rows["bf16"] and "16 (1/8/7)" in rows["bf16"]


def test_formats_json_matches_library(mixprec_cli):
    run = mixprec_cli
    records = json.loads(run("formats", "--json", "-f", "fp16", "e3m2").stdout)
    assert [r["format"] for r in records] == ["fp16", "e3m2"]
    assert records[0]["max"] == 65504.0 and records[0]["min_subnormal"] == 2.0**-24
    assert records[1]["max"] == mixprec.get_format("e3m2").max


def test_formats_values(mixprec_cli):
    run = mixprec_cli
    result = run("formats", "--value", "1e-8", "70000", "-1e-40", "65510", "--json")
    outcome = {(r["value"], r["format"]): r["outcome"] for r in json.loads(result.stdout)}
    assert outcome[(1e-8, "fp16")] == "underflow to 0"
    assert outcome[(1e-8, "bf16")].startswith("rounded (rel. error 1.17e-03")
    assert outcome[(70000.0, "fp16")] == "overflow to inf"
    assert outcome[(70000.0, "fp8_e4m3")] == "overflow, saturates to max"
    assert outcome[(70000.0, "fp32")] == "exact"
    assert outcome[(65510.0, "fp16")].startswith("rounded (rel. error")  # below the overflow threshold 65520
    assert outcome[(-1e-40, "bf16")].startswith("rounded to a subnormal")
    # below the overflow threshold a format without inf rounds down to max: rounded, not an overflow
    near = json.loads(run("formats", "--value", "449", "-f", "fp8_e4m3", "--json").stdout)
    assert near[0]["stored"] == 448.0 and near[0]["outcome"].startswith("rounded")
    # strict JSON: inf as a string, not the bare Infinity that JSON parsers refuse
    infinite = run("formats", "--value", "inf", "-f", "fp16", "--json").stdout
    assert "Infinity" not in infinite and json.loads(infinite)[0]["stored"] == "inf"
    table = run("formats", "--value", "0.1").stdout
    assert "value 0.1" in table and "0.0999755859" in table  # fp16's 0.1


def test_policy_command(mixprec_cli):
    run = mixprec_cli
    listed = run("policy").stdout
    for preset in mixprec.PRESETS:
        assert preset in listed
    shown = json.loads(run("policy", "o2_bf16", "--json").stdout)
    assert shown["policy"] == str(mixprec.get_policy("o2_bf16"))
    assert shown["fp32_masters"] is True and shown["fp32_modules"] == ["norm"]
    auto = json.loads(run("policy", "auto", "--device", "cpu", "--json").stdout)
    assert auto["reason"] == mixprec.get_policy("auto", device="cpu").reason


def test_policy_command_says_which_of_a_tasks_gemm_layers_run_fp8(mixprec_cli):
    shown = json.loads(mixprec_cli("policy", "fp8", "--task", "charlm", "--size", "tiny", "--json").stdout)
    assert shown["fp8_layers"] == (
        "4 of 5 GEMM layers in FP8; kept: lm_head (Linear): kept by the recipe (head: the language-model head)"
    )
    shown = json.loads(mixprec_cli("policy", "mixed_bf16", "--task", "charlm", "--size", "tiny", "--json").stdout)
    assert shown["fp8_layers"] == "none: the policy has no FP8 recipe"
    done = mixprec_cli("policy", "fp8", "--task", "charlm", "--size", "huge")
    assert (
        done.returncode == 2
        and "argument --size: invalid choice: 'huge' (choose from 'default', 'tiny')" in done.stderr
    )


def test_demo_trains_under_each_policy(mixprec_cli):
    run = mixprec_cli
    result = run("demo", "--steps", "20", "--policies", "fp32,mixed_bf16,o2_fp16,pure_bf16")
    assert result.returncode == 0, result.stderr
    rows = [line.split() for line in result.stdout.splitlines() if " -> " in line]
    assert [row[0] for row in rows] == ["fp32", "mixed_bf16", "o2_fp16", "pure_bf16"]
    for row in rows:
        first, last = float(row[1]), float(row[3])  # "1.485 -> 0.408"
        assert last < first
    assert rows[2][8] == "65536"  # o2_fp16 has a dynamic loss scale (the loss column spans three tokens)
    assert [row[-1] for row in rows] == ["16.0", "16.0", "16.0", "12.0"]  # bytes of model state per parameter
    assert "fp8_e5m2" in result.stdout  # the formats table follows


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (("formats", "-f", "fp17"), ("mixprec formats: error:", "'fp17'", "Valid names")),
        (("formats", "--value", "abc"), ("invalid float value: 'abc'",)),
        (("policy", "mixed_fp8"), ("mixprec policy: error:", "unknown policy", "mixed_bf16")),
        (("policy", "p=bf16,q=1"), ("unknown key 'q'",)),
        (("policy", "mixed_bf16", "--device", "gpu0"), ("device='gpu0'",)),
        (("demo", "--steps", "3"), ("--steps must be at least 10; received 3",)),
        (("demo", "--policies", "fp32,bogus"), ("'bogus'", "unknown policy")),
        (("frobnicate",), ("invalid choice: 'frobnicate'",)),
        (("formats", "--nope"), ("unrecognized arguments: --nope",)),
    ],
)
def test_bad_input_is_one_line_and_exit_2(mixprec_cli, args, needles):
    assert_one_line_error(mixprec_cli(*args), *needles)


def test_policy_command_reads_a_policy_file(mixprec_cli, tmp_path):
    spec = "base=mixed_bf16,fp8=hybrid(scaling=current,only=*.mlp.*),fp32_names=lm_head"
    advice = mixprec.doctor.PolicyAdvice(spec, loss_scale=1024.0, reasons=("per-layer",))
    path = mixprec.doctor.write_policy_file(advice, tmp_path / "policy.json")
    shown = json.loads(mixprec_cli("policy", str(path), "--task", "charlm", "--size", "tiny", "--json").stdout)
    assert shown["policy"] == str(mixprec.get_policy(spec))
    assert shown["fp8_layers"].startswith("2 of 5 GEMM layers in FP8; kept: lm_head (Linear): inside an FP32 module")
    assert "blocks.0.attn.qkv (Linear): left out by the recipe (only=*.mlp.*)" in shown["fp8_layers"]
    assert shown["loss_scale"] == "1024 (the policy file's)"


def test_the_plan_says_fp4_for_the_fp4_recipes(mixprec_cli):
    shown = mixprec_cli("policy", "base=fp8,fp8=hybrid(scaling=mxfp4)", "--task", "charlm", "--size", "tiny")
    assert shown.returncode == 0, shown.stderr
    assert "4 of 5 GEMM layers in FP4; kept: lm_head" in shown.stdout
    assert "GEMM layers in FP4 emulated with FP32 arithmetic (fp4_e2m1 inputs, weights and gradients" in shown.stdout
