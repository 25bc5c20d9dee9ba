"""The GPU check (scripts/gpu_check.sh, benchmarks/gpu/): its CPU dry run end to end, so that the
command a GPU session will run first cannot rot, and the pieces whose GPU side CI cannot reach."""

import ast
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

REPO = Path(__file__).resolve().parents[2]
PARTS = ["tests", "syncs", "gpt", "fp8", "fp8gpt", "bert", "gpt2", "profile", "tuned"]


@pytest.fixture
def gpu_check(monkeypatch):
    """The package benchmarks.gpu, importable from the repository root."""
    monkeypatch.syspath_prepend(str(REPO))
    import benchmarks.gpu.__main__ as entry

    return entry


def _by(records: list[dict], key: str) -> dict:
    return {record[key]: record for record in records}


def test_the_dry_run_runs_every_part_or_says_why_not(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable}
    # fixed kernel choices: the CPU kernel probe is not what this checks, and costs seconds per dtype
    env.update(MIXPREC_BF16_CPU="native", MIXPREC_FP16_CPU="emulate")
    done = subprocess.run(
        ["bash", "scripts/gpu_check.sh", "--dry-run", "--out", str(tmp_path)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    for part in PARTS:
        assert f"part {part}: start" in done.stdout
    folder = tmp_path / "cpu-dry-run"
    results = json.loads((folder / "gpu_check.json").read_text())
    assert results["dry_run"] is True and list(results["parts"]) == PARTS
    for name, part in results["parts"].items():
        assert part["status"] in ("ok", "skipped"), (name, part["reason"], part["error"], part["records"][:3])
        assert part["status"] == "ok" or part["reason"], name  # a skip says why
        assert part["seconds"] >= 0 and part["torch"]
        assert part["status"] == "skipped" or part["records"], name
        assert not [r for r in part["records"] if "error" in r], name
        assert all(n["reason"] for n in part["not_run"]), name
    parts = results["parts"]
    assert "no CUDA" in parts["tests"]["reason"]
    _check_syncs(parts["syncs"])
    _check_gpt(parts["gpt"])
    _check_gpt(parts["gpt2"])
    _check_fp8(parts["fp8"])
    _check_fp8_gpt(parts["fp8gpt"])
    _check_tuned(parts["tuned"])
    _check_bert(parts["bert"])
    _check_profile(parts["profile"], folder)
    summary = (folder / "summary.md").read_text()
    assert all(f"## {name}: " in summary for name in PARTS) and "Dry run" in summary


def _check_syncs(part: dict) -> None:
    cases = {(r["model"], r["policy"], r["optimizer"]) for r in part["records"]}
    for model in ("TinyGPT", "BERT-base, 2 layers", "GPT-2, 2 layers"):  # every model the check times
        wanted = [("mixed_bf16", "fused"), ("mixed_fp16", "default"), ("o2_bf16", "fused"), ("pure_bf16", "mixprec")]
        assert {(model, *case) for case in wanted} <= cases, model
    assert "needs CUDA" in part["meta"]["note"]
    for record in part["records"]:  # the steps ran; counting is CUDA's
        assert record["syncs_per_step"] is None and record["steps_counted"] > 0 and record["goal"] in (0, 1)


def _check_gpt(part: dict) -> None:
    modes = _by(part["records"], "mode")
    assert {"torch fp32", "torch autocast bf16", "fp32", "mixed_bf16", "fp8", "mixed_bf16, compiled"} <= set(modes)
    for record in modes.values():
        assert record["median_ms"] > 0 and record["tokens_per_s"] > 0 and record["first_call_s"] > 0
        assert record["mfu"] is None  # no peak on a CPU, and the meta says so
    assert modes["mixed_bf16"]["twin"] == "torch autocast bf16" and modes["mixed_bf16"]["vs_twin"] > 0
    assert "torch bf16 weights" in modes  # pure_bf16's twin, timed beside it on a GPU
    assert all(r["host_ms_per_step"] > 0 and r["kernels_per_step"] is None for r in modes.values())  # no CUDA
    assert modes["mixed_bf16, compiled"]["compiled"] is True
    assert part["meta"]["params"] > 0 and "omitted" in part["meta"]["mfu_note"]


def _check_fp8_gpt(part: dict) -> None:
    modes = _by(part["records"], "mode")
    assert {"torch autocast bf16", "mixed_bf16", "fp8", "fp8 delayed", "fp8, compiled cast"} <= set(modes)
    for record in modes.values():
        assert record["median_ms"] > 0 and record["tokens_per_s"] > 0
    assert modes["fp8"]["twin"] == "torch autocast bf16" and modes["fp8"]["vs_twin"] > 0
    assert modes["fp8"]["compute_plan"] == modes["fp8, compiled cast"]["compute_plan"]
    left_out = " ".join(n["case"] for n in part["not_run"])
    assert "compiled rows" in left_out and ("torchao" in left_out or "torchao" in part["meta"])


def _check_tuned(part: dict) -> None:
    rows = part["records"]
    assert any("uniform base" in r["mode"] for r in rows) and any("uniform FP32" in r["mode"] for r in rows)
    for record in rows:
        assert record["median_ms"] > 0 and record["measured"] > 0 and record["predicted"] > 0
    assert any("(chosen)" in r["mode"] for r in rows)


def _check_fp8(part: dict) -> None:
    exact = [r for r in part["records"] if r["case"] == "exact sums"]
    assert len(exact) >= 3 and all(r["emulation_exact"] for r in exact)
    assert all(r.get("kernel_equals_emulation", True) for r in exact)
    bounded = [r for r in part["records"] if r["case"] == "FP32 accumulation bound"]
    assert bounded and 0 <= bounded[0]["emulation_error_over_bound"] <= 1
    assert [n["case"] for n in part["not_run"]] == ["throughput"]


def _check_bert(part: dict) -> None:
    for phase in ("training", "inference"):
        records = [r for r in part["records"] if r["phase"] == phase]
        assert {r["batch"] for r in records} == {1, 2}
        training = {"o2_bf16", "pure_bf16", "torch fp32", "torch autocast fp16", "torch autocast bf16"}
        training |= {"torch bf16 weights", "bf16, compiled"}
        modes = {"fp32", "tf32", "fp16", "bf16"} | (training if phase == "training" else set())
        assert {r["mode"] for r in records} == modes
        assert all(r["samples_per_s"] > 0 and r["speedup_vs_fp32"] > 0 for r in records)
    twins = ("fp32", "fp16", "bf16", "o2_bf16", "pure_bf16")
    twinned = [r for r in part["records"] if r["phase"] == "training" and r["mode"] in twins]
    assert len(twinned) == 10 and all(r["vs_torch_loop"] > 0 for r in twinned)  # 5 modes x 2 batches
    assert all(r["host_ms_per_step"] > 0 for r in part["records"] if r["phase"] == "training")
    assert [n["case"] for n in part["not_run"]] == ["inference, CUDA graph"]


def test_a_failing_part_is_recorded_and_the_next_part_still_runs(gpu_check, monkeypatch, tmp_path, capsys):
    def broken(settings, part):
        raise ZeroDivisionError("made to fail")

    monkeypatch.setitem(gpu_check.PARTS, "syncs", broken)
    status = gpu_check.main(["--dry-run", "--out", str(tmp_path), "--parts", "syncs,tests"])
    assert status == 1
    parts = json.loads((tmp_path / "cpu-dry-run" / "gpu_check.json").read_text())["parts"]
    assert parts["syncs"]["status"] == "failed" and parts["syncs"]["error"]["type"] == "ZeroDivisionError"
    assert parts["tests"]["status"] == "skipped"
    assert "ZeroDivisionError: made to fail" in (tmp_path / "cpu-dry-run" / "summary.md").read_text()
    assert "part syncs: failed" in capsys.readouterr().out
    # a later run of another part keeps what the folder already holds
    monkeypatch.setitem(gpu_check.PARTS, "fp8", lambda settings, part: part.records.append({"case": "x"}))
    assert gpu_check.main(["--dry-run", "--out", str(tmp_path), "--parts", "fp8"]) == 0
    parts = json.loads((tmp_path / "cpu-dry-run" / "gpu_check.json").read_text())["parts"]
    assert list(parts) == ["tests", "syncs", "fp8"] and parts["syncs"]["status"] == "failed"


def test_a_failing_case_fails_its_part_and_keeps_the_error(gpu_check):
    from benchmarks.gpu.common import Part

    part = Part("fp8")
    part.case({"case": "fine"}, lambda: {"value": 1.0})
    part.case({"case": "broken"}, lambda: 1 / 0)
    part.settle()
    assert part.status == "failed" and part.reason == "1 of 2 cases failed"
    assert part.records[1]["error"]["type"] == "ZeroDivisionError" and part.records[1]["error"]["where"]


def test_unknown_parts_and_a_missing_gpu_are_usage_errors(gpu_check, capsys):
    with pytest.raises(SystemExit) as exit_info:
        gpu_check.main(["--dry-run", "--parts", "gpt,speed"])
    assert exit_info.value.code == 2 and "--parts: received ['speed']; use names from tests" in capsys.readouterr().err
    if not gpu_check.torch.cuda.is_available():
        with pytest.raises(SystemExit):
            gpu_check.main(["--parts", "fp8"])
        assert "no CUDA device here" in capsys.readouterr().err


def test_mfu_peaks_by_device_name(gpu_check):
    from benchmarks.gpu.common import bf16_peak_flops

    assert bf16_peak_flops("NVIDIA H100 80GB HBM3")[0] == 989e12
    assert bf16_peak_flops("NVIDIA H100 PCIe")[0] == 756e12
    assert bf16_peak_flops("NVIDIA H200")[0] == 989e12
    peak, reason = bf16_peak_flops("NVIDIA GeForce RTX 3050")
    assert peak is None and "MFU omitted" in reason


def test_the_cuda_cases_are_selected_by_marker_id_or_parameter(gpu_check):
    import torch
    from benchmarks.gpu.pytest_cuda import is_cuda_case

    def item(name, marker=None, **params):
        marks = {marker: object()} if marker else {}
        return SimpleNamespace(name=name, get_closest_marker=marks.get, callspec=SimpleNamespace(params=params))

    assert is_cuda_case(item("test_a[cuda]", device="cuda"))
    assert is_cuda_case(item("test_b[device1]", device=torch.device("cuda", 0)))
    assert is_cuda_case(item("test_c", marker="cuda"))
    assert not is_cuda_case(item("test_a[cpu]", device="cpu"))
    assert not is_cuda_case(item("test_d[device0]", device=torch.device("cpu")))


def test_junit_counts(gpu_check, tmp_path):
    from benchmarks.gpu.part_tests import junit_counts

    xml = tmp_path / "junit.xml"
    xml.write_text(
        '<testsuites><testsuite tests="4" failures="1" errors="0" skipped="2">'
        '<testcase classname="tests.unit.test_x" name="test_a[cuda]"/>'
        '<testcase classname="tests.unit.test_x" name="test_b[cuda]"><failure message="assert 1 == 2&#10;more"/>'
        '</testcase><testcase classname="t" name="c"><skipped message="needs 2 GPUs"/></testcase>'
        '<testcase classname="t" name="d"><skipped message="needs 2 GPUs"/></testcase></testsuite></testsuites>'
    )
    counts = junit_counts(xml)
    assert (counts["tests"], counts["passed"], counts["failures"], counts["skipped"]) == (4, 1, 1, 2)
    assert counts["failing"] == ["failure: tests.unit.test_x::test_b[cuda]: assert 1 == 2"]
    assert counts["skip_reasons"] == {"needs 2 GPUs": 2}


@pytest.mark.parametrize("path", sorted((REPO / "benchmarks" / "gpu").glob("*.py")), ids=lambda p: p.name)
def test_no_function_of_the_check_is_longer_than_sixty_lines(path):
    long = [
        f"{node.name} (line {node.lineno})"
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.FunctionDef) and node.end_lineno - node.lineno + 1 > 60
    ]
    assert not long


def test_test_files_needing_a_missing_package_are_named(gpu_check, tmp_path):
    from benchmarks.gpu.part_tests import missing_imports

    tests = tmp_path / "tests"
    (tests / "unit").mkdir(parents=True)
    (tests / "unit" / "test_fine.py").write_text("import torch\nfrom helper import x\n")
    (tests / "unit" / "helper.py").write_text("x = 1\n")
    (tests / "unit" / "test_needs.py").write_text("import torch\nfrom not_installed_anywhere.sub import y\n")
    (tests / "unit" / "test_lazy.py").write_text("def test_a():\n    import not_installed_anywhere\n")
    assert missing_imports(tests) == {"tests/unit/test_needs.py": "not_installed_anywhere"}


def test_syncs_are_counted_per_source_line_and_the_debug_mode_restored(gpu_check, monkeypatch):
    # torch's sync debug mode needs CUDA; stand-ins record the mode, and the step warns as torch would
    import warnings

    import torch
    from benchmarks.gpu.part_syncs import count_syncs

    modes = []
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)

    def step():
        warnings.warn("called a synchronizing CUDA operation", stacklevel=1)
        warnings.warn("an unrelated warning", stacklevel=1)

    sites = count_syncs(step, 3, REPO)
    assert modes == ["warn", 0]
    assert len(sites) == 1 and sum(sites.values()) == 3  # the same line every step: counted every time
    assert next(iter(sites)).startswith("tests/unit/test_gpu_check.py:")


def test_a_part_that_would_not_fit_in_the_time_left_is_not_started_and_says_so(gpu_check, tmp_path, capsys):
    # the GPU machine stops a command at 10 minutes: a part started too late would leave nothing behind
    status = gpu_check.main(["--dry-run", "--out", str(tmp_path), "--parts", "fp8", "--time-limit", "5"])
    assert status == 1
    fp8 = json.loads((tmp_path / "cpu-dry-run" / "gpu_check.json").read_text())["parts"]["fp8"]
    assert fp8["status"] == "skipped" and fp8["reason"].startswith("not started: 5 s left of the time limit")
    assert "--parts fp8" in fp8["reason"] and "part fp8: not started" in capsys.readouterr().out


def test_a_sigterm_mid_part_keeps_the_cases_that_finished_and_stops_the_run(gpu_check, monkeypatch, tmp_path):
    import signal

    def interrupted(settings, part):
        part.case({"case": "first"}, lambda: {"value": 1.0})
        # saved already, before the part ends: a SIGKILL from here on would still leave this case on disk
        saved = json.loads((tmp_path / "cpu-dry-run" / "gpu_check.json").read_text())["parts"]["fp8"]
        assert saved["status"] == "unfinished" and saved["records"] == [{"case": "first", "value": 1.0}]
        os.kill(os.getpid(), signal.SIGTERM)  # the device machine's time limit
        part.case({"case": "second"}, lambda: {"value": 2.0})

    monkeypatch.setitem(gpu_check.PARTS, "fp8", interrupted)
    before = signal.getsignal(signal.SIGTERM)
    assert gpu_check.main(["--dry-run", "--out", str(tmp_path), "--parts", "fp8,bert"]) == 1
    assert signal.getsignal(signal.SIGTERM) is before  # restored
    parts = json.loads((tmp_path / "cpu-dry-run" / "gpu_check.json").read_text())["parts"]
    assert list(parts) == ["fp8"]  # bert never started
    assert parts["fp8"]["status"] == "failed" and parts["fp8"]["reason"].startswith("stopped by SIGTERM")
    assert parts["fp8"]["records"] == [{"case": "first", "value": 1.0}]
    assert "stopped by SIGTERM" in (tmp_path / "cpu-dry-run" / "summary.md").read_text()


def test_pytest_stopped_at_the_time_limit_still_reports_the_cases_it_ran(gpu_check, tmp_path):
    from benchmarks.gpu.part_tests import _pytest, junit_counts

    (tmp_path / "test_slow.py").write_text(
        "import time\n\ndef test_quick():\n    pass\n\ndef test_slow():\n    time.sleep(120)\n"
    )
    xml = tmp_path / "junit.xml"
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}", "test_slow.py"]
    output, code, stopped = _pytest(command, tmp_path, dict(os.environ), limit=8.0)
    assert code == 2, output  # pytest's exit code when interrupted
    assert stopped and "time limit (8 s" in stopped, output
    assert xml.exists(), output  # SIGINT: pytest wrote its report of what ran
    counts = junit_counts(xml)
    assert counts["passed"] == 1 and counts["failures"] == 0, counts


def test_a_mode_that_fails_does_not_cut_the_others_repeats(gpu_check):
    from benchmarks.gpu.measure import Prepared, time_modes
    from benchmarks.gpu.steps import Mode

    calls = {"fine": 0, "broken": 0}

    def fine():
        calls["fine"] += 1
        time.sleep(0.005)  # over 10x the failed mode's instant return: the slow-mode cut would drop it

    def broken():
        calls["broken"] += 1
        if calls["broken"] > 2:  # fails from the first timed round on: later calls return at once
            raise RuntimeError("made to fail")

    prepared = [
        Prepared(Mode(name, None, False), step, None, {}) for name, step in (("fine", fine), ("broken", broken))
    ]
    timings, failed = time_modes(prepared, repeats=6, warmup=2)
    assert list(failed) == ["broken"] and failed["broken"]["type"] == "RuntimeError"
    assert timings["fine"].repeats == 6 and calls["fine"] == 8


def _check_profile(part: dict, folder) -> None:
    # the device profile mixprec tune reads, timed per shape and format, and written beside the results
    from mixprec.app.tune.cost import DeviceProfile

    shapes = {"32x16x48", "32x48x16", "sdpa:1x2x2x16x8:causal"}
    assert {(r["base"], r["shape"]) for r in part["records"]} == {
        (b, s) for b in ("mixed_bf16", "mixed_fp16") for s in shapes
    }
    formats = {  # an fp16 base's profile times bf16 too (bf16_names), but for attention (an op, not a module)
        ("mixed_bf16", "GEMM"): ("fp32", "16", "fp8"),
        ("mixed_fp16", "GEMM"): ("fp32", "16", "fp8", "bf16"),
        ("mixed_bf16", "attention"): ("fp32", "16"),
        ("mixed_fp16", "attention"): ("fp32", "16"),
    }
    for record in part["records"]:
        kind = "attention" if record["shape"].startswith("sdpa:") else "GEMM"
        assert {key for key in record if key.endswith("_ms")} == {f"{fmt}_ms" for fmt in formats[record["base"], kind]}
        assert all(record[f"{fmt}_ms"] > 0 for fmt in formats[record["base"], kind])
    for name, base in (("device_profile.json", "mixed_bf16"), ("device_profile_fp16.json", "mixed_fp16")):
        profile = DeviceProfile.load(folder / name)
        assert profile.base == base and set(profile.entries) == shapes


def test_a_mixprec_row_names_the_kernels_it_launches_beyond_its_hand_written_twin():
    from benchmarks.gpu.measure import add_beyond_twin

    records = [
        {"mode": "torch autocast bf16", "kernel_counts": {"gemm": [10.0, 30.0], "add": [0.5, 20.0]}},
        {
            "mode": "mixed_bf16",
            "kernel_counts": {"gemm": [10.001, 30.0], "add": [0.5, 20.0], "foreach_norm": [0.3, 2.0]},
        },
        {"mode": "fp8", "kernel_counts": {"gemm": [12.0, 30.0]}},  # its twin was not profiled: nothing said
    ]
    add_beyond_twin(records, {"mixed_bf16": "torch autocast bf16", "fp8": "torch autocast bf16 compiled"})
    assert records[1]["beyond_twin"] == [{"kernel": "foreach_norm", "extra_ms": 0.3, "extra_launches": 2.0}]
    assert "beyond_twin" not in records[0] and "beyond_twin" not in records[2]
