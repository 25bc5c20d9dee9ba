"""mixprec inside an Accelerate loop: two CPU processes agree on every skip; Accelerate's own mixed
precision together with mixprec is refused, whichever was set up first."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import mixprec

accelerate = pytest.importorskip("accelerate")
from accelerate.state import AcceleratorState, GradientState  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "accelerate_example.py"
ACCELERATE = str(Path(sys.executable).with_name("accelerate"))
# Accelerate's multi-process launcher (torch elastic underneath; `--multi_gpu` is its name, and the
# example's Accelerator(cpu=True) keeps it on the CPU with gloo). `--cpu` alone starts one process.
LAUNCH = [ACCELERATE, "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1"]
LAUNCH += ["--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", "0"]


@pytest.fixture(autouse=True)
def fresh_accelerator_state():
    yield
    AcceleratorState._reset_state(True)  # Accelerate keeps one process-wide state
    GradientState._reset_state()  # and one of gradient syncing, which a test may leave unsynced


def _launched(*options: str) -> list[tuple[str, ...]]:
    """The example on two processes, rank 0's loss infinite at step 3: each rank's (rank, steps, skipped,
    scale, checksum)."""
    done = subprocess.run([*LAUNCH, str(EXAMPLE), "--inject-inf-at", "3", *options], capture_output=True, text=True,
                          timeout=180)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    # the two ranks' lines may interleave on the shared stdout
    pattern = r"rank (\d)/2: (\d+) steps, (\d+) skipped, scale (\d+), checksum (-?[\d.]+|on rank 0)"
    ranks = sorted(re.findall(pattern, done.stdout))
    assert [r[0] for r in ranks] == ["0", "1"], done.stdout
    for _, steps, skipped, scale, _ in ranks:  # rank 1's loss was finite: it skipped with rank 0
        assert (steps, skipped, scale) == ("8", "1", "32768"), done.stdout
    return ranks


def test_two_processes_skip_the_same_step_stay_identical_and_shard_alike_with_fsdp2():
    replicas = _launched()
    assert replicas[0][4] == replicas[1][4]  # DDP: the replicas are identical
    sharded = _launched("--fsdp")  # FSDP2 by mixprec.fully_shard; the model kept out of prepare
    assert sharded[1][4] == "on rank 0"
    # the same training, the gradients reduced by FSDP2's reduce-scatter instead of DDP's all-reduce (two
    # ranks: the same sums; measured equal to all 10 printed digits)
    assert float(sharded[0][4]) == pytest.approx(float(replicas[0][4]), rel=1e-6, abs=0)


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))


def test_accelerate_mixed_precision_prepared_first_is_refused():
    model = accelerate.Accelerator(cpu=True, mixed_precision="bf16").prepare(_model())
    with pytest.raises(ValueError, match=r"Accelerator\(mixed_precision='no'\)"):
        mixprec.MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), "mixed_bf16")
    assert all(p.dtype == torch.float32 for p in model.parameters())  # refused before anything was cast


def test_accelerate_mixed_precision_prepared_after_mixprec_is_refused_at_the_region():
    model = _model()
    mp = mixprec.MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), "mixed_bf16")
    accelerate.Accelerator(cpu=True, mixed_precision="bf16").prepare(model)
    with pytest.raises(ValueError, match="another framework's autocast"), mp.autocast():
        pass


def test_an_update_inside_accelerates_accumulate_is_refused_and_mixprecs_own_accumulation_runs_there():
    # accelerator.accumulate leaves a micro-batch's gradients unsynchronized (DDP's no_sync): an update there
    # would apply each rank's own gradients, and nothing would accumulate
    accelerator = accelerate.Accelerator(cpu=True, mixed_precision="no", gradient_accumulation_steps=2)
    model = _model()
    mp = mixprec.MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), "mixed_bf16")
    prepared = accelerator.prepare(model)
    before = [p.detach().clone() for p in model.parameters()]
    refused = r"inside accelerator\.accumulate\(\).* accumulation_steps=N"
    with pytest.raises(RuntimeError, match=refused), accelerator.accumulate(prepared):
        with mp.autocast():
            loss = prepared(torch.randn(8, 4)).square().mean()
        mp.backward(loss)
        mp.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))  # nothing applied
    # MixedPrecision counting the same two micro-batches updates at the second, where Accelerate syncs
    GradientState._reset_state()
    accelerator = accelerate.Accelerator(cpu=True, mixed_precision="no", gradient_accumulation_steps=2)
    model = _model()
    mp = mixprec.MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), "mixed_bf16", accumulation_steps=2)
    prepared = accelerator.prepare(model)
    applied = []
    for _ in range(2):
        with accelerator.accumulate(prepared):
            with mp.autocast():
                loss = prepared(torch.randn(8, 4)).square().mean()
            mp.backward(loss)
            applied.append(bool(mp.step()))
    assert applied == [False, True]


@pytest.mark.parametrize(
    ("policy", "refusal"),
    [
        # with mixed_precision="no" Accelerate unscales nothing: it would clip gradients 2^16 times too large
        ("mixed_fp16", r"changed after mp.backward\(\) while still multiplied by the loss scale"),
        # no loss scale under o2_bf16, but Accelerate would clip the bf16 copies by a bf16 norm
        ("o2_bf16", r"on the 16-bit model: .* measures the norm in 16 bits.* Clip with mp\.clip_grad_norm_"),
    ],
)
def test_accelerates_clip_grad_norm_before_the_unscale_is_refused(policy, refusal):
    accelerator = accelerate.Accelerator(cpu=True, mixed_precision="no")
    model = _model()
    mp = mixprec.MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), policy)
    prepared = accelerator.prepare(model)
    before = [p.detach().clone() for p in model.parameters()]
    with mp.autocast():
        mp.backward(prepared(torch.randn(8, 4)).float().square().mean())
    norm = accelerator.clip_grad_norm_(prepared.parameters(), 1e-3)
    assert norm.dtype == (torch.bfloat16 if policy == "o2_bf16" else torch.float32)  # what it would clip by
    with pytest.raises(RuntimeError, match=refusal):
        mp.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def _train_with_accelerate(steps: range, folder: Path, save_at: int | None, load: bool, policy: str = "o2_fp16",
                           register: bool = True) -> tuple[list, float]:  # fmt: skip
    AcceleratorState._reset_state(True)
    accelerator = accelerate.Accelerator(cpu=True, mixed_precision="no")
    torch.manual_seed(0)
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    mp = mixprec.MixedPrecision(model, optimizer, policy)
    prepared, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    if register:
        accelerator.register_for_checkpointing(mp)
    if load:
        accelerator.load_state(str(folder))
    for step in steps:
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(step))
        with mp.autocast():
            loss = prepared(x).float().square().mean() * (float("inf") if step in (1, 4) else 1.0)
        mp.backward(loss)
        mp.clip_grad_norm_(1.0)
        mp.step()
        mp.step_scheduler(scheduler)
        if step == save_at:
            accelerator.save_state(str(folder))
    return [p.detach().clone() for p in mp.fp32_state_dict().values()], mp.stats().scale


def test_register_for_checkpointing_resumes_the_scale_and_masters_exactly(tmp_path):
    # overflows (skipped updates) on both sides of the checkpoint
    whole, scale = _train_with_accelerate(range(6), tmp_path, save_at=2, load=False)
    resumed, resumed_scale = _train_with_accelerate(range(3, 6), tmp_path, save_at=None, load=True)
    assert resumed_scale == scale == 2.0**14
    assert all(torch.equal(a, b) for a, b in zip(whole, resumed, strict=True))


def _prepared_loop(accumulation_steps: int = 1):
    accelerator = accelerate.Accelerator(cpu=True, mixed_precision="no")
    torch.manual_seed(0)
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    mp = mixprec.MixedPrecision(model, optimizer, "mixed_fp16", accumulation_steps=accumulation_steps)
    return accelerator, mp, scheduler, *accelerator.prepare(model, optimizer, scheduler)


@pytest.mark.parametrize("accumulation_steps", [1, 2])
def test_a_prepared_schedulers_plain_step_follows_the_applied_updates(accumulation_steps):
    # Accelerate's scheduler asks its optimizer's step_was_skipped, which mixprec's skips now set
    accelerator, mp, scheduler, prepared, _, prepared_scheduler = _prepared_loop(accumulation_steps)
    applied, said_skipped = 0, []
    for step in range(8 * accumulation_steps):
        with mp.autocast():
            loss = prepared(torch.randn(8, 4)).square().mean() * (float("inf") if step == 3 else 1.0)
        mp.backward(loss)
        applied += bool(mp.step())
        said_skipped.append(accelerator.optimizer_step_was_skipped)
        prepared_scheduler.step()  # after every mp.step(), as a plain Accelerate loop steps it
    assert applied == 7
    assert scheduler.last_epoch == 7  # was 8: the skipped update advanced the schedule
    assert said_skipped[3] and said_skipped.count(False) == 7


@pytest.mark.parametrize("policy", ["mixed_fp16", "o2_fp16"])
def test_a_resume_without_register_for_checkpointing_is_said(tmp_path, policy):
    # saved and resumed without mp: the scale restarts (said); o2's masters would be stale (refused), both naming it
    _train_with_accelerate(range(3), tmp_path, save_at=2, load=False, policy=policy, register=False)
    if policy == "mixed_fp16":
        said = pytest.warns(UserWarning, match=r"loss scale restarts at 65536.*register_for_checkpointing\(mp\)")
    else:
        said = pytest.raises(RuntimeError, match=r"no longer hold their FP32 masters.*register_for_checkpointing\(mp\)")
    with said:
        _train_with_accelerate(range(3, 4), tmp_path, save_at=None, load=True, policy=policy, register=False)
