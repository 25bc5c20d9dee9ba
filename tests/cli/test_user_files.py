"""mixprec never writes over a file it did not write (issue 34, class 2): a folder is a run by the marker mixprec
wrote there, not by what is missing from it; a JSON file is written over only when mixprec wrote it."""

import json

import pytest
import torch
from torch import nn

import mixprec.app

STEPS = ("--steps", "2", "--quiet")


def _contents(folder):
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _user_folder(tmp_path):
    folder = tmp_path / "userdir"
    folder.mkdir()
    (folder / "config.json").write_text('{"my": 1}')
    (folder / "report.md").write_text("notes\n")
    return folder


def test_a_folder_of_the_users_files_is_refused_and_left_as_it_is(mixprec_cli, tmp_path):
    folder = _user_folder(tmp_path)
    before = _contents(folder)
    for command in (("train", "digits", "--out", folder, *STEPS), ("compare", "digits", "--out", folder, *STEPS)):
        finished = mixprec_cli(*command, cwd=tmp_path)
        assert finished.returncode == 2, finished.stderr
        assert "mixprec did not write" in finished.stderr and str(folder) in finished.stderr
        assert len(finished.stderr.strip().splitlines()) == 1
        assert _contents(folder) == before


def test_a_finished_run_without_its_checkpoints_is_not_written_over(mixprec_cli, tmp_path):
    run = tmp_path / "run"
    assert mixprec_cli("train", "digits", "--out", run, *STEPS, cwd=tmp_path).returncode == 0
    for checkpoint in (run / "checkpoints").iterdir():
        checkpoint.unlink()
    before = _contents(run)
    for resume in ((), ("--resume",)):
        finished = mixprec_cli("train", "digits", "--out", run, *STEPS, *resume, cwd=tmp_path)
        assert finished.returncode == 2, finished.stderr
        assert "finished run" in finished.stderr and "report.md" in finished.stderr
        assert _contents(run) == before


def test_an_empty_folder_becomes_a_run_and_a_run_from_before_the_marker_goes_on(mixprec_cli, tmp_path):
    run = tmp_path / "empty"
    run.mkdir()
    assert mixprec_cli("train", "digits", "--out", run, *STEPS, cwd=tmp_path).returncode == 0
    assert json.loads((run / ".mixprec").read_text()) == {"written_by": "mixprec", "holds": "a training run"}
    (run / ".mixprec").unlink()  # as a run written before the marker existed: known by its checkpoints
    (run / "notes.txt").write_text("mine")
    finished = mixprec_cli("train", "--out", run, "--resume", "--steps", "4", "--quiet", cwd=tmp_path)
    assert finished.returncode == 0, finished.stderr
    assert (run / "notes.txt").read_text() == "mine"


def test_a_folder_mixprec_wrote_for_something_else_is_refused(mixprec_cli, tmp_path):
    folder = tmp_path / "cmp"
    assert mixprec_cli("compare", "digits", "--policies", "fp32", "--out", folder, *STEPS, cwd=tmp_path).returncode == 0
    finished = mixprec_cli("train", "digits", "--out", folder, *STEPS, cwd=tmp_path)
    assert finished.returncode == 2
    assert "holds a comparison of policies, not a training run" in finished.stderr


def test_a_json_file_is_written_over_only_when_mixprec_wrote_it(mixprec_cli, tmp_path):
    mine = tmp_path / "advice.json"
    mine.write_text('{"policy": "fp32", "note": "my own"}')
    finished = mixprec_cli("doctor", "digits", "--steps", "2", "--apply", mine, cwd=tmp_path)
    assert finished.returncode == 2 and "--apply" in finished.stderr and "did not write" in finished.stderr
    assert json.loads(mine.read_text())["note"] == "my own"
    assert not (tmp_path / "runs").exists()  # refused before the diagnosis wrote anything

    ours = tmp_path / "ours.json"
    for _ in range(2):  # the second time over the file the first wrote
        assert mixprec_cli("doctor", "digits", "--steps", "2", "--apply", ours, cwd=tmp_path).returncode == 0
    assert json.loads(ours.read_text())["written_by"] == "mixprec"
    older = tmp_path / "older.json"  # an earlier doctor's, from before the stamp: its keys and source say so
    older.write_text('{"policy": "fp32", "loss_scale": null, "reasons": [], "source": "mixprec doctor digits"}')
    assert mixprec_cli("doctor", "digits", "--steps", "2", "--apply", older, cwd=tmp_path).returncode == 0

    results = tmp_path / "results"
    results.mkdir()
    (results / "bench_gemm.json").write_text("[1, 2]")
    finished = mixprec_cli("bench", "--suite", "gemm", "--quick", "--out", results, cwd=tmp_path)
    assert finished.returncode == 2 and "bench_gemm.json" in finished.stderr
    assert (results / "bench_gemm.json").read_text() == "[1, 2]"


def test_the_trainer_api_refuses_a_folder_of_the_users_files(tmp_path):
    folder = _user_folder(tmp_path)
    model = nn.Linear(4, 2)
    data = mixprec.app.TrainData([(torch.randn(8, 4), torch.randint(0, 2, (8,)))], None, nn.CrossEntropyLoss())
    with pytest.raises(ValueError, match=r"RunOptions\(out_dir=...\).*mixprec did not write"):
        mixprec.app.Trainer(
            model, torch.optim.SGD(model.parameters(), lr=0.1), data, "fp32", run=mixprec.app.RunOptions(out_dir=folder)
        )
    assert _contents(folder) == {"config.json": b'{"my": 1}', "report.md": b"notes\n"}


def test_files_of_another_kind_markers_and_folders_inside_a_run_are_refused(mixprec_cli, tmp_path):
    run = tmp_path / "run"
    assert mixprec_cli("train", "digits", "--out", run, *STEPS, cwd=tmp_path).returncode == 0
    advice = tmp_path / "advice.json"
    assert mixprec_cli("doctor", "digits", "--steps", "2", "--apply", advice, cwd=tmp_path).returncode == 0
    serve = ("serve-bench", run, "--batches", "1", "--latency-samples", "2", "--repeats", "1")
    cases = [
        ((*serve, "--json", advice), "mixprec wrote it as policy advice"),  # a policy file taken for results
        ((*serve, "--json", run / ".mixprec"), "marker"),  # the run's marker: the run could not be resumed
        (("doctor", "digits", "--steps", "2", "--apply", run / ".mixprec"), "marker"),
        (("train", "digits", "--out", run / "checkpoints" / "sub", *STEPS), "which holds a training run"),
    ]
    (run / "serve_bench.json").write_text('{"mine": 1}')  # the default path, the user's file
    cases.append((serve, "serve_bench.json: this file exists and mixprec did not write it"))
    before = _contents(tmp_path)
    for command, needle in cases:
        finished = mixprec_cli(*command, cwd=tmp_path)
        assert finished.returncode == 2 and needle in finished.stderr, (command, finished.stderr)
    assert _contents(tmp_path) == before

    (run / "export").mkdir()
    (run / "export" / "model-bf16.safetensors").write_text("mine")
    finished = mixprec_cli("export", run, cwd=tmp_path)
    assert finished.returncode == 2 and "mixprec did not write" in finished.stderr
    assert (run / "export" / "model-bf16.safetensors").read_text() == "mine"

    compared = tmp_path / "cmp"
    finished = mixprec_cli("compare", "digits", "--policies", "fp32", "--out", compared, *STEPS, cwd=tmp_path)
    assert finished.returncode == 0
    report = (compared / "report.md").read_bytes()
    finished = mixprec_cli("compare", "digits", "--policies", "mixed_bf16", "--out", compared, *STEPS, cwd=tmp_path)
    assert finished.returncode == 2 and "finished comparison" in finished.stderr
    assert (compared / "report.md").read_bytes() == report


def test_a_kernel_cache_folder_holding_the_users_file_is_left_alone(tmp_path):
    from mixprec.compute import kernel_plan

    (tmp_path / "kernels.json").write_text('{"my": "important data"}')
    plan = kernel_plan(torch.float16, timer=lambda family, candidate: 1.0, cache_dir=tmp_path)
    assert plan.source == "measured"
    assert (tmp_path / "kernels.json").read_text() == '{"my": "important data"}'
