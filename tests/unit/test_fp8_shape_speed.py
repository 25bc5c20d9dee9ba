"""FP8 only where it pays (``shapes=faster``; ``auto`` where the FP8 kernel runs): each layer's GEMM shape timed
once in FP8 and in the compute dtype, the slower layers left in the compute dtype, the plan saying which and why.

The decisions read the per-machine cache (``$MIXPREC_CACHE_DIR/fp8_shapes.json``), which these tests seed with
chosen timings, so that which layer is faster does not depend on this machine; one test measures for real."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from torch import nn

import mixprec
from mixprec.regions.fp8 import SHAPE_CACHE_FILE, SHAPE_CACHE_VERSION, scaled_mm_available, shape_key
from mixprec.regions.routing import Seat, Seated, new_token, route_links

pytestmark = pytest.mark.skipif(not scaled_mm_available(torch.device("cpu")), reason="no CPU FP8 GEMM in this torch")

ROWS = 24
FASTER = "base=mixed_bf16,fp8=hybrid(keep=none,gemm=scaled_mm,shapes=faster)"


@pytest.fixture(autouse=True)
def _fresh_compiler():
    """Each test compiles from a clean slate, as tests/unit/test_compile.py's do: the compiled code of earlier
    tests' models (one code object, Sequential's forward) counts toward dynamo's recompile limit of 8, which the
    fullgraph compiles here would otherwise hit, depending on which test files ran before in the process."""
    torch._dynamo.reset()


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))


def _seed_speeds(speeds: dict[tuple[int, int, int], tuple[float, float]], policy: str = FASTER) -> Path:
    """Write the shape cache as if this machine had measured ``(m, k, n) -> (fp8_ms, bf16_ms)`` for ``policy``."""
    recipe = mixprec.get_policy(policy).fp8
    entries = {
        shape_key(recipe, torch.device("cpu"), torch.bfloat16, m, k, n, True): {"fp8_ms": fp8, "ref_ms": ref}
        for (m, k, n), (fp8, ref) in speeds.items()
    }
    path = Path(os.environ["MIXPREC_CACHE_DIR"]) / SHAPE_CACHE_FILE
    path.write_text(json.dumps({"version": SHAPE_CACHE_VERSION, "entries": entries}))
    return path


def _outputs(policy: str, x: torch.Tensor, compiled: bool = False) -> tuple[mixprec.MixedPrecision, list]:
    """The model's two layers' outputs under ``policy``, recorded by forward hooks."""
    model = _model()
    mp = mixprec.MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), policy)
    outputs: list[torch.Tensor] = []
    for layer in (model[0], model[2]):
        layer.register_forward_hook(lambda module, args, out: outputs.append(out.detach()))
    # the decisions break no graph; static shapes: an earlier test's compile of another batch size would make the row
    # count dynamic here (dynamo's automatic dynamic shapes), and a dynamic row count decides nothing (FP8)
    forward = torch.compile(model, fullgraph=True, dynamic=False) if compiled else model
    with mp.autocast():
        forward(x)
    return mp, outputs


def test_a_layer_whose_shape_is_slower_in_fp8_runs_in_the_compute_dtype(kernel_cache):
    kernel_cache(torch.bfloat16)
    _seed_speeds({(ROWS, 32, 64): (0.5, 1.0), (ROWS, 64, 32): (2.0, 1.0)})  # the first pays, the second does not
    x = torch.randn(ROWS, 32)
    mp, decided = _outputs(FASTER, x)
    # the same model with FP8 named for the first layer alone, whatever its speed
    _, reference = _outputs("base=mixed_bf16,fp8=hybrid(keep=none,only=0,gemm=scaled_mm,shapes=all)", x)
    _, all_fp8 = _outputs("base=mixed_bf16,fp8=hybrid(keep=none,gemm=scaled_mm,shapes=all)", x)
    assert all(torch.equal(a, b) for a, b in zip(decided, reference, strict=True))
    assert not torch.equal(decided[1], all_fp8[1])  # the second layer did not compute in FP8
    plan = mp.compute_plan.reason
    assert "1 of 2 GEMM layers in FP8 (FP8 only where a layer's shape measured faster)" in plan
    assert (
        "kept: 2 (Linear): FP8 measured slower for its shape (24 rows, 64 -> 32: FP8 2.000 ms, bf16 1.000 ms "
        "a training pass)" in plan
    )


def test_before_its_first_pass_the_plan_says_each_layer_decides_then(kernel_cache):
    kernel_cache(torch.bfloat16)
    model = _model()
    mp = mixprec.MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), FASTER)
    assert "2 of 2 GEMM layers in FP8 (FP8 only where a layer's shape measured faster; 2 not measured yet: each " in (
        mp.compute_plan.reason
    )


def test_compiled_the_decisions_are_made_while_tracing_and_compiled_in(kernel_cache):
    kernel_cache(torch.bfloat16)
    _seed_speeds({(ROWS, 32, 64): (2.0, 1.0), (ROWS, 64, 32): (0.5, 1.0)})  # the second layer pays
    x = torch.randn(ROWS, 32)
    mp, compiled = _outputs(FASTER, x, compiled=True)
    _, reference = _outputs("base=mixed_bf16,fp8=hybrid(keep=none,only=2,gemm=scaled_mm,shapes=all)", x, True)
    _, all_fp8 = _outputs("base=mixed_bf16,fp8=hybrid(keep=none,gemm=scaled_mm,shapes=all)", x, True)
    assert all(torch.equal(a, b) for a, b in zip(compiled, reference, strict=True))
    assert not torch.equal(compiled[0], all_fp8[0])
    assert "kept: 0 (Linear): FP8 measured slower for its shape (24 rows, 32 -> 64" in mp.compute_plan.reason


def test_a_shape_without_a_measurement_is_measured_once_and_cached(kernel_cache):
    kernel_cache(torch.bfloat16)
    x = torch.randn(8, 32)
    mp, _ = _outputs(FASTER, x)
    path = Path(os.environ["MIXPREC_CACHE_DIR"]) / SHAPE_CACHE_FILE
    entries = json.loads(path.read_text())["entries"]
    assert len(entries) == 2 and all(e["fp8_ms"] > 0 and e["ref_ms"] > 0 for e in entries.values())
    key = shape_key(mp.policy.fp8, torch.device("cpu"), torch.bfloat16, 8, 64, 32, True)
    fp8_ms, ref_ms = entries[key]["fp8_ms"], entries[key]["ref_ms"]
    said = f"8 rows, 64 -> 32: FP8 {fp8_ms:.3f} ms, bf16 {ref_ms:.3f} ms"
    assert (said in mp.compute_plan.reason) == (fp8_ms >= ref_ms)  # kept, with its figures, only when slower
    before = path.stat().st_mtime_ns
    _outputs(FASTER, x)  # another model, same shapes: read, not measured again
    assert path.stat().st_mtime_ns == before


def test_delayed_histories_are_not_touched_by_the_measurement(kernel_cache):
    kernel_cache(torch.bfloat16)
    policy = "base=mixed_bf16,fp8=hybrid(scaling=delayed,keep=none,gemm=scaled_mm,shapes=faster)"
    mp, _ = _outputs(policy, torch.randn(ROWS, 32))  # each shape measured (passes of its own) in this forward
    entries = json.loads((Path(os.environ["MIXPREC_CACHE_DIR"]) / SHAPE_CACHE_FILE).read_text())["entries"]
    ran_fp8 = {}
    for name, (k, n) in {"0": (32, 64), "2": (64, 32)}.items():
        entry = entries[shape_key(mp.policy.fp8, torch.device("cpu"), torch.bfloat16, ROWS, k, n, True)]
        ran_fp8[name] = int(entry["fp8_ms"] < entry["ref_ms"])
    recorded = {name: layer["input"]["recorded"] for name, layer in mp.state_dict()["fp8"].items()}
    assert recorded == ran_fp8  # one amax where the layer ran FP8 (the model's one forward), none from the timing


def test_auto_decides_by_speed_only_where_the_fp8_kernel_runs(kernel_cache):
    kernel_cache(torch.bfloat16)
    emulated, _ = _outputs("base=mixed_bf16,fp8=hybrid(keep=none)", torch.randn(ROWS, 32))
    assert "2 of 2 GEMM layers in FP8; " in emulated.compute_plan.reason + "; "
    assert "measured faster" not in emulated.compute_plan.reason
    _seed_speeds({(ROWS, 32, 64): (2.0, 1.0), (ROWS, 64, 32): (2.0, 1.0)}, "base=mixed_bf16,fp8=hybrid(gemm=scaled_mm)")
    kernel, _ = _outputs("base=mixed_bf16,fp8=hybrid(keep=none,gemm=scaled_mm)", torch.randn(ROWS, 32))
    assert "0 of 2 GEMM layers in FP8 (FP8 only where a layer's shape measured faster)" in kernel.compute_plan.reason


def test_the_shapes_option_parses_back_and_refuses_other_values():
    policy = mixprec.get_policy("base=fp8,fp8=(shapes=all)")
    assert policy.fp8.shapes == "all" and mixprec.get_policy(str(policy)) == policy
    assert "shapes" not in str(mixprec.get_policy("fp8"))  # auto, the default, is not spelled out
    with pytest.raises(ValueError, match=r"shapes=\.\.\.\): received 'fast'; use one of auto, faster, all"):
        mixprec.get_policy("base=fp8,fp8=(shapes=fast)")


@pytest.mark.parametrize("bounded", [False, True], ids=["recompiled", "marked-dynamic-with-a-bound"])
def test_a_row_count_compiled_as_dynamic_runs_fp8(kernel_cache, bounded):
    # a symbol with bounds (mark_dynamic(max=), or a branch on the size) is still a symbol: taken for a constant,
    # it reached the decision, which dynamo 2.11 could not call (an error) and 2.13 called with its example value
    kernel_cache(torch.bfloat16)
    _seed_speeds({(ROWS, 32, 64): (2.0, 1.0), (ROWS, 64, 32): (2.0, 1.0)})  # both slower at ROWS rows

    def second_batch(policy: str) -> list[torch.Tensor]:
        model = _model()
        mp = mixprec.MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), policy)
        forward = torch.compile(model, fullgraph=True)
        with mp.autocast():
            first = torch.randn(ROWS, 32, generator=torch.Generator().manual_seed(0))
            if bounded:
                torch._dynamo.mark_dynamic(first, 0, min=2, max=1024)
            forward(first)
            # another row count: torch.compile recompiles with the rows symbolic, no one shape to decide
            return [forward(torch.randn(ROWS + 8, 32, generator=torch.Generator().manual_seed(1)))]

    decided = second_batch(FASTER)
    assert torch.equal(decided[0], second_batch("base=mixed_bf16,fp8=hybrid(keep=none,gemm=scaled_mm,shapes=all)")[0])


def test_a_copied_fp8_state_decides_in_a_table_of_its_own(kernel_cache):
    import copy
    import gc

    kernel_cache(torch.bfloat16)
    _seed_speeds({(ROWS, 32, 64): (2.0, 1.0), (ROWS, 64, 32): (0.5, 1.0)})
    state = mixprec.regions.fp8.fp8_state(_model(), mixprec.get_policy(FASTER).fp8)
    twin = copy.deepcopy(state)  # its own modules and table (pickling goes the same way)
    assert twin.speeds.key != state.speeds.key
    del state
    gc.collect()  # the original's table is gone: the copy's layers must not look for it
    seat, owner = Seat(), new_token()  # the layers' model's seat, with a region entered on it
    route_links(twin.links(owner, seat))
    with twin.computing(torch.bfloat16), Seated([seat], owner, traced=False):
        out = twin.modules["0"](torch.randn(ROWS, 32))
    assert out.shape == (ROWS, 64) and set(twin.speeds.decided) == {"0"} and not twin.speeds.decided["0"].pays


def test_under_a_users_dispatch_mode_nothing_is_measured_and_the_next_plain_pass_measures(kernel_cache):
    # FlopCounterMode around a first step: the timing would be counted as the user's and slowed by the mode
    from torch.utils.flop_counter import FlopCounterMode

    kernel_cache(torch.bfloat16)
    model = _model()
    mp = mixprec.MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), FASTER)
    path = Path(os.environ["MIXPREC_CACHE_DIR"]) / SHAPE_CACHE_FILE
    with FlopCounterMode(display=False), mp.autocast():
        model(torch.randn(ROWS, 32))
    assert not path.exists() and "2 not measured yet" in mp.compute_plan.reason
    with mp.autocast():
        model(torch.randn(ROWS, 32))
    assert len(json.loads(path.read_text())["entries"]) == 2 and "not measured yet" not in mp.compute_plan.reason


def test_the_cache_tells_fast_accumulation_apart():
    recipes = [mixprec.get_policy(f"base=fp8,fp8=(fast_accum={f})").fp8 for f in ("auto", "output", "none", "all")]
    keys = [shape_key(r, torch.device("cpu"), torch.bfloat16, 8, 16, 32, False) for r in recipes]
    assert keys[0] == keys[1] and len(set(keys)) == 3 and "fast_accum=output |" in keys[0]
