"""Sharded checkpoints (FSDP2) under tampering: every damaged part is refused with one line naming it,
and resuming falls back to the previous checkpoint; a killed writer's staging folder is never taken for
a checkpoint. The run is one process (FSDP2 in a group of one), which writes the same folder format as
N ranks; resharding across world sizes: tests/distributed/test_torchrun.py."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mixprec.app.checkpoint import CheckpointError, list_checkpoints, load_checkpoint, load_latest

MIXPREC = str(Path(sys.executable).with_name("mixprec"))
REPO = Path(__file__).resolve().parents[2]


def _mixprec(*args):
    command = [MIXPREC, *map(str, args)]
    return subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=REPO, check=False)


@pytest.fixture(scope="module")
def sharded_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("sharded") / "run"
    args = ["train", "charlm", "--size", "tiny", "--policy", "o2_bf16", "--parallel", "fsdp"]
    done = _mixprec(*args, "--steps", 4, "--checkpoint-every", 2, "--quiet", "--out", out)
    assert done.returncode == 0, done.stderr[-2000:]
    return out


def _copy(run: Path, tmp_path: Path) -> tuple[Path, Path]:
    """A copy of the run, and its newest checkpoint (step 4; step 2 is the older one)."""
    shutil.copytree(run, tmp_path / "run")
    newest = list_checkpoints(tmp_path / "run" / "checkpoints")[-1]
    assert newest.name == "step-00000004.sharded"
    return tmp_path / "run", newest


def _shard(folder: Path) -> Path:
    return sorted((folder / "shards").iterdir())[0]


def _flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def _rename_to_step_5(folder: Path) -> Path:
    return folder.rename(folder.with_name("step-00000005.sharded"))


TAMPERINGS = {  # name -> (damage, which returns the damaged checkpoint's path, the reason said)
    "a byte flipped in a shard": (lambda f: _flip_a_byte(_shard(f)) or f, "checksum mismatch in shards/shard-"),
    "a shard deleted": (lambda f: _shard(f).unlink() or f, "shard files missing"),
    "a stranger among the shards": (
        lambda f: shutil.copy(_shard(f), f / "shards" / "extra.safetensors") and f,
        r"not of this checkpoint \['extra.safetensors'\]",
    ),
    "the state file deleted": (lambda f: (f / "state.safetensors").unlink() or f, "no such checkpoint file"),
    "a byte flipped in the state file": (lambda f: _flip_a_byte(f / "state.safetensors") or f, "state.safetensors"),
    "the folder renamed to another step": (_rename_to_step_5, "not the step its name says"),
}


@pytest.mark.parametrize("tampering", list(TAMPERINGS))
def test_a_tampered_sharded_checkpoint_is_refused_and_the_older_one_is_used(sharded_run, tmp_path, tampering):
    damage, reason = TAMPERINGS[tampering]
    run, newest = _copy(sharded_run, tmp_path)
    damaged = damage(newest)
    with pytest.raises(CheckpointError, match=reason):
        load_checkpoint(damaged)
    path, state = load_latest(run / "checkpoints")
    assert path.name == "step-00000002.sharded" and state["position"]["step"] == 2


def test_resume_skips_a_damaged_shard_with_one_line_and_a_staging_folder_is_no_checkpoint(sharded_run, tmp_path):
    run, newest = _copy(sharded_run, tmp_path)
    _flip_a_byte(_shard(newest))
    staging = run / "checkpoints" / ".step-00000008.sharded.tmp"  # a writer killed before publishing
    shutil.copytree(newest, staging)
    assert [p.name for p in list_checkpoints(run / "checkpoints")] == ["step-00000002.sharded", newest.name]
    done = _mixprec("train", "--out", run, "--resume", "--steps", 4, "--quiet")
    assert done.returncode == 0, done.stderr[-2000:]
    skipped = [line for line in done.stderr.splitlines() if "Skipped a checkpoint" in line]
    assert len(skipped) == 1 and "step-00000004.sharded" in skipped[0] and "using step-00000002" in skipped[0]
    assert list_checkpoints(run / "checkpoints")[-1].name == "step-00000004.sharded"  # trained again from 2
    assert not staging.exists()  # the next save cleared what the killed writer left


def test_a_pure_bf16_run_with_fp32_modules_resumes_from_its_sharded_checkpoint(tmp_path):
    # bf16 shards with compensations and FP32 LayerNorms in one optimizer: torch.distributed.checkpoint loads
    # into every parameter's state (compensations given at construction once left the FP32 ones without any:
    # "Missing optimizer state" / KeyError on resume)
    out = tmp_path / "run"
    policy = "base=pure_bf16,fp32_modules=LayerNorm"
    first = _mixprec("train", "charlm", "--size", "tiny", "--policy", policy, "--parallel", "fsdp", "--steps", 2,
                     "--checkpoint-every", 2, "--quiet", "--out", out)  # fmt: skip
    assert first.returncode == 0, first.stderr[-2000:]
    resumed = _mixprec("train", "--out", out, "--resume", "--steps", 4, "--quiet")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert load_latest(out / "checkpoints")[0].name == "step-00000004.sharded"
