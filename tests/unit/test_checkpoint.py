import errno
import logging
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from safetensors.torch import save_file

from mixprec.app.checkpoint import (
    CheckpointError,
    list_checkpoints,
    load_checkpoint,
    load_latest,
    save_checkpoint,
    save_sharded_checkpoint,
)
from mixprec.persist.serialize import flatten, unflatten


def nested_state():
    shared = torch.arange(6, dtype=torch.float32)
    return {
        "model": {"w": torch.randn(3, 4, dtype=torch.bfloat16), "tied_a": shared, "tied_b": shared},
        "optimizer": {
            "state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.ones(2)}},
            "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.999), "params": [0], "name": None, "flag": True}],
        },
        "scalers": [{"scale": float("inf"), "min_scale": float("nan"), "tracker": -1}],
        "rng": torch.get_rng_state(),
        "python": (3, tuple(range(5)), None),
    }


def assert_same(a, b):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            assert_same(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same(x, y)
    elif isinstance(a, float) and a != a:
        assert b != b
    else:
        assert a == b and type(a) is type(b)


def test_flatten_round_trips_types_keys_and_specials():
    state = nested_state()
    tensors, skeleton = flatten(state)
    assert_same(unflatten(skeleton, tensors), state)


def test_flatten_refuses_objects():
    with pytest.raises(TypeError, match=r"state\.fn: function values are not tensors"):
        flatten({"fn": lambda: 0})


def test_save_and_load_round_trip(tmp_path):
    state = nested_state()
    path = save_checkpoint(tmp_path, 7, state)
    assert path.name == "step-00000007.safetensors"
    assert_same(load_checkpoint(path), state)


def test_keeps_the_newest(tmp_path):
    for step in range(1, 6):
        save_checkpoint(tmp_path, step, {"x": torch.tensor(step)}, keep=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-00000004.safetensors", "step-00000005.safetensors"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary files left


def test_truncated_and_corrupt_files_are_detected_and_skipped(tmp_path, caplog):
    save_checkpoint(tmp_path, 1, {"x": torch.ones(1000)})
    save_checkpoint(tmp_path, 2, {"x": torch.full((1000,), 2.0)})
    newest = list_checkpoints(tmp_path)[-1]
    data = newest.read_bytes()
    newest.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        load_checkpoint(newest)
    with caplog.at_level(logging.WARNING, logger="mixprec"):
        path, state = load_latest(tmp_path)
    assert path.name == "step-00000001.safetensors" and state["x"][0].item() == 1.0
    assert "Skipped a damaged checkpoint" in caplog.text and "using step-00000001.safetensors" in caplog.text

    flipped = bytearray(data)
    flipped[-10] ^= 0xFF  # a byte inside the tensor data
    newest.write_bytes(bytes(flipped))
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        load_checkpoint(newest)


def test_foreign_files_are_refused(tmp_path):
    foreign = tmp_path / "step-00000001.safetensors"
    save_file({"x": torch.ones(2)}, str(foreign))
    with pytest.raises(CheckpointError, match="not a mixprec checkpoint"):
        load_checkpoint(foreign)
    with pytest.raises(CheckpointError, match="no such checkpoint"):
        load_checkpoint(tmp_path / "missing.safetensors")


def test_a_pickle_payload_is_refused_without_running_it(tmp_path):
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    path = tmp_path / "step-00000003.safetensors"
    path.write_bytes(pickle.dumps(Payload()))
    with pytest.raises(CheckpointError):
        load_checkpoint(path)
    with pytest.raises(CheckpointError, match=r"no usable checkpoint in .*step-00000003\.safetensors: not a readable"):
        load_latest(tmp_path)  # the only checkpoint is damaged: said, not silently None
    assert not marker.exists()
    torch.save({"x": torch.ones(1)}, path)  # a torch.save file is refused the same way
    with pytest.raises(CheckpointError):
        load_checkpoint(path)


def test_killed_during_save_leaves_the_previous_checkpoint(tmp_path):
    save_checkpoint(tmp_path, 1, {"x": torch.ones(10)})
    script = textwrap.dedent(f"""
        import torch, sys
        from mixprec.app.checkpoint import save_checkpoint
        big = {{"x": torch.randn(64, 1024, 1024)}}  # 256 MB: the write takes a while
        print("ready", flush=True)
        for step in range(2, 100):
            save_checkpoint({str(tmp_path)!r}, step, big, keep=100)
    """)
    process = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline().strip() == "ready"
    deadline = time.monotonic() + 60
    while not any(p.name.startswith(".") for p in tmp_path.iterdir()) and time.monotonic() < deadline:
        time.sleep(0.005)  # wait until a temporary file is being written
    process.send_signal(signal.SIGKILL)
    process.wait()
    path, state = load_latest(tmp_path)  # every complete checkpoint verifies; the partial one is not listed
    assert path.name.startswith("step-") and state["x"].numel() in (10, 64 * 1024 * 1024)
    for checkpoint in list_checkpoints(tmp_path):
        load_checkpoint(checkpoint)


def test_an_edited_header_is_caught_by_the_checksum(tmp_path):
    # the metadata is what resuming depends on: position, counters, RNG, scaler, policy
    path = save_checkpoint(tmp_path, 3, {"position": {"batch_in_epoch": 6}, "x": torch.ones(4)})
    data = path.read_bytes()
    edited = data.replace(b'batch_in_epoch\\": 6', b'batch_in_epoch\\": 8')  # same length: the file still parses
    assert edited != data and len(edited) == len(data)
    path.write_bytes(edited)
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        load_checkpoint(path)


def test_a_checkpoint_under_another_steps_name_is_refused(tmp_path):
    path = save_checkpoint(tmp_path, 3, {"x": torch.ones(2)})
    misnamed = path.rename(tmp_path / "step-00000006.safetensors")
    with pytest.raises(
        CheckpointError, match=r"step-00000006\.safetensors: holds step '3', not the step its name says"
    ):
        load_checkpoint(misnamed)


def test_every_flipped_byte_is_refused_or_changes_nothing(tmp_path):
    state = {"position": {"step": 3, "epoch": 1}, "x": torch.arange(16.0), "scale": 65536.0}
    path = save_checkpoint(tmp_path, 3, state)
    data = path.read_bytes()
    generator = torch.Generator().manual_seed(0)
    positions = torch.randperm(len(data), generator=generator)[:300].tolist()
    masks = torch.randint(1, 256, (300,), generator=generator).tolist()
    refused = 0
    for position, mask in zip(positions, masks, strict=True):
        flipped = bytearray(data)
        flipped[position] ^= mask
        path.write_bytes(bytes(flipped))
        try:
            loaded = load_checkpoint(path)
        except CheckpointError:
            refused += 1
            continue
        assert_same(loaded, state)  # a flip the format ignores (JSON whitespace) changes nothing
    assert refused >= 290


@pytest.mark.parametrize(
    "skeleton",
    [
        {"model": {"__tensor__": ["x"]}},
        {"__dict__": [[["unhashable"], 1]]},
        {"__dict__": 5},
        {"__tuple__": 5},
        {"__float__": "not a number"},
        {"__float__": ["x"]},
        "[" * 100_000 + "]" * 100_000,
    ],
    ids=["list as tensor name", "unhashable key", "dict of int", "tuple of int", "float text", "float list", "deep"],
)
def test_a_malformed_skeleton_is_a_value_error_never_a_crash(skeleton):
    import json

    if isinstance(skeleton, str):
        with pytest.raises(RecursionError):  # what json itself does: load_checkpoint turns it into a CheckpointError
            json.loads(skeleton)
        skeleton = [[[[[]]]]]
        for _ in range(100_000):
            skeleton = [skeleton]
    with pytest.raises(ValueError, match="checkpoint's structure"):
        unflatten(skeleton, {"t0": torch.ones(1)})


# a checkpoint's kind -> (its writer, the function that writes its bytes, its name's suffix)
FULL_DISK_WRITERS = {
    "file": (save_checkpoint, "write_atomically", "safetensors"),
    "sharded": (save_sharded_checkpoint, "write_sharded", "sharded"),  # a process without a group: one rank
}


@pytest.mark.filterwarnings("ignore:.*assuming the intent is to save in a single process")
@pytest.mark.parametrize("kind", list(FULL_DISK_WRITERS))
def test_a_full_disk_makes_room_from_older_checkpoints_but_keeps_the_newest(tmp_path, monkeypatch, kind):
    import mixprec.app.checkpoint as checkpoint

    save, writer, suffix = FULL_DISK_WRITERS[kind]
    for step in (1, 2, 3):
        save(tmp_path, step, {"x": torch.full((4,), float(step))})
    write = getattr(checkpoint, writer)
    failures = {"left": 1}

    def full_once(*args):  # ENOSPC until the older checkpoints are gone
        if failures["left"]:
            failures["left"] -= 1
            raise OSError(errno.ENOSPC, "No space left on device")
        write(*args)

    monkeypatch.setattr(checkpoint, writer, full_once)
    save(tmp_path, 4, {"x": torch.full((4,), 4.0)})
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"step-00000003.{suffix}", f"step-00000004.{suffix}"]

    def always_full(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(checkpoint, writer, always_full)
    said = rf"could not write checkpoint .*step-00000005\.{suffix} \(No space left on device\); "
    said += rf"the newest checkpoint, step-00000004\.{suffix}, is intact: resume from it"
    with pytest.raises(OSError, match=said):
        save(tmp_path, 5, {"x": torch.ones(4)})
    # never fewer than one, and nothing half-written left
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"step-00000004.{suffix}"]
    assert load_checkpoint(tmp_path / f"step-00000004.{suffix}")["x"][0].item() == 4.0


def test_a_folder_named_like_a_checkpoint_is_neither_loaded_nor_pruned(tmp_path):
    (tmp_path / "step-00000001.safetensors").mkdir()
    for step in (2, 3, 4):
        save_checkpoint(tmp_path, step, {"x": torch.ones(1)}, keep=1)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step-00000004.safetensors"]
    assert (tmp_path / "step-00000001.safetensors").is_dir()


def test_files_written_atomically_follow_the_umask_like_any_other_file(tmp_path):
    # a temporary file made by tempfile is 0600; an export or a policy file must stay readable by a
    # serving user or a colleague where the umask says so
    import stat

    from mixprec.doctor.policy_file import PolicyAdvice, write_policy_file
    from mixprec.persist import write_atomically

    previous = os.umask(0o022)
    try:
        write_atomically(tmp_path / "data.bin", b"x")
        write_policy_file(PolicyAdvice("mixed_bf16", reasons=("r",)), tmp_path / "mixprec-policy.json")
    finally:
        os.umask(previous)
    for name in ("data.bin", "mixprec-policy.json"):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o644, name
