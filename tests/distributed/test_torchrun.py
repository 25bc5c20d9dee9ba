"""`mixprec train` launched by torchrun with 2 CPU processes (gloo, loopback): data parallel, one set of
files, and the same training as one process on the same global batch."""

import os
import re
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from mixprec.app.checkpoint import CheckpointError, list_checkpoints, load_checkpoint

BIN = Path(sys.executable).parent
REPO = Path(__file__).resolve().parents[2]
ARGS = ["train", "charlm", "--size", "tiny", "--policy", "mixed_bf16", "--quiet"]  # no batch norm


def _run(command, timeout=150):
    import subprocess

    return subprocess.run(command, capture_output=True, text=True, timeout=timeout, cwd=REPO, check=False)


def _torchrun(*args, ranks=2):
    return _run(
        [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", str(ranks), "-m", "mixprec", *map(str, args)]
    )


def _weights(run_dir: Path) -> dict[str, torch.Tensor]:
    newest = list_checkpoints(run_dir / "checkpoints")[-1]
    return load_checkpoint(newest)["model"]


def test_torchrun_trains_data_parallel_and_resumes(tmp_path):
    result = _torchrun(*ARGS, "--steps", 6, "--out", tmp_path / "ddp")
    assert result.returncode == 0, result.stderr[-2000:]
    assert len(re.findall(r"^processes +2, data parallel \(DDP\)$", result.stdout, re.M)) == 1  # one summary: rank 0
    assert [p.name for p in list_checkpoints(tmp_path / "ddp" / "checkpoints")] == ["step-00000006.safetensors"]

    single = _run([str(BIN / "mixprec"), *ARGS, "--steps", "6", "--out", str(tmp_path / "one")])
    assert single.returncode == 0, single.stderr[-2000:]
    ddp, one = _weights(tmp_path / "ddp"), _weights(tmp_path / "one")
    close = total = 0
    for name, value in one.items():
        # Two half-batch bf16 GEMMs round differently from one full-batch GEMM. AdamW moves a weight by
        # about lr (1e-3) per step whatever the gradient's size, so where a gradient is near zero the
        # rounding can flip an update: after 6 steps no weight may differ by more than 6 x lr.
        torch.testing.assert_close(ddp[name], value, rtol=0, atol=6e-3)
        close += int(((ddp[name] - value).abs() <= 1e-4).sum())
        total += value.numel()
    assert close / total > 0.95  # nearly all weights agree to 1e-4

    # resuming under torchrun: test_sigterm_under_torchrun_stops_every_rank_after_the_same_update


def test_a_batch_smaller_than_the_world_is_dropped_and_an_uneven_one_cut(tmp_path):
    # digits' 1437 training images in batches of 718 leave a last batch of 1: rank 1's slice of it was empty,
    # its mean loss NaN, and the run died at the epoch's end blaming the loss function
    args = ["train", "digits", "--size", "tiny", "--batch-size", 718, "--epochs", 1, "--quiet"]
    result = _torchrun(*args, "--out", tmp_path / "dropped")
    assert result.returncode == 0, result.stderr[-2000:]
    said = re.findall(r"batch 3 of epoch 0 has 1 samples for 2 ranks: dropped", result.stderr)
    assert len(said) == 1, result.stderr[-2000:]  # once, by rank 0
    result = _torchrun(*args[:5], 719, "--steps", 1, "--quiet", "--out", tmp_path / "cut")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "batch 1 of epoch 0 has 719 samples for 2 ranks: 1 of them dropped" in result.stderr


def test_torchrun_shards_with_fsdp2_under_an_o2_policy_and_resumes_on_any_number_of_ranks(tmp_path):
    args = ["train", "charlm", "--size", "tiny", "--policy", "o2_bf16", "--parallel", "fsdp", "--reduce-fp32"]
    result = _torchrun(*args, "--quiet", "--steps", 4, "--checkpoint-every", 2, "--out", tmp_path / "fsdp")
    assert result.returncode == 0, result.stderr[-2000:]
    assert len(re.findall(r"^processes +2, data parallel \(FSDP2\)$", result.stdout, re.M)) == 1
    checkpoints = list_checkpoints(tmp_path / "fsdp" / "checkpoints")
    assert [p.name for p in checkpoints] == ["step-00000002.sharded", "step-00000004.sharded"]
    shard_files = sorted(p.name for p in (checkpoints[-1] / "shards").iterdir())
    assert len(shard_files) == 2, shard_files  # each rank wrote its own shards: nothing was gathered
    state = load_checkpoint(checkpoints[-1])
    assert state["sharded"] and state["mixed_precision"]["masters"] == []  # the FP32 shards are the masters
    assert "model.embed.weight" in state["shards"].names
    # each rank checksums its share of the shard files and the ranks agree on the verdict: a damaged second
    # file is rank 1's to find, and both ranks resume from the older checkpoint
    damaged = checkpoints[-1] / "shards" / shard_files[1]
    data = bytearray(damaged.read_bytes())
    data[len(data) // 2] ^= 0x01
    damaged.write_bytes(bytes(data))
    assert load_checkpoint(checkpoints[-1], share=(0, 2))["sharded"]  # rank 0's share: the first file only
    with pytest.raises(CheckpointError, match=f"checksum mismatch in shards/{shard_files[1]}"):
        load_checkpoint(checkpoints[-1], share=(1, 2))
    resumed = _torchrun("train", "--out", tmp_path / "fsdp", "--resume", "--steps", 6, "--quiet")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    skipped = [line for line in resumed.stderr.splitlines() if "Skipped a checkpoint" in line]
    assert len(skipped) == 1 and "using step-00000002.sharded" in skipped[0], resumed.stderr[-2000:]
    assert f"checksum mismatch in shards/{shard_files[1]}" in skipped[0]  # found by rank 1, said by rank 0
    assert list_checkpoints(tmp_path / "fsdp" / "checkpoints")[-1].name == "step-00000006.sharded"
    # one process (no torchrun: FSDP2 in a group of one) reads both ranks' shards, resharded 2 -> 1, and goes on
    alone = _run(
        [str(BIN / "mixprec"), "train", "--out", str(tmp_path / "fsdp"), "--resume", "--steps", "8", "--quiet"]
    )
    assert alone.returncode == 0, alone.stderr[-2000:]
    newest = list_checkpoints(tmp_path / "fsdp" / "checkpoints")[-1]
    assert newest.name == "step-00000008.sharded" and len(list((newest / "shards").iterdir())) == 1
    # and two ranks read the one rank's checkpoint, resharded 1 -> 2
    again = _torchrun("train", "--out", tmp_path / "fsdp", "--resume", "--steps", 10, "--quiet")
    assert again.returncode == 0, again.stderr[-2000:]
    assert list_checkpoints(tmp_path / "fsdp" / "checkpoints")[-1].name == "step-00000010.sharded"
    exported = _run([str(BIN / "mixprec"), "export", str(tmp_path / "fsdp"), "--dtype", "bf16"])
    assert exported.returncode == 0, exported.stderr[-2000:]
    whole = load_file(str(tmp_path / "fsdp" / "export" / "model-fp32.safetensors"))
    assert whole["embed.weight"].shape[0] == 256 and whole["embed.weight"].dtype == torch.float32  # all 256 rows


def test_sigterm_under_torchrun_stops_every_rank_after_the_same_update(tmp_path):
    """SIGTERM (preemption) reaches torchrun, which forwards it to its workers; they stop after the same
    update with one checkpoint, and resuming from it equals the straight run bit for bit. (Ctrl-C to the
    whole process group takes the same path: the ranks agree on the first signal any of them saw.)"""
    import signal
    import subprocess
    import time

    out = tmp_path / "interrupted"
    command = [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "2", "-m", "mixprec", *ARGS]
    command += ["--steps", "120", "--log-every", "1", "--out", str(out)]  # stopped within its first steps
    process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True)  # fmt: skip
    deadline = time.monotonic() + 120
    while not (out / "metrics.jsonl").is_file() and time.monotonic() < deadline and process.poll() is None:
        time.sleep(0.05)
    process.send_signal(signal.SIGTERM)  # what a scheduler does: the launcher forwards it
    _, stderr = process.communicate(timeout=120)
    stopped = re.findall(r"mixprec train: interrupted by SIGTERM at step (\d+); checkpoint saved", stderr)
    assert len(stopped) == 1, stderr[-3000:]  # rank 0 saved and said so, once
    assert "mixprec train: interrupted" in stderr and stderr.count("mixprec train: interrupted") == 1
    step = int(stopped[0])
    assert 0 < step < 120 and [p.name for p in list_checkpoints(out / "checkpoints")] == [
        f"step-{step:08d}.safetensors"
    ]
    resumed = _torchrun("train", "--out", out, "--resume", "--quiet")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert list_checkpoints(out / "checkpoints")[-1].name == "step-00000120.safetensors"
    straight = _torchrun(*ARGS, "--steps", 120, "--out", tmp_path / "straight")  # the same LR schedule
    assert straight.returncode == 0, straight.stderr[-2000:]
    for name, value in _weights(tmp_path / "straight").items():
        assert torch.equal(value, _weights(out)[name]), name


def _worker_pid(launcher: int, rank: int) -> int | None:
    """The pid of torchrun's worker with this RANK (a child of the launcher), or None before it started."""
    for process in Path("/proc").glob("[0-9]*"):
        try:
            parent = int((process / "stat").read_text().rsplit(")", 1)[1].split()[1])
            environ = (process / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):  # gone meanwhile
            continue
        if parent == launcher and f"RANK={rank}".encode() in environ:
            return int(process.name)
    return None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds torchrun's workers in /proc (Linux)")
def test_a_hung_peer_stops_the_run_after_the_collective_timeout_with_a_resume_line(tmp_path):
    """A peer that hangs (here: SIGSTOP) keeps its connections open, so the others learn of it only when a
    collective times out: --collective-timeout 5 ends rank 0 with one line seconds later, not 30 minutes."""
    import signal
    import subprocess
    import time

    out = tmp_path / "run"
    command = [str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "2", "-m", "mixprec", *ARGS]
    command += ["--steps", "400", "--checkpoint-every", "1", "--collective-timeout", "5", "--out", str(out)]
    log = tmp_path / "stderr"
    with log.open("w") as stderr:
        process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.DEVNULL, stderr=stderr)
    deadline = time.monotonic() + 120
    while not list_checkpoints(out / "checkpoints") and time.monotonic() < deadline and process.poll() is None:
        time.sleep(0.05)
    hung = _worker_pid(process.pid, rank=1)
    assert hung is not None and process.poll() is None, log.read_text()[-3000:]
    os.kill(hung, signal.SIGSTOP)
    stopped_at = time.monotonic()
    said = []
    while not said and time.monotonic() < stopped_at + 60:
        time.sleep(0.1)
        said = [line for line in log.read_text().splitlines() if "mixprec train: error:" in line]
    waited = time.monotonic() - stopped_at
    os.kill(hung, signal.SIGKILL)  # torchrun would wait 30 s for a stopped worker to take its SIGTERM
    process.wait(timeout=60)
    assert len(said) == 1 and process.returncode != 0, log.read_text()[-3000:]
    assert waited < 30, waited  # the 5 s timeout, plus the time to say so
    assert "a process of this distributed run failed or became unreachable" in said[0]
    assert re.search(r"the last complete checkpoint is step-\d{8}\.safetensors", said[0]), said[0]
    assert f"Resume on every node with: mixprec train --out {out} --resume" in said[0]
