"""Two processes with the gloo backend on the loopback interface: FSDP2-sharded models under
MixedPrecision (mixed, o2 with FP32 shards as masters, pure_bf16 with compensated updates) match
single-process training, skip together, clip by the global norm, and save and resume identically."""

import gc
import json
import math

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

import mixprec
import mixprec.app
from mixprec.parallel.state import gather_state

WORLD = 2
STEPS = 6
INJECT_AT = 2
LR = 1e-2
POLICIES = {  # policy -> reduce dtype
    "mixed_bf16": None,
    "o2_bf16": torch.float32,
    "pure_bf16": None,
}


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 32)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(32), nn.Linear(32, 32), nn.GELU()) for _ in range(2))
        self.head = nn.Linear(32, 3)

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = h + block(h)
        return self.head(h)


def _net() -> Net:
    torch.manual_seed(0)
    return Net()


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 8, generator=generator), torch.randint(0, 3, (8,), generator=generator)) for _ in range(12)]


def _optimizer(model: nn.Module, policy: str) -> torch.optim.Optimizer:
    # SGD where the policy allows it: its update is proportional to the gradient, so a wrongly averaged
    # or missing shard shows; pure_bf16 needs mixprec.AdamW's compensated updates
    if policy == "pure_bf16":
        return mixprec.AdamW(model.parameters(), lr=LR)
    return torch.optim.SGD(model.parameters(), lr=10 * LR)


def _full_state(model: nn.Module, optimizer, sharded: bool) -> dict[str, torch.Tensor]:
    if sharded:
        state, _ = gather_state(model, optimizer)
    else:
        state = model.state_dict()
    return {k: v.float().contiguous() for k, v in state.items()}


def _train(policy: str, rank: int, world: int, inject: bool = False) -> dict:
    model, sharded = _net(), world > 1
    if sharded:
        mixprec.fully_shard(model, policy, reduce_dtype=POLICIES[policy])
    optimizer = _optimizer(model, policy)
    engine = mixprec.MixedPrecision(model, optimizer, policy, mixprec.DynamicLossScaler(init_scale=2.0**10))
    applied, scales, norms = [], [], []
    for step, (x, y) in enumerate(_batches()[:STEPS]):
        share = slice(rank * len(x) // world, (rank + 1) * len(x) // world)
        with engine.autocast():
            loss = nn.functional.cross_entropy(model(x[share]), y[share])
        hook = None
        if inject and step == INJECT_AT and rank == 1:  # this rank's shard alone, during backward (FSDP2 calls
            # the hook after its reduce-scatter); after it, the edit of a scaled gradient is refused
            hook = model.head.weight.register_post_accumulate_grad_hook(_nan_in_shard)
        engine.backward(loss)
        if hook is not None:
            hook.remove()
        norms.append(engine.clip_grad_norm_(1.0).item())
        applied.append(bool(engine.step()))
        scales.append(engine.scalers[0].get_scale())
    params = _full_state(model, optimizer, sharded)
    stats = engine.stats()
    kinds = {"inf_steps": stats.inf_steps, "nan_steps": stats.nan_steps}
    return {"applied": applied, "scales": scales, "norms": norms, "params": params, "kinds": kinds}


def _nan_in_shard(param: torch.Tensor) -> None:
    mixprec.distributed.local(param.grad).view(-1)[0] = float("nan")


def _trainer(policy: str, out: str) -> mixprec.app.Trainer:
    model = mixprec.fully_shard(_net(), policy, reduce_dtype=POLICIES[policy])
    return mixprec.app.Trainer(
        model, _optimizer(model, policy), mixprec.app.TrainData(_batches(), None, nn.functional.cross_entropy), policy,
        update=mixprec.app.UpdateOptions(max_grad_norm=1.0),
        run=mixprec.app.RunOptions(out_dir=out, checkpoint_every=3, progress=False),
    )  # fmt: skip


def _scenarios(rank: int, out: str) -> None:
    summary = {}
    for policy in POLICIES:
        result = _train(policy, rank, WORLD)
        save_file(result.pop("params"), f"{out}/{policy}-rank{rank}.safetensors") if rank == 0 else None
        summary[policy] = result
    injected = _train("o2_bf16", rank, WORLD, inject=True)
    injected.pop("params")
    summary["injected"] = injected
    # save and resume: 6 steps straight, against 3 steps, a new process state, and 3 more
    straight = _trainer("o2_bf16", f"{out}/straight")
    straight.fit(steps=6)
    first = _trainer("o2_bf16", f"{out}/resumed")
    first.fit(steps=3)
    resumed = _trainer("o2_bf16", f"{out}/resumed")
    resumed.fit(steps=6, resume=True)
    for name, trainer in (("straight", straight), ("resumed", resumed)):
        state = _full_state(trainer.model, trainer.optimizer, True)
        if rank == 0:
            save_file(state, f"{out}/{name}.safetensors")
    summary["resumed_at"] = first.updates_done
    refusals = []
    for shard, policy in (("o2_bf16", "mixed_bf16"), (None, "o2_bf16")):
        model = _net()
        if shard:
            mixprec.fully_shard(model, shard)
        else:
            torch.distributed.fsdp.fully_shard(model)  # FSDP2 directly: FP32 weights, no policy
        try:
            mixprec.MixedPrecision(model, torch.optim.AdamW(model.parameters()), policy)
        except ValueError as exc:
            refusals.append(str(exc))
    summary["refusals"] = refusals
    # FSDP2 applied after MixedPrecision, as Accelerate's and the HF Trainer's FSDP would: new parameter tensors
    # that neither the optimizer nor the masters update; refused at the next region entry and update
    late = _net()
    late_mp = mixprec.MixedPrecision(late, torch.optim.AdamW(late.parameters()), "o2_bf16")
    torch.distributed.fsdp.fully_shard(late)
    summary["sharded_after"] = []

    def step_after_a_backward() -> None:  # a step in order (after a backward), so that only the guard refuses it
        late_mp.backward(torch.ones((), requires_grad=True) * 2.0)  # the model's own forward is refused (above)
        late_mp.step()

    for attempt in (late_mp.autocast().__enter__, step_after_a_backward):
        try:
            attempt()
        except ValueError as exc:
            summary["sharded_after"].append(str(exc))
    # the model sharded inside a wrapper (a LightningModule's configure_model shards self.model): the
    # wrapper counts as sharded for the policy, unless FSDP2 sharded a part of it directly
    wrapped = nn.ModuleDict({"model": mixprec.fully_shard(_net(), "o2_bf16")})
    mixprec.MixedPrecision(wrapped, torch.optim.AdamW(wrapped.parameters()), "o2_bf16")
    summary["inner_policy"] = mixprec.parallel.sharded_with(wrapped)
    mixed = nn.ModuleDict({"model": mixprec.fully_shard(_net(), "o2_bf16"), "extra": nn.Linear(3, 3)})
    torch.distributed.fsdp.fully_shard(mixed["extra"])
    try:
        mixprec.MixedPrecision(mixed, torch.optim.AdamW(mixed.parameters()), "o2_bf16")
    except ValueError as exc:
        summary["part_sharded_directly"] = str(exc)
    partly = nn.ModuleDict({"model": mixprec.fully_shard(_net(), "mixed_bf16"), "head": nn.Linear(3, 3)})
    try:  # the head left out: replicated, never averaged, counted once per rank in the clip norm
        mixprec.MixedPrecision(partly, torch.optim.AdamW(partly.parameters()), "mixed_bf16")
    except ValueError as exc:
        summary["partly_sharded"] = str(exc)
    # HSDP: a 2-D mesh whose first dimension replicates; the norm was summed over the replicas too (sqrt 2 too big)
    mesh = init_device_mesh("cpu", (WORLD, 1), mesh_dim_names=("replicate", "shard"))
    summary["hsdp_norm"] = _first_norm(mixprec.fully_shard(_net(), "mixed_bf16", mesh=mesh), rank, WORLD)
    summary["scaled_clip"] = _clip_of_scaled_gradients(rank)
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump(summary, f)


def _clip_of_scaled_gradients(rank: int) -> dict:
    """torch's clip_grad_norm_ on FSDP2's DTensor gradients still carrying the loss scale: its foreach multiply
    moves no version counter, and the update was applied about 55,000x too small, unrefused."""
    model = mixprec.fully_shard(_net(), "mixed_fp16")
    engine = mixprec.MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=LR), "mixed_fp16")
    before = [mixprec.distributed.local(p).detach().clone() for p in model.parameters()]
    x, y = _batches()[0]
    share = slice(rank * len(x) // WORLD, (rank + 1) * len(x) // WORLD)
    with engine.autocast():
        engine.backward(nn.functional.cross_entropy(model(x[share]), y[share]))
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    try:
        engine.step()
        message = None
    except RuntimeError as error:
        message = str(error)
    after = [mixprec.distributed.local(p) for p in model.parameters()]
    return {"message": message, "unchanged": all(map(torch.equal, before, after))}


def _first_norm(model: nn.Module, rank: int, world: int) -> float:
    """The gradient norm of the first batch, this rank's share of it, measured by clip_grad_norm_."""
    engine = mixprec.MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=LR), "mixed_bf16")
    x, y = _batches()[0]
    share = slice(rank * len(x) // world, (rank + 1) * len(x) // world)
    with engine.autocast():
        loss = nn.functional.cross_entropy(model(x[share]), y[share])
    engine.backward(loss)
    return engine.clip_grad_norm_(math.inf).item()


def _worker(rank: int, port: int, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    try:
        _scenarios(rank, out)  # returns with every sharded model freed: freeing one after the group is gone can hang
        gc.collect()  # a DDP/FSDP object caught in a reference cycle goes now, while the group is alive
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory, run_gloo_workers):
    out = tmp_path_factory.mktemp("fsdp")
    run_gloo_workers(_worker, out, seconds=150)
    return out, [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]


@pytest.mark.parametrize("policy", list(POLICIES))
def test_fsdp_training_matches_one_process_on_the_same_global_batch(fsdp_run, policy):
    out, ranks = fsdp_run
    single = _train(policy, rank=0, world=1)
    sharded = load_file(str(out / f"{policy}-rank0.safetensors"))
    assert sharded.keys() == single["params"].keys()
    for name, value in single["params"].items():
        # the ranks' half-batch gradients are averaged where one process takes the whole batch's mean;
        # bf16 rounds the two differently, and AdamW turns a near-zero gradient of either sign into a
        # full step of lr: the tensors agree to 1% in norm, no element further apart than the steps allow
        difference = (sharded[name] - value).norm() / value.norm()
        assert difference < 1e-2, f"{policy}: {name} differs by {difference:.2%}"
        assert (sharded[name] - value).abs().max() <= 2 * STEPS * LR, f"{policy}: {name}"
    assert ranks[0][policy]["applied"] == [True] * STEPS
    # the clipped norm is the global one: the shards' norms summed over ranks
    assert ranks[0][policy]["norms"] == ranks[1][policy]["norms"]
    torch.testing.assert_close(
        torch.tensor(ranks[0][policy]["norms"]), torch.tensor(single["norms"]), rtol=2e-2, atol=0
    )


def test_a_nan_in_one_ranks_shard_makes_every_rank_skip_back_off_and_say_nan(fsdp_run):
    _, ranks = fsdp_run
    for rank in ranks:
        assert rank["injected"]["applied"] == [s != INJECT_AT for s in range(STEPS)]
        assert rank["injected"]["scales"][INJECT_AT] == 2.0**9
    assert ranks[0]["injected"]["scales"] == ranks[1]["injected"]["scales"]
    # rank 0's shards held only finite values; its statistics (the ones a run reports) still say NaN (without
    # the agreement: a flagged step without a NaN of its own, counted as inf)
    assert ranks[0]["injected"]["kinds"] == ranks[1]["injected"]["kinds"] == {"inf_steps": 0, "nan_steps": 1}


def test_mixed_precision_refuses_a_model_sharded_for_another_policy_partly_or_after_it(fsdp_run):
    _, ranks = fsdp_run
    wrong_policy, unmapped = ranks[0]["refusals"]
    assert "sharded by mixprec.fully_shard for 'params=bfloat16" in wrong_policy
    assert "MixedPrecision received 'params=float32,compute=bfloat16" in wrong_policy
    assert "pass the same policy to both" in wrong_policy
    assert "Shard it with mixprec.fully_shard(model, policy)" in unmapped
    assert ranks[0]["inner_policy"] == str(mixprec.get_policy("o2_bf16"))  # MixedPrecision took the wrapper
    assert "Shard it with mixprec.fully_shard(model, policy)" in ranks[0]["part_sharded_directly"]
    assert "trainable parameter 'head.weight' (and 1 more) is not" in ranks[0]["partly_sharded"]
    assert "Shard the whole model" in ranks[1]["partly_sharded"]
    for said in ranks[0]["sharded_after"] + ranks[1]["sharded_after"]:  # region entry and step, both ranks
        assert "is no longer the tensor it was" in said and "fully_shard" in said, said
        assert "Shard with mixprec.fully_shard(model, policy) before building MixedPrecision" in said
    assert len(ranks[0]["sharded_after"]) == len(ranks[1]["sharded_after"]) == 2


def test_a_sharded_run_saves_once_resumes_and_continues_identically(fsdp_run):
    out, ranks = fsdp_run
    assert ranks[0]["resumed_at"] == 3
    straight, resumed = load_file(str(out / "straight.safetensors")), load_file(str(out / "resumed.safetensors"))
    for name in straight:
        assert torch.equal(straight[name], resumed[name]), name
    checkpoints = sorted(p.name for p in (out / "resumed" / "checkpoints").iterdir())
    assert checkpoints == ["step-00000003.sharded", "step-00000006.sharded"]  # one folder per save, complete


def test_the_norm_of_a_replicated_shard_counts_it_once(fsdp_run):
    _, ranks = fsdp_run
    single = _first_norm(_net(), rank=0, world=1)
    for rank in ranks:  # bf16 GEMMs over half the batch round differently from one over the whole batch
        assert rank["hsdp_norm"] == pytest.approx(single, rel=1e-3), (rank["hsdp_norm"], single)


def test_a_clip_of_sharded_gradients_still_carrying_the_loss_scale_is_refused(fsdp_run):
    _, ranks = fsdp_run
    for rank in ranks:
        assert "while still multiplied by the loss scale" in (rank["scaled_clip"]["message"] or ""), rank
        assert rank["scaled_clip"]["unchanged"]
