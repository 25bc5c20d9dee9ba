"""Two processes with the gloo backend on the loopback interface: DistributedDataParallel under
MixedPrecision skips the same steps on every rank and matches single-process training."""

import contextlib
import gc
import json
import warnings

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import mixprec

WORLD = 2
STEPS = 6
INJECT_AT = 2  # rank 1 alone sees an inf gradient at this step


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [
        (torch.randn(8, 8, generator=generator), torch.randint(0, 2, (8,), generator=generator)) for _ in range(STEPS)
    ]


def _train(model, rank: int, world: int, inject: bool) -> tuple[list[bool], list[float]]:
    scaler = mixprec.DynamicLossScaler(init_scale=2.0**10)
    engine = mixprec.MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), "mixed_bf16", scaler)
    applied, scales = [], []
    for step, (x, y) in enumerate(_batches()):
        share = slice(rank * len(x) // world, (rank + 1) * len(x) // world)  # this rank's part of the batch
        with engine.autocast():
            loss = nn.functional.cross_entropy(model(x[share]), y[share])
        engine.backward(loss)
        if inject and step == INJECT_AT and rank == 1:
            # .data: a fault after the all-reduce, on one rank, past the watch for edits of scaled gradients
            next(model.parameters()).grad.data.view(-1)[0] = float("inf")
        applied.append(bool(engine.step()))
        scales.append(engine.scalers[0].get_scale())
    return applied, scales


def _scenarios(rank: int, out: str) -> None:
    model = DistributedDataParallel(_model())
    applied, scales = _train(model, rank, WORLD, inject=True)
    clean = DistributedDataParallel(_model())
    _train(clean, rank, WORLD, inject=False)
    save_file({k: v.contiguous() for k, v in model.module.state_dict().items()}, f"{out}/rank{rank}.safetensors")
    save_file({k: v.contiguous() for k, v in clean.module.state_dict().items()}, f"{out}/clean{rank}.safetensors")
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump({"applied": applied, "scales": scales}, f)
    _fp32_reduction(rank, out)
    _masters_of_each_rank(rank, out)
    _bucket_views(rank, out)
    _fp32_accumulation_in_no_sync(rank, out)


def _accumulated(rank: int, no_sync: bool) -> dict[str, torch.Tensor]:
    """o2_bf16, accumulate_in_fp32, 2 micro-batches an update, with DDP's no_sync() on the first or not."""
    model = _model()
    engine = mixprec.MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), "o2_bf16",
                                    accumulation_steps=2, accumulate_in_fp32=True)  # fmt: skip
    wrapped = DistributedDataParallel(model)
    for index, (x, y) in enumerate(_batches()[:4]):
        share = slice(rank * len(x) // WORLD, (rank + 1) * len(x) // WORLD)
        first = index % 2 == 0
        with wrapped.no_sync() if no_sync and first else contextlib.nullcontext(), engine.autocast():
            loss = nn.functional.cross_entropy(wrapped(x[share]), y[share])
            with torch.no_grad():  # a metric pass after it, and one past the wrapper: neither is the backward's
                wrapped(x[share])
            model(x[share])
        with wrapped.no_sync() if no_sync and first else contextlib.nullcontext():
            engine.backward(loss)
        engine.step()
    masters = engine.fp32_state_dict()
    del wrapped
    return {name: value.clone() for name, value in masters.items()}


def _fp32_accumulation_in_no_sync(rank: int, out: str) -> None:
    """The first micro-batch's gradients were moved into the FP32 masters before DDP's one all-reduce (inside
    no_sync): never averaged, the ranks' weights drifted apart (4.9e-2 after 2 updates)."""
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        in_no_sync = _accumulated(rank, no_sync=True)
    told = sum("inside DistributedDataParallel's no_sync()" in str(w.message) for w in said)
    every_reduced = _accumulated(rank, no_sync=False)
    tensors = {
        **{f"no_sync.{k}": v for k, v in in_no_sync.items()},
        **{f"reduced.{k}": v for k, v in every_reduced.items()},
    }
    save_file(tensors, f"{out}/accumulated{rank}.safetensors")
    with open(f"{out}/accumulated{rank}.json", "w") as f:
        json.dump({"told": told}, f)


def _bucket_views(rank: int, out: str) -> None:
    """DDP(gradient_as_bucket_view=True) rebuilds its buckets at the second forward and replaces each .grad by
    an equal bucket view: not an edit of the scaled gradients, so MixedPrecision's accumulation goes on."""
    model = DistributedDataParallel(_model(), gradient_as_bucket_view=True)
    scaler = mixprec.DynamicLossScaler(init_scale=2.0**10)
    engine = mixprec.MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), "mixed_bf16", scaler,
                                    accumulation_steps=2)  # fmt: skip
    applied = []
    for x, y in _batches()[:4]:
        with engine.autocast():
            engine.backward(nn.functional.cross_entropy(model(x), y))
        applied.append(bool(engine.step()))
    with open(f"{out}/buckets{rank}.json", "w") as f:
        json.dump(applied, f)
    del model


def _masters_of_each_rank(rank: int, out: str) -> None:
    """o2_bf16 on weights each rank initialized itself, wrapped in DDP after MixedPrecision made the masters
    (DDP broadcasts rank 0's weights): the first step refuses, on every rank; with copy_from_main first, the
    step goes through and the ranks stay identical."""
    results = {}
    for name, copied in (("own", False), ("copied", True)):
        torch.manual_seed(rank)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
        if copied:
            mixprec.distributed.copy_from_main(list(model.parameters()))
        engine = mixprec.MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), "o2_bf16")
        wrapped = DistributedDataParallel(model)
        x, y = _batches()[0]
        with engine.autocast():
            loss = nn.functional.cross_entropy(wrapped(x), y)
        engine.backward(loss)
        before = [p.detach().clone() for p in model.parameters()]
        try:
            engine.step()
            message = None
        except RuntimeError as error:
            message = str(error)
        unchanged = all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
        checksum = sum(m.double().sum().item() for m in engine.fp32_state_dict().values())
        results[name] = {"message": message, "unchanged": unchanged, "checksum": checksum}
        del wrapped
    with open(f"{out}/masters{rank}.json", "w") as f:
        json.dump(results, f)


def _worker(rank: int, port: int, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        _scenarios(rank, out)  # returns with every DDP object freed: freeing one after the group is gone can hang
        gc.collect()  # a DDP/FSDP object caught in a reference cycle goes now, while the group is alive
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _bf16_grads(model: nn.Module, rank: int) -> dict[str, torch.Tensor]:
    x, y = _batches()[0]
    share = slice(rank * len(x) // WORLD, (rank + 1) * len(x) // WORLD)
    nn.functional.cross_entropy(model(x[share].bfloat16()).float(), y[share]).backward()
    module = getattr(model, "module", model)
    return {name: p.grad for name, p in module.named_parameters()}


def _fp32_reduction(rank: int, out: str) -> None:
    """o2_bf16 gradients under DDP with reduce_in_fp32: the FP32 mean of the ranks' bf16 gradients,
    rounded once to bf16 (the reference is built from each rank's own gradient, gathered)."""
    policy = mixprec.get_policy("o2_bf16")
    averaged = _bf16_grads(mixprec.parallel.wrap_ddp(mixprec.cast_module(_model(), policy), reduce_in_fp32=True), rank)
    own = _bf16_grads(mixprec.cast_module(_model(), policy), rank)
    reference = {}
    for name, grad in own.items():
        gathered = [torch.empty_like(grad, dtype=torch.float32) for _ in range(WORLD)]
        dist.all_gather(gathered, grad.float())
        reference[name] = (sum(gathered) / WORLD).bfloat16()
    if rank == 0:
        save_file({**{f"ddp.{k}": v for k, v in averaged.items()}, **{f"ref.{k}": v for k, v in reference.items()}},
                  f"{out}/fp32_reduction.safetensors")  # fmt: skip


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory, run_gloo_workers):
    out = tmp_path_factory.mktemp("ddp")
    run_gloo_workers(_worker, out, seconds=120)
    return out


def test_a_rank_local_overflow_makes_every_rank_skip(ddp_run):
    runs = [json.loads((ddp_run / f"rank{r}.json").read_text()) for r in range(WORLD)]
    expected = [step != INJECT_AT for step in range(STEPS)]
    assert runs[0]["applied"] == runs[1]["applied"] == expected
    assert runs[0]["scales"] == runs[1]["scales"]
    assert runs[0]["scales"][INJECT_AT] == 2.0**9  # backed off once, on both ranks


def test_parameters_are_bit_identical_across_ranks(ddp_run):
    first, second = (load_file(ddp_run / f"rank{r}.safetensors") for r in range(WORLD))
    assert first.keys() == second.keys()
    assert all(torch.equal(first[k], second[k]) for k in first)


def test_ddp_matches_one_process_on_the_same_global_batch(ddp_run):
    reference = _model()
    _train(reference, rank=0, world=1, inject=False)
    distributed = load_file(ddp_run / "clean0.safetensors")
    for name, value in reference.state_dict().items():
        # bf16 GEMMs over half the batch round differently from one over the whole batch
        torch.testing.assert_close(distributed[name], value, rtol=2e-2, atol=2e-3)


def test_reduce_in_fp32_averages_16_bit_gradients_in_fp32_and_rounds_once(ddp_run):
    tensors = load_file(ddp_run / "fp32_reduction.safetensors")
    names = [k.removeprefix("ddp.") for k in tensors if k.startswith("ddp.")]
    assert names
    for name in names:
        assert tensors[f"ddp.{name}"].dtype == torch.bfloat16  # the gradients keep the parameters' dtype
        assert torch.equal(tensors[f"ddp.{name}"], tensors[f"ref.{name}"]), name


def test_weights_ddp_replaced_after_the_masters_were_made_are_refused_on_every_rank(ddp_run):
    zero, one = (json.loads((ddp_run / f"masters{r}.json").read_text()) for r in range(WORLD))
    # rank 1's bf16 weights are rank 0's after DDP's broadcast, its masters its own: the update would have
    # written them back; rank 0 raises too, instead of waiting for rank 1 in the next all-reduce
    assert "4 of the model's 4 torch.bfloat16 parameters (first: '0.weight')" in one["own"]["message"]
    assert "another rank's torch.bfloat16 parameters" in zero["own"]["message"]
    assert "copy_from_main" in one["own"]["message"] and zero["own"]["unchanged"] and one["own"]["unchanged"]
    # rank 0's weights copied to every rank before MixedPrecision: the step goes through, the ranks agree
    assert zero["copied"]["message"] is None and one["copied"]["message"] is None
    assert not zero["copied"]["unchanged"] and zero["copied"]["checksum"] == one["copied"]["checksum"]


def test_ddps_bucket_views_are_not_taken_for_edited_gradients(ddp_run):
    for rank in range(WORLD):
        assert json.loads((ddp_run / f"buckets{rank}.json").read_text()) == [False, True, False, True]


def test_fp32_accumulation_inside_no_sync_leaves_the_micro_batches_to_ddps_one_all_reduce(ddp_run):
    zero, one = (load_file(ddp_run / f"accumulated{rank}.safetensors") for rank in range(WORLD))
    for name in [k for k in zero if k.startswith("no_sync.")]:
        assert torch.equal(zero[name], one[name]), name  # the ranks agree
        # as every micro-batch reduced, up to the bf16 sum of two gradients against their FP32 sum
        reduced = zero[name.replace("no_sync.", "reduced.")]
        torch.testing.assert_close(zero[name], reduced, rtol=0, atol=1e-3)
    assert [json.loads((ddp_run / f"accumulated{rank}.json").read_text())["told"] for rank in range(WORLD)] == [1, 1]
