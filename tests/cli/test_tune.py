"""mixprec tune: per-layer policies found by cost model and trials, verified, written; deterministic for a seed
and a device profile; the fragile layer kept out of fp16 (bf16 or FP32) with the doctor's reason; the budget
respected."""

from __future__ import annotations

import fnmatch
import json
import math
import re
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec
from mixprec.app.tune.cost import AttentionShape, ConvShape, DeviceProfile, GemmShape, predict, shape_from_key
from mixprec.app.tune.layers import layer_shapes
from mixprec.app.tune.search import Candidate, assignment_policy, pareto_front

TINY = ("--size", "tiny", "--trial-steps", "8", "--verify-steps", "12", "--seeds", "2")
CHARLM = {  # charlm tiny's GEMM layers: (m, k, n)
    "blocks.0.attn.qkv": (256, 32, 96),
    "blocks.0.attn.proj": (256, 32, 32),
    "blocks.0.mlp.0": (256, 32, 128),
    "blocks.0.mlp.2": (256, 128, 32),
    "lm_head": (256, 32, 256),
}


ATTENTION_SHAPE = AttentionShape(1, 8, 2, 32, 16, causal=True)  # charlm tiny's one attention call


def _profile(tmp_path, fp8_over_16: float = 0.5) -> DeviceProfile:
    """A profile as a GPU's would read: FP8 at ``fp8_over_16`` of 16 bits' time, FP32 at twice it (made here: the
    search's logic on a device where FP8 pays, which this CPU is not); the attention at 16 bits' throughput."""
    entries = {}
    for m, k, n in CHARLM.values():
        ms = GemmShape(m, k, n).flops / 1e9
        entries[f"{m}x{k}x{n}"] = {"fp32": 2 * ms, "16": ms, "fp8": fp8_over_16 * ms}
    entries[ATTENTION_SHAPE.key()] = {"fp32": 2 * ATTENTION_SHAPE.flops / 1e9, "16": ATTENTION_SHAPE.flops / 1e9}
    path = DeviceProfile("a GPU (test profile)", "mixed_bf16", entries).save(tmp_path / "profile.json")
    return path


def _tune(mixprec_cli, out, *args):
    finished = mixprec_cli("tune", "charlm", *TINY, "--out", out, *args)
    assert finished.returncode == 0, finished.stderr
    return finished, json.loads((out / "tune.json").read_text())


def test_fp8_where_the_profile_says_it_pays_deterministic_and_within_the_tolerance(tmp_path, mixprec_cli):
    profile = _profile(tmp_path)
    finished, first = _tune(mixprec_cli, tmp_path / "a", "--device-profile", profile, "--tolerance", "50%")
    assert re.search(r"tune: \[3\] \+ \S+ in FP8: loss", finished.stderr)  # a progress line per trial
    uniform = [c for c in first["candidates"] if c["note"].startswith("uniform")]
    assert [c["policy"] for c in uniform] == ["mixed_bf16", "fp32"]  # the front's two ends, tried first
    assert uniform[0]["loss_change"] == 0 and uniform[1]["prediction"]["speedup"] == pytest.approx(0.5, rel=1e-3)
    fp8_trials = [c for c in first["candidates"] if c["note"].endswith("in FP8")]
    assert len(fp8_trials) == 5 and all(c["accepted"] for c in fp8_trials)  # a loose tolerance keeps every one
    # least sensitive first: the doctor's FP8 error orders the trials
    errors = {layer["name"]: layer["fp8_error"] for layer in first["layers"]}
    order = [c["note"].removeprefix("+ ").removesuffix(" in FP8") for c in fp8_trials]
    assert order == sorted(order, key=lambda name: (errors[name], name))
    assert first["chosen"]["prediction"]["scope"] == "layers"  # a foreign profile: no step measured there
    # every GEMM layer at half the time and half the saved bytes, the attention (no FP8) unchanged
    gemm, attention = sum(6 * m * k * n for m, k, n in CHARLM.values()), ATTENTION_SHAPE.flops
    speedup = (gemm + attention) / (gemm / 2 + attention)
    assert first["chosen"]["prediction"]["speedup"] == pytest.approx(speedup, rel=1e-3)
    saved = sum(m * k for m, k, _ in CHARLM.values())
    ratio = (saved + 2 * ATTENTION_SHAPE.saved_values) / (2 * saved + 2 * ATTENTION_SHAPE.saved_values)
    assert first["chosen"]["prediction"]["activation_ratio"] == pytest.approx(ratio, abs=1e-4)
    assert first["pareto"] and all(c["prediction"]["speedup"] > 0 for c in first["pareto"])
    verdict = first["verification"]["verdict"]
    assert verdict["within_tolerance"] and verdict["loss_change"] <= 0.5
    _, again = _tune(mixprec_cli, tmp_path / "b", "--device-profile", profile, "--tolerance", "50%")
    assert [c["loss"] for c in again["candidates"]] == [c["loss"] for c in first["candidates"]]
    assert again["chosen"] == first["chosen"]


def test_a_tight_tolerance_refuses_and_the_verification_never_exceeds_it(tmp_path, mixprec_cli):
    _, result = _tune(mixprec_cli, tmp_path / "t", "--device-profile", _profile(tmp_path), "--tolerance", "0")
    fp8_trials = [c for c in result["candidates"] if c["note"].endswith("in FP8")]
    assert len(fp8_trials) == 5  # tried, each kept only if its loss did not rise at all
    assert all(c["accepted"] == (c["loss_change"] <= 0) for c in fp8_trials)
    verdict = result["verification"]["verdict"]
    assert verdict["loss_change"] <= 0 and verdict["within_tolerance"]


def test_the_chosen_policy_file_loads_in_policy_and_train(tmp_path, mixprec_cli):
    out = tmp_path / "tuned"
    _, result = _tune(mixprec_cli, out, "--device-profile", _profile(tmp_path), "--tolerance", "50%")
    shown = json.loads(mixprec_cli("policy", str(out / "policy.json"), "--json").stdout)
    assert shown["policy"] == str(mixprec.get_policy(result["chosen"]["policy"]))
    trained = mixprec_cli("train", "charlm", "--size", "tiny", "--steps", "2", "--policy", out / "policy.json",
                          "--out", tmp_path / "run")  # fmt: skip
    assert trained.returncode == 0, trained.stderr
    for name in ("front.png", "report.md"):
        assert (out / name).stat().st_size > 0
    assert "Chosen: `" in (out / "report.md").read_text()


FRAGILE = """
import torch
from torch import nn
from mixprec.app import TaskParts

def build(config):
    torch.manual_seed(config.seed)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.LayerNorm(32), nn.Linear(32, 4))
    with torch.no_grad():
        model[2].weight.mul_(1e6)  # its outputs reach ~1e6: past fp16's 65504, inside bf16 and FP32
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(32, 16, generator=g), torch.randint(0, 4, (32,), generator=g)) for _ in range(8)]
    return TaskParts(model=model, train_data=batches, eval_data=batches[:2],
                     loss_fn=nn.functional.cross_entropy, defaults={"lr": 1e-3})
"""


def _tune_fragile(tmp_path, mixprec_cli, *args):
    (tmp_path / "fragile.py").write_text(FRAGILE)
    out = tmp_path / "out"
    finished = mixprec_cli("tune", "--model", "fragile:build", "--base", "mixed_fp16", "--trial-steps", "4",
                           "--verify-steps", "6", "--seeds", "2", "--out", out, *args, cwd=tmp_path)  # fmt: skip
    assert finished.returncode == 0, finished.stderr
    result = json.loads((out / "tune.json").read_text())
    layer = next(layer for layer in result["layers"] if layer["name"] == "2")
    assert layer["formats"] == ["fp32", "bf16"] and "past fp16's largest 65504: bf16 or FP32" in layer["reasons"]["16"]
    assert all("16" in other["formats"] for other in result["layers"] if other["name"] != "2")
    return finished, result, layer


def test_the_layer_that_overflows_fp16_leaves_it_for_the_faster_of_bf16_and_fp32_and_says_why(tmp_path, mixprec_cli):
    finished, result, layer = _tune_fragile(tmp_path, mixprec_cli, "--save-profile", tmp_path / "profile.json")
    saved = DeviceProfile.load(tmp_path / "profile.json")  # bf16 timed for every layer, as measured
    assert saved.base == "mixed_fp16" and all("bf16" in timings for timings in saved.entries.values())
    faster = "bf16" if layer["ms"]["bf16"] <= layer["ms"]["fp32"] else "fp32"
    shown = {"bf16": "bf16", "fp32": "FP32"}[faster]
    assert f"kept in {shown} by the doctor: 2 (its values reach" in finished.stderr
    first = next(c for c in result["candidates"] if not c["note"].startswith("uniform"))
    assert first["assignment"]["2"] == faster  # the doctor's move, on this device's timings
    assert result["chosen"]["assignment"]["2"] in ("bf16", "fp32")  # never fp16 (a uniform FP32 may win here)


def test_on_a_gpus_profile_the_fragile_layer_computes_in_bf16_not_fp32(tmp_path, mixprec_cli):
    # an fp16 base's profile as a GPU's reads: FP32 4x slower than 16 bits, bf16 as fast as fp16, FP8 twice as fast
    entries = {}
    for m, k, n in [(32, 16, 32), (32, 32, 32), (32, 32, 4)]:
        ms = GemmShape(m, k, n).flops / 1e9
        entries[f"{m}x{k}x{n}"] = {"fp32": 4 * ms, "16": ms, "fp8": ms / 2, "bf16": ms}
    profile = DeviceProfile("a GPU (test profile)", "mixed_fp16", entries).save(tmp_path / "profile.json")
    finished, result, layer = _tune_fragile(tmp_path, mixprec_cli, "--device-profile", profile)
    assert layer["ms"]["bf16"] == layer["ms"]["16"] < layer["ms"]["fp32"]
    assert result["chosen"]["assignment"]["2"] == "bf16" and "bf16_names=2" in result["chosen"]["policy"]
    assert "kept in bf16 by the doctor: 2 (its values reach" in finished.stderr
    assert math.isfinite(result["verification"]["chosen"]["mean"])
    # FP8 pays on the others in this profile: tried beside the bf16 layer, in one policy
    tried = [c for c in result["candidates"] if c["note"].endswith("in FP8")]
    assert {c["note"] for c in tried} == {"+ 0 in FP8", "+ 4 in FP8"}
    assert all("bf16_names=2" in c["policy"] and "fp8=" in c["policy"] for c in tried)
    assert set(result["fp8_not_tried"]) <= {"2"}


def test_with_no_tolerance_the_chosen_policy_is_within_it_on_its_own_verification(tmp_path, mixprec_cli):
    # the last per-layer policy (the doctor's layer kept in bf16) was chosen at +0.004% against tolerance 0: the
    # reference itself (uniform FP32 here, the fp16 base makes inf) is chosen instead, and the file says so
    entries = {}
    for m, k, n in [(32, 16, 32), (32, 32, 32), (32, 32, 4)]:
        ms = GemmShape(m, k, n).flops / 1e9
        entries[f"{m}x{k}x{n}"] = {"fp32": 4 * ms, "16": ms, "fp8": 2 * ms, "bf16": ms}
    profile = DeviceProfile("a GPU (test profile)", "mixed_fp16", entries).save(tmp_path / "profile.json")
    finished, result, _ = _tune_fragile(tmp_path, mixprec_cli, "--device-profile", profile, "--tolerance", "0")
    verdict = result["verification"]["verdict"]
    assert verdict["within_tolerance"] and verdict["loss_change"] <= 0, verdict
    advice = json.loads((tmp_path / "out" / "policy.json").read_text())
    assert advice["policy"] == result["chosen"]["policy"]
    if "fallback" in verdict:
        assert result["chosen"]["policy"] == "fp32" and verdict["fallback"] in advice["reasons"]
        assert "every verified per-layer policy was past the tolerance" in finished.stderr


NAN_LOSS = """
import torch
from torch import nn
from mixprec.app import TaskParts

def build(config):
    torch.manual_seed(config.seed)
    batches = [(torch.randn(32, 16), torch.randint(0, 4, (32,))) for _ in range(4)]
    return TaskParts(model=nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4)), train_data=batches,
                     eval_data=batches[:2], loss_fn=lambda out, y: nn.functional.cross_entropy(out, y) * float("nan"),
                     defaults={"lr": 1e-3})
"""


def test_a_model_whose_loss_is_nan_in_fp32_too_gets_no_policy_and_exit_1(tmp_path, mixprec_cli):
    # it was tuned, verified at +inf%, and given base=mixed_bf16 with exit 0
    (tmp_path / "nanloss.py").write_text(NAN_LOSS)
    out = tmp_path / "out"
    finished = mixprec_cli("tune", "--model", "nanloss:build", "--trial-steps", "2", "--verify-steps", "2",
                           "--seeds", "1", "--out", out, cwd=tmp_path)  # fmt: skip
    assert finished.returncode == 1, finished.stderr
    last = finished.stderr.strip().splitlines()[-1]
    assert last.startswith("mixprec tune: nanloss:build: the trial runs (2 steps) made inf or NaN") and "doctor" in last
    assert not (out / "policy.json").exists() and "Traceback" not in finished.stderr


ONE_LAYER = """
import torch
from torch import nn
from mixprec.app import TaskParts

def build(config):
    torch.manual_seed(config.seed)
    batches = [(torch.randn(32, 16), torch.randint(0, 4, (32,))) for _ in range(4)]
    return TaskParts(model=nn.Linear(16, 4), train_data=batches, eval_data=batches[:2],
                     loss_fn=nn.functional.cross_entropy, defaults={"lr": 1e-3})
"""


def test_a_model_that_is_itself_one_layer_is_refused_naming_compare(tmp_path, mixprec_cli):
    # its layer's name is "": a per-layer policy wrote "names=", which no policy parses (exit 2 after the search)
    (tmp_path / "one_layer.py").write_text(ONE_LAYER)
    finished = mixprec_cli("tune", "--model", "one_layer:build", "--base", "mixed_fp16", "--out", tmp_path / "out",
                           cwd=tmp_path)  # fmt: skip
    assert finished.returncode == 2 and "Traceback" not in finished.stderr
    last = finished.stderr.strip().splitlines()[-1]
    assert "the model is itself one layer (Linear): there is no per-layer choice" in last
    assert "mixprec compare one_layer:build --policies fp32,mixed_fp16" in last


@pytest.mark.parametrize(
    ("argument", "value"), [("seeds", 0), ("verify_steps", 0), ("trial_steps", 0), ("budget_minutes", 0)]
)
def test_tune_from_python_refuses_counts_below_one_naming_them(tmp_path, argument, value):
    # seeds=0 ended in statistics' "fmean requires at least one data point"; verify_steps=0 verified trial_steps
    with pytest.raises(ValueError, match=rf"tune\({argument}=...\) must be .*received 0"):
        mixprec.tune("digits", out=tmp_path / "out", **{argument: value})
    assert not (tmp_path / "out").exists()


def test_the_budget_stops_the_trials_and_the_verification_still_runs(tmp_path, mixprec_cli):
    start = time.monotonic()
    finished, result = _tune(mixprec_cli, tmp_path / "b", "--device-profile", _profile(tmp_path),
                             "--budget-minutes", "0.001")  # fmt: skip
    assert time.monotonic() - start < 60
    assert "tune: budget reached after 0 FP8 trials" in finished.stderr
    assert not [c for c in result["candidates"] if c["note"].endswith("in FP8")]
    # the layers the budget left out are listed as such (they were missing, read as ruled out by the doctor)
    past = [name for name, why in result["fp8_not_tried"].items() if "budget" in why]
    fp8_faster = [layer["name"] for layer in result["layers"] if "fp8" in layer["formats"]]
    assert past and set(past) <= set(fp8_faster) and f"{len(past)} past the time budget" in finished.stderr
    assert result["chosen"]["policy"] == "base=mixed_bf16" and result["verification"]["verdict"]["within_tolerance"]


def test_profiles_round_trip_predict_unmeasured_shapes_and_refuse_other_files(tmp_path, mixprec_cli):
    path = _profile(tmp_path)
    profile = DeviceProfile.load(path)
    shape = GemmShape(512, 32, 96)  # twice the rows of a measured one: twice its time, at its throughput
    ms, how = profile.layer_ms(shape, "fp8")
    assert ms == pytest.approx(2 * profile.layer_ms(GemmShape(256, 32, 96), "fp8")[0]) and "scaled from" in how
    shapes = {name: GemmShape(*mkn) for name, mkn in CHARLM.items()}
    assert predict({}, shapes, profile, base_step_ms=None).speedup == 1.0
    assert predict({"lm_head": "fp32"}, shapes, profile, base_step_ms=100.0).step_ms > 100.0
    # layers timed alone past the whole step (a busy machine): scaled to fit it, the prediction stays positive
    layers_ms = sum(profile.layer_ms(shape, "16")[0] for shape in shapes.values())
    every_fp8 = {name: "fp8" for name in CHARLM}
    busy = predict(every_fp8, shapes, profile, base_step_ms=layers_ms / 4)
    assert busy.step_ms == pytest.approx(layers_ms / 8, rel=0.02) and busy.speedup == pytest.approx(2.0, rel=1e-3)
    assert any("this prediction is not to be trusted" in note for note in busy.notes)
    assert predict({}, shapes, profile, base_step_ms=layers_ms / 4).step_ms == pytest.approx(layers_ms / 4, rel=0.02)
    (tmp_path / "other.json").write_text('{"something": 1}')
    refused = mixprec_cli("tune", "charlm", *TINY, "--device-profile", tmp_path / "other.json", "--out", tmp_path / "o")
    assert refused.returncode != 0 and "not a device profile mixprec wrote" in refused.stderr
    assert len(refused.stderr.strip().splitlines()) == 1


def test_policies_of_assignments_parse_back_and_the_front_drops_what_is_beaten():
    policy = assignment_policy("mixed_bf16", {"lm_head": "fp32", "blocks.0.mlp.0": "fp8", "blocks.0.attn.qkv": "16"})
    assert (
        policy == "base=mixed_bf16,names=lm_head,fp8=hybrid(scaling=current,keep=none,only=blocks.0.mlp.0,shapes=all)"
    )
    parsed = mixprec.get_policy(policy)
    assert parsed.fp32_names == ("lm_head",) and parsed.fp8.only == ("blocks.0.mlp.0",)

    def candidate(speedup, change):
        return Candidate("p", {}, {"speedup": speedup}, 1.0, change, True)

    a, b, c = candidate(1.0, 0.0), candidate(1.2, 0.001), candidate(1.1, 0.002)  # c: slower and worse than b
    assert pareto_front([a, b, c]) == [a, b]


def test_a_layer_across_blocks_is_one_glob_where_it_names_exactly_those_modules():
    from mixprec.app.tasks.tiny_gpt import GPTConfig, TinyGPT

    modules = [name for name, _ in TinyGPT(GPTConfig(layers=12, width=32, heads=2, context=16)).named_modules()]
    every_mlp_in = {f"blocks.{i}.mlp.0": "fp32" for i in range(12)}
    policy = assignment_policy("mixed_bf16", {**every_mlp_in, "lm_head": "fp32", "blocks.3.attn.qkv": "fp8"}, modules)
    # one glob per index width (? is one character: * would cross dots), the GELU at mlp.1 left out
    assert "names=blocks.?.mlp.0+blocks.??.mlp.0+lm_head," in policy and "only=blocks.3.attn.qkv,shapes=all)" in policy
    fp32 = mixprec.get_policy(policy).fp32_names
    kept = {m for m in modules if any(fnmatch.fnmatchcase(m, glob) for glob in fp32)}
    assert kept == {*every_mlp_in, "lm_head"}  # the same modules as the names, no other
    # a block left in 16 bits: a glob would take it too, so the names stay
    some = assignment_policy("mixed_bf16", {f"blocks.{i}.mlp.0": "fp32" for i in range(12) if i != 3}, modules)
    assert "blocks.?.mlp.0" not in some and "blocks.2.mlp.0+blocks.4.mlp.0" in some and "blocks.??.mlp.0" in some


def test_tune_from_python_takes_a_factory_of_ones_own_and_refuses_a_lambda(tmp_path, monkeypatch):
    (tmp_path / "fragile_task.py").write_text(FRAGILE)
    monkeypatch.syspath_prepend(tmp_path)
    import fragile_task

    said = []
    result = mixprec.tune(fragile_task.build, out=tmp_path / "out", base="mixed_fp16", trial_steps=4, verify_steps=6,
                          seeds=2, progress=said.append)  # fmt: skip
    assert result["task"] == "fragile_task:build" and result["chosen"]["assignment"]["2"] in ("bf16", "fp32")
    assert any(line.startswith("tune: verification") for line in said)
    with pytest.raises(ValueError, match=r"cannot be imported again by its module and name"):
        mixprec.tune(lambda config: fragile_task.build(config), out=tmp_path / "other")
    with pytest.raises(ValueError, match=r"tune\(tolerance=...\): received 2"):
        mixprec.tune("digits", out=tmp_path / "other", tolerance=2)


def test_a_profile_saved_here_predicts_a_later_tune(tmp_path, mixprec_cli):
    saved = tmp_path / "here.json"
    finished, measured = _tune(mixprec_cli, tmp_path / "a", "--save-profile", saved)
    assert measured["device_profile"]["source"] == "measured here"
    assert "cost_model" in measured["verification"]  # predicted against measured steps, measured here
    # measured here, a uniform policy whose verified step was 5% faster than the per-layer one's replaces it
    v = measured["verification"]
    per_layer = v.get("replaced", v["chosen"])  # the verified per-layer policy's runs
    faster = {
        name: v[name]["ms_per_step"] < 0.95 * per_layer["ms_per_step"]
        and (v[name]["mean"] - v["base"]["mean"]) / v["base"]["mean"] <= measured["tolerance"]
        for name in ("base", "fp32")
    }
    if "replaced" in v["verdict"]:
        picked = {"mixed_bf16": "base", "fp32": "fp32"}[measured["chosen"]["policy"]]
        assert faster[picked] and "chosen instead" in finished.stderr
        assert v["chosen"] == v[picked]  # the figures of the policy written, not of the one it replaced
        assert "replaced" in v["cost_model"]["measured_ms"] and "chosen" not in v["cost_model"]["measured_ms"]
    else:
        assert not faster["fp32"] and not (faster["base"] and measured["chosen"]["assignment"])
    profile = DeviceProfile.load(saved)
    assert set(profile.entries) == {f"{m}x{k}x{n}" for m, k, n in CHARLM.values()} | {ATTENTION_SHAPE.key()}
    _, predicted = _tune(mixprec_cli, tmp_path / "b", "--device-profile", saved)
    assert [layer["ms"] for layer in predicted["layers"]] == [layer["ms"] for layer in measured["layers"]]
    assert predicted["chosen"]["prediction"]["scope"] == "layers"
    both = mixprec_cli("tune", "charlm", *TINY, "--device-profile", saved, "--save-profile", tmp_path / "c.json",
                       "--out", tmp_path / "c")  # fmt: skip
    assert both.returncode != 0 and "--save-profile writes the timings measured here" in both.stderr


def test_base_auto_tries_both_16_bit_bases_and_says_which_and_why(tmp_path, mixprec_cli):
    finished, result = _tune(mixprec_cli, tmp_path / "auto", "--base", "auto", "--tolerance", "1%")
    bases = result["bases"]
    bf16, fp16 = bases["trials"]["mixed_bf16"], bases["trials"]["mixed_fp16"]
    change = (fp16["loss"] - bf16["loss"]) / abs(bf16["loss"])
    expected = "mixed_fp16" if fp16["ms_per_step"] < bf16["ms_per_step"] and change <= 0.01 else "mixed_bf16"
    assert bases["chosen"] == result["base"] == expected  # by the rule, whichever this machine made faster
    assert f"tune: base auto: mixed_fp16 {fp16['ms_per_step']:.2f} ms a step" in finished.stderr
    chosen = result["chosen"]["policy"]  # the per-layer policy, or a uniform one that measured faster here
    assert (
        chosen.startswith(f"base={expected}")
        or chosen == expected
        or (chosen == "fp32" and result["verification"]["verdict"]["replaced"].startswith(f"base={expected}"))
    )
    refused = mixprec_cli("tune", "charlm", *TINY, "--base", "auto", "--device-profile", _profile(tmp_path),
                          "--out", tmp_path / "x")  # fmt: skip
    assert refused.returncode != 0 and "auto measures both bases on the device at hand" in refused.stderr


def test_convolutions_are_shaped_timed_and_take_fp32_or_16_bits(tmp_path, mixprec_cli):
    model = nn.Sequential(nn.Conv2d(3, 8, 3, stride=2, padding=1), nn.Conv1d(8, 4, 5, padding="same"), nn.Linear(6, 2))
    calls = lambda m, x: m[2](m[1](m[0](x).flatten(2)).repeat(1, 1, 1)[..., :6])  # noqa: E731
    shapes = layer_shapes(model, torch.randn(2, 3, 16, 16), calls)
    conv2d = ConvShape(2, 3, (16, 16), 8, (3, 3), (2, 2), (1, 1), (1, 1), 1)
    assert shapes == {"0": conv2d, "1": ConvShape(2, 8, (64,), 4, (5,), (1,), "same", (1,), 1),
                      "2": GemmShape(8, 6, 2)}  # fmt: skip
    assert conv2d.output_size == (8, 8) and conv2d.flops == 6 * 2 * 64 * 8 * 3 * 9  # positions x out x in x kernel
    assert all(shape_from_key(s.key()) == s for s in shapes.values())  # a profile's keys name them back
    gemm_only = DeviceProfile("gpu", "mixed_bf16", {"8x6x2": {"fp32": 2.0, "16": 1.0, "fp8": 0.5}})
    ms, how = gemm_only.layer_ms(conv2d, "16")  # a profile without convolutions: scaled, and said so
    assert ms == pytest.approx(conv2d.flops / GemmShape(8, 6, 2).flops) and "a layer of another kind" in how

    finished = mixprec_cli("tune", "digits", *TINY, "--out", tmp_path / "digits", "--save-profile", tmp_path / "p.json")
    assert finished.returncode == 0, finished.stderr
    assert "1 GEMM layers, 3 convolutions" in finished.stderr
    result = json.loads((tmp_path / "digits" / "tune.json").read_text())
    convolutions = [layer for layer in result["layers"] if layer["kind"] == "convolution"]
    assert len(convolutions) == 3 and all(set(layer["ms"]) == {"fp32", "16"} for layer in convolutions)
    assert all(
        layer["formats"] == ["fp32", "16"] and "a convolution" in layer["reasons"]["fp8"] for layer in convolutions
    )
    assert all(result["chosen"]["assignment"].get(layer["name"], "16") in ("fp32", "16") for layer in convolutions)
    assert {layer["key"] for layer in convolutions} <= set(DeviceProfile.load(tmp_path / "p.json").entries)
    assert convolutions[0]["key"] in (tmp_path / "digits" / "report.md").read_text()


def test_attention_is_one_layer_of_fp32_or_16_bits_and_fp32_where_the_profile_finds_it_faster(tmp_path, mixprec_cli):
    from mixprec.app.task import TaskConfig, build_task
    from mixprec.app.tune.layers import ATTENTION

    parts = build_task("charlm", TaskConfig(None, 0, "cpu", "tiny"))
    x, _ = next(iter(parts.train_data))
    shapes = layer_shapes(parts.model, x, lambda model, inputs: model(inputs))
    assert shapes[ATTENTION] == ATTENTION_SHAPE and shape_from_key(ATTENTION_SHAPE.key()) == ATTENTION_SHAPE
    policy = assignment_policy("mixed_bf16", {ATTENTION: "fp32", "lm_head": "fp32"})
    assert policy == "base=mixed_bf16,names=lm_head,ops=scaled_dot_product_attention"
    assert mixprec.get_policy(policy).fp32_ops == ("scaled_dot_product_attention",)

    profile = DeviceProfile.load(_profile(tmp_path))  # FP32 attention at a quarter of its 16 bits' time
    profile.entries[ATTENTION_SHAPE.key()]["fp32"] = profile.entries[ATTENTION_SHAPE.key()]["16"] / 4
    path = DeviceProfile("a CPU without fast bf16", "mixed_bf16", profile.entries).save(tmp_path / "a.json")
    finished, result = _tune(mixprec_cli, tmp_path / "t", "--device-profile", path, "--tolerance", "50%")
    assert "attention (1 calls)" in finished.stderr
    first = next(c for c in result["candidates"] if c["note"] == "the layers faster in FP32 than in 16 bits")
    assert first["assignment"] == {ATTENTION: "fp32"} and "ops=scaled_dot_product_attention" in first["policy"]
    assert "ops=scaled_dot_product_attention" in result["chosen"]["policy"]
    layer = next(layer for layer in result["layers"] if layer["name"] == ATTENTION)
    assert (
        layer["kind"] == "attention"
        and layer["formats"] == ["fp32", "16"]
        and "GEMM layers only" in (layer["reasons"]["fp8"])
    )


def test_attention_of_several_shapes_is_left_to_the_base_and_said():
    class TwoLengths(nn.Module):
        def forward(self, x):
            a = F.scaled_dot_product_attention(x, x, x)
            return a.sum() + F.scaled_dot_product_attention(x[:, :, :4], x[:, :, :4], x[:, :, :4]).sum()

    said = []
    shapes = layer_shapes(TwoLengths(), torch.randn(1, 2, 8, 4), lambda model, x: model(x), said.append)
    assert shapes == {}
    assert said == ["tune: attention not searched: its 2 calls have 2 shapes (the cost model takes one)"]
