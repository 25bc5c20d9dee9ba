"""The per-machine kernel choice: decided by timing (a fake timing source here), cached, overridable."""

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec
from mixprec.compute.emulation import EmulatedAutocast
from mixprec.compute.kernels import CACHE_VERSION, FAMILIES, kernel_plan
from mixprec.regions.plan import compute_plan

FP16, BF16 = torch.float16, torch.bfloat16


class FakeTimer:
    """Milliseconds per (family, candidate) from a table; counts the calls."""

    def __init__(self, table):
        self.table = table
        self.calls = []

    def __call__(self, family, candidate):
        self.calls.append((family, candidate))
        return self.table.get((family, candidate), self.table.get(candidate, 1.0))


def test_emulation_is_chosen_where_native_kernels_are_slower():
    # The AVX512-FP16 Xeon: fp16 matmul about FP32's speed, conv backward ~100x slower.
    timer = FakeTimer(
        {
            ("matmul", "native"): 13.6,
            ("matmul", "emulated"): 14.0,
            ("conv", "native"): 3650.0,
            ("conv", "emulated"): 36.0,
            ("attention", "native"): 9.0,
            ("attention", "emulated"): 7.0,
        }
    )
    plan = kernel_plan(FP16, timer=timer)
    assert plan.choices == {"matmul": "native", "conv": "emulated", "attention": "emulated"}
    assert plan.mode == "hybrid" and plan.source == "measured"
    assert plan.timings_ms["conv"] == {"native": 3650.0, "emulated": 36.0}
    assert "conv emulated (native 3650.00 ms, emulated 36.00 ms)" in plan.describe()
    assert "conv2d" in plan.emulated_ops and "linear" not in plan.emulated_ops


def test_a_much_slower_candidate_is_timed_once_after_its_warm_up():
    timer = FakeTimer({"native": 100.0, "emulated": 1.0})
    plan = kernel_plan(FP16, timer=timer)
    assert plan.mode == "emulated"
    for family in FAMILIES:
        assert timer.calls.count((family, "native")) == 2  # warm-up + one timed run, then dropped
        assert timer.calls.count((family, "emulated")) == 4  # warm-up + three timed runs


def test_bf16_attention_chooses_among_three_kernels():
    timer = FakeTimer(
        {
            ("attention", "gemm"): 18.1,
            ("attention", "native"): 22.8,
            ("attention", "emulated"): 21.1,
            "native": 1.0,
            "emulated": 2.0,
        }
    )
    plan = kernel_plan(BF16, timer=timer)
    assert plan.choices == {"matmul": "native", "conv": "native", "attention": "gemm"}
    assert plan.mode == "native"  # gemm attention is bf16 GEMMs: a native kernel


def test_the_cache_is_used_and_invalidated_by_a_new_torch(tmp_path, monkeypatch):
    timer = FakeTimer({"native": 5.0, "emulated": 1.0})
    first = kernel_plan(FP16, timer=timer, cache_dir=tmp_path)
    measured = len(timer.calls)
    assert first.source == "measured" and measured > 0
    second = kernel_plan(FP16, timer=timer, cache_dir=tmp_path)
    assert timer.calls[measured:] == [("matmul", "fp32")] * 2  # read from the cache: only the busy check timed
    assert second.choices == first.choices and second.timings_ms == first.timings_ms
    assert second.source.startswith("cached in ")
    monkeypatch.setattr(torch, "__version__", "9.9.9+other")
    third = kernel_plan(FP16, timer=FakeTimer({"native": 1.0, "emulated": 5.0}), cache_dir=tmp_path)
    assert third.source == "measured" and third.mode == "native"
    entries = json.loads((tmp_path / "kernels.json").read_text())["entries"]
    assert [key for key in entries if "torch 9.9.9+other" in key] == list(entries)  # the stale torch's entry is gone


def test_a_cache_taken_on_a_busy_machine_is_measured_again(tmp_path):
    busy = FakeTimer({"fp32": 84.0, "native": 92.0, "emulated": 176.0})  # contention: fp16 "native" wins
    assert kernel_plan(FP16, timer=busy, cache_dir=tmp_path).choices["matmul"] == "native"
    quiet = FakeTimer({"fp32": 4.5, "native": 94.0, "emulated": 15.3})  # the same machine, quiet
    again = kernel_plan(FP16, timer=quiet, cache_dir=tmp_path)
    assert again.source == "measured" and again.choices["matmul"] == "emulated"
    slower_now = FakeTimer({"fp32": 40.0, "native": 1.0, "emulated": 1.0})  # busy now: the quiet probe is kept
    kept = kernel_plan(FP16, timer=slower_now, cache_dir=tmp_path)
    assert kept.source.startswith("cached in ") and kept.choices["matmul"] == "emulated"


def test_a_damaged_cache_is_measured_again(tmp_path):
    (tmp_path / "kernels.json").write_text('{"version": 1, "entries": {"x": [')
    timer = FakeTimer({"native": 5.0, "emulated": 1.0})
    assert kernel_plan(FP16, timer=timer, cache_dir=tmp_path).source == "measured"
    assert json.loads((tmp_path / "kernels.json").read_text())["version"] == CACHE_VERSION  # and rewritten whole


def test_the_environment_overrides_the_measurement(monkeypatch):
    monkeypatch.setenv("MIXPREC_FP16_CPU", "native")
    timer = FakeTimer({"native": 100.0, "emulated": 1.0})
    plan = kernel_plan(FP16, timer=timer)
    assert plan.mode == "native" and plan.source == "MIXPREC_FP16_CPU=native" and timer.calls == []
    monkeypatch.setenv("MIXPREC_FP16_CPU", "emulate")
    assert kernel_plan(FP16, timer=timer).mode == "emulated"
    assert kernel_plan(BF16, timer=FakeTimer({"native": 1.0, "emulated": 2.0})).mode == "native"  # fp16 only
    # the policy's own key is stronger than the environment
    assert kernel_plan(FP16, kernels="native").source == "policy kernels=native"
    monkeypatch.setenv("MIXPREC_FP16_CPU", "fast")
    with pytest.raises(ValueError, match=r"MIXPREC_FP16_CPU='fast' is not a kernel setting; use native, emulate"):
        kernel_plan(FP16, timer=timer)


def test_the_policy_key_round_trips_and_refuses_unknown_values():
    policy = mixprec.get_policy("base=mixed_fp16,kernels=emulated")
    assert policy.kernels == "emulated" and "kernels=emulated" in str(policy)
    assert mixprec.get_policy(str(policy)) == policy
    assert "kernels" not in str(mixprec.get_policy("mixed_fp16"))  # auto is the default, not written
    with pytest.raises(ValueError, match=r"kernels=\.\.\.\): received 'fast'; use one of auto, native, emulated"):
        mixprec.get_policy("p=f32,c=f16,kernels=fast")


class _ConvThenLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.head = nn.Linear(4 * 6 * 6, 5)

    def forward(self, x):
        return self.head(torch.relu(self.conv(x)).flatten(1))


def test_a_hybrid_region_emulates_only_the_slow_families(kernel_cache):
    kernel_cache(FP16, conv="emulated")  # matmul and attention native, conv emulated
    plan = compute_plan(mixprec.get_policy("mixed_fp16"), "cpu")
    assert plan.mode == "hybrid" and plan.kernel("conv") == "emulated" and plan.kernel("matmul") == "native"
    torch.manual_seed(0)
    model, x = _ConvThenLinear(), torch.randn(2, 3, 8, 8)
    with mixprec.autocast("base=mixed_fp16,o=f16", model):
        conv_out = model.conv(x)
        out = model(x)
    half = lambda t: t.to(FP16).float()  # noqa: E731
    expected_conv = F.conv2d(half(x), half(model.conv.weight), half(model.conv.bias)).to(FP16)
    assert conv_out.dtype == FP16 and torch.equal(conv_out, expected_conv)  # FP32 arithmetic, fp16 rounding
    with torch.autocast("cpu", dtype=FP16):
        expected = model.head(torch.relu(expected_conv).flatten(1))  # PyTorch's own fp16 linear
    assert torch.equal(out, expected)
    out.float().sum().backward()  # the backward runs through both kinds of op
    assert model.conv.weight.grad is not None and model.head.weight.grad is not None


def test_a_hybrid_region_keeps_fp32_modules_and_ops_in_fp32(kernel_cache):
    kernel_cache(FP16, matmul="emulated")
    torch.manual_seed(0)
    model, x = _ConvThenLinear(), torch.randn(2, 3, 8, 8)
    with mixprec.autocast("base=mixed_fp16,names=head,o=f16", model):
        out = model(x)
    assert out.dtype == FP16  # the output cast; the head itself ran in FP32:
    with torch.autocast("cpu", dtype=FP16):
        features = torch.relu(model.conv(x)).flatten(1)
    torch.testing.assert_close(out, model.head(features.float()).to(FP16), rtol=0, atol=0)
    with mixprec.autocast("base=mixed_fp16,ops=linear", model):
        assert model.head(torch.randn(2, 144)).dtype == torch.float32  # the policy's FP32 op wins
    with EmulatedAutocast(FP16, only=frozenset({"linear"})), torch.autocast("cpu", dtype=FP16):
        assert torch.relu(torch.randn(3).half()).dtype == FP16  # untouched ops: autocast's own rules


def test_the_fp32_reference_is_timed_but_never_chosen():
    timer = FakeTimer({"fp32": 0.5, "native": 2.0, "emulated": 1.0})
    plan = kernel_plan(FP16, timer=timer)
    assert plan.choices["matmul"] == "emulated" and plan.timings_ms["matmul"]["fp32"] == 0.5
    assert plan.matmul_speedup() == 0.5
    assert ("conv", "fp32") not in timer.calls  # matmuls only


@pytest.mark.parametrize(
    ("bf16_ms", "fp16_ms", "expected"),
    [(0.1, 0.4, BF16), (0.39, 0.1, FP16), (0.39, 0.39, torch.float32), (0.39, 5.0, torch.float32)],
)
def test_auto_on_a_cpu_follows_the_measured_matmul_speed(kernel_cache, bf16_ms, fp16_ms, expected):
    # FP32 at 0.4 ms: faster than this machine's matmul, so the cache never looks taken on a busy machine
    kernel_cache(BF16, timings_ms={"matmul": {"native": bf16_ms, "emulated": 0.9, "fp32": 0.4}})
    fp16_kernel = "native" if fp16_ms < 0.45 else "emulated"  # the faster of native and emulated (0.45 ms)
    kernel_cache(FP16, timings_ms={"matmul": {"native": fp16_ms, "emulated": 0.45, "fp32": 0.4}}, matmul=fp16_kernel)
    policy = mixprec.get_policy("auto", device="cpu")
    assert policy.compute_dtype == expected
    assert policy.reason.startswith("auto on CPU") and "measured" in policy.reason
