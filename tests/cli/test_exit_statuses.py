"""Exit statuses mean one thing each (issue 34, class 5): 0 success, 2 a usage error, 1 a runtime failure,
128 + N a stop signal (tested with the signals themselves in test_train_cli.py and tests/distributed)."""

import subprocess
import sys
from pathlib import Path

MIXPREC = Path(sys.executable).with_name("mixprec")
TINY = ("--size", "tiny", "--steps", "2", "--quiet")

NAN_TASK = """
import torch
from torch import nn
from mixprec.app import TaskParts

def build(config):
    inputs = torch.full((8, 4), float("nan"))
    batches = [(inputs, torch.zeros(8, dtype=torch.long))] * 4
    return TaskParts(nn.Linear(4, 2), batches, batches, nn.CrossEntropyLoss(), description="NaN inputs")
"""


def test_success_and_usage_errors(mixprec_cli, tmp_path):
    assert mixprec_cli("train", "digits", "--out", tmp_path / "run", *TINY, cwd=tmp_path).returncode == 0
    for usage in (
        ("train", "digits", "--policy", "fp17", *TINY),  # a flag's value
        ("train", "digits", "--steps", "0"),  # refused by argparse
        ("train", "--out", tmp_path / "absent", "--resume"),  # a folder that is not a run
        ("train", "digits", "--out", tmp_path / "run", *TINY),  # a run there already
    ):
        finished = mixprec_cli(*usage, cwd=tmp_path)
        assert finished.returncode == 2, (usage, finished.stderr)


def test_a_batch_the_run_cannot_train_on_is_a_runtime_failure(mixprec_cli, tmp_path):
    (tmp_path / "nan_task.py").write_text(NAN_TASK)
    finished = mixprec_cli("train", "--model", "nan_task:build", "--out", tmp_path / "run", *TINY, cwd=tmp_path)
    assert finished.returncode == 1, finished.stderr
    assert "NaN or inf in its inputs" in finished.stderr and "--skip-bad-batches" in finished.stderr
    assert len(finished.stderr.strip().splitlines()) == 1


def test_a_checkpoint_that_cannot_be_written_is_a_runtime_failure(tmp_path):
    # a file size limit (Python ignores SIGXFSZ, so a write past it fails with EFBIG): config.json and the
    # metrics fit, the checkpoint does not; it used to exit 2, the usage-error status
    command = f"ulimit -f 64; exec {MIXPREC} train digits --out run --steps 3 --quiet"
    finished = subprocess.run(["bash", "-c", command], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert finished.returncode == 1, finished.stderr
    lines = finished.stderr.strip().splitlines()
    assert lines[-1].startswith("mixprec train: error:") and "step-00000003" in lines[-1], lines
    assert "Traceback" not in finished.stderr
