import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mixprec

OPS = {
    "softmax": lambda a: torch.softmax(a, dim=-1),
    "exp": lambda a: a.exp(),
    "gelu": F.gelu,
    "matmul": lambda a: a @ a,
    "mm": lambda a: torch.mm(a, a),
    "linear": lambda a: F.linear(a, a),
}


def _input(op: str, device: str) -> torch.Tensor:
    x = torch.randn(4, 4, device=device)
    return x.bfloat16() if op in ("softmax", "exp", "gelu") else x  # elementwise ops see a bf16 input


# CUDA autocast's lists: what an emulated region follows on every device (CPU autocast keeps exp in bf16).
CUDA_AUTOCAST_DTYPE = {"softmax": torch.float32, "exp": torch.float32, "gelu": torch.bfloat16,
                       "matmul": torch.bfloat16, "mm": torch.bfloat16, "linear": torch.bfloat16}  # fmt: skip


@pytest.mark.parametrize("op", sorted(OPS))
def test_listed_op_returns_fp32_unlisted_follows_torch_autocast(op, device):
    fn, lowp = OPS[op], _input(op, device)
    native = mixprec.get_policy("mixed_bf16").replace(kernels="native")  # the same on every CPU
    with torch.autocast(device, dtype=torch.bfloat16):
        torch_dtype = fn(lowp).dtype
    with mixprec.autocast(native, device=device):
        unlisted = fn(lowp)
    with mixprec.autocast(native.replace(fp32_ops=(op,)), device=device):
        listed = fn(lowp)
    assert unlisted.dtype == torch_dtype
    assert listed.dtype == torch.float32
    if torch.device(device).type == "cpu":
        assert torch_dtype == torch.bfloat16  # so the listing made a difference
    else:
        assert torch_dtype == CUDA_AUTOCAST_DTYPE[op]  # CUDA autocast runs softmax and exp in FP32 already
    torch.testing.assert_close(listed, fn(lowp.float()))  # computed in FP32 from the same inputs


@pytest.mark.parametrize("op", sorted(OPS))
def test_emulated_regions_follow_cuda_autocasts_lists_and_listed_ops_run_in_fp32(op, device):
    fn, lowp = OPS[op], _input(op, device)
    emulated = mixprec.get_policy("mixed_bf16").replace(kernels="emulated")
    with mixprec.autocast(emulated, device=device):
        unlisted = fn(lowp)
    with mixprec.autocast(emulated.replace(fp32_ops=(op,)), device=device):
        listed = fn(lowp)
    assert unlisted.dtype == CUDA_AUTOCAST_DTYPE[op]
    assert listed.dtype == torch.float32
    torch.testing.assert_close(listed, fn(lowp.float()))


def test_region_outputs_cast_to_output_dtype():
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    with mixprec.autocast("mixed_bf16", model):
        assert model(torch.randn(3, 4)).dtype == torch.float32
    with mixprec.autocast("p=f32,c=bf16", model):  # output follows compute
        assert model(torch.randn(3, 4)).dtype == torch.bfloat16
    assert model(torch.randn(3, 4)).dtype == torch.float32  # hooks gone after the region


def test_nested_outputs_are_cast():
    class Two(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            y = self.lin(x)
            return {"logits": y, "pair": (y, torch.arange(3))}

    model = Two()
    with mixprec.autocast("mixed_bf16", model):
        out = model(torch.randn(2, 4))
    assert out["logits"].dtype == out["pair"][0].dtype == torch.float32
    assert out["pair"][1].dtype == torch.int64


def test_a_dataclass_output_is_cast():
    # a model's own output type (HF's ModelOutput is a mapping too): its tensors were left in bf16, for the loss
    @dataclasses.dataclass(frozen=True)
    class Output:
        logits: torch.Tensor
        extra: dict
        step: int = 0

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            y = self.lin(x)
            return Output(y, {"hidden": y}, step=3)

    model = Model()
    with mixprec.autocast("mixed_bf16", model):
        out = model(torch.randn(2, 4))
    assert type(out) is Output and out.step == 3
    assert out.logits.dtype == out.extra["hidden"].dtype == torch.float32


def test_fp32_modules_compute_in_fp32():
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 8), nn.Linear(8, 2))
    seen = {}
    for name, module in model.named_children():
        module.register_forward_hook(lambda m, a, o, name=name: seen.__setitem__(name, (a[0], o)))
    policy = mixprec.get_policy("mixed_bf16").replace(fp32_names=("1",))
    with mixprec.autocast(policy, model):
        model(torch.randn(3, 4))
    assert seen["0"][1].dtype == torch.bfloat16
    given, out = seen["1"]  # the bf16 input it was given, computed in FP32
    assert out.dtype == torch.float32
    assert torch.equal(out, nn.functional.linear(given.float(), model[1].weight, model[1].bias))
    assert seen["2"][1].dtype == torch.bfloat16  # autocast resumes after the FP32 module


def test_o2_model_runs_with_norms_in_fp32():
    model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 2))
    policy = mixprec.get_policy("o2_fp16")
    mixprec.cast_module(model, policy)
    seen = {}
    model[1].register_forward_hook(lambda m, a, o: seen.__setitem__("norm", (a[0].dtype, o.dtype)))
    with mixprec.autocast(policy, model):
        out = model(torch.randn(3, 4))
    assert seen["norm"][0] == torch.float16  # fp16 in; out as autocast's FP32 list says (FP32 on CUDA)
    out.sum().backward()
    assert out.dtype == torch.float32
    assert model[1].weight.grad.dtype == torch.float32 and model[0].weight.grad.dtype == torch.float16


class FailingNorm(nn.LayerNorm):
    fail = True

    def forward(self, x):
        if self.fail:
            raise RuntimeError("boom")
        return super().forward(x)


def test_fp32_norms_run_their_mixed_dtype_kernels_under_native_bf16():
    model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 2))
    policy = mixprec.get_policy("o2_bf16").replace(kernels="native")  # emulated on CPUs without bf16 units
    mixprec.cast_module(model, policy)
    seen = {}
    model[1].register_forward_hook(lambda m, a, o: seen.__setitem__("norm", (a[0].dtype, o.dtype)))
    with mixprec.autocast(policy, model, device="cpu"):
        model(torch.randn(3, 4)).sum().backward()
    # FP32 parameters and FP32 arithmetic inside the kernel, bf16 in and out: no FP32 copy of its input
    assert seen["norm"] == (torch.bfloat16, torch.bfloat16)
    assert model[1].weight.dtype == model[1].weight.grad.dtype == torch.float32


@pytest.mark.parametrize("fail_before_region_hooks", [False, True])
def test_state_restored_after_an_exception(fail_before_region_hooks):
    model = nn.Sequential(nn.Linear(4, 4), FailingNorm(4))
    policy = mixprec.get_policy("mixed_bf16").replace(fp32_modules=("norm",), fp32_ops=("exp",))
    if fail_before_region_hooks:  # a user hook that raises before mixprec's pre-hook runs
        model[1].register_forward_pre_hook(lambda m, a: (_ for _ in ()).throw(RuntimeError("boom")))
    with pytest.raises(RuntimeError, match="boom"), mixprec.autocast(policy, model):
        model(torch.randn(2, 4))
    assert not torch.is_autocast_enabled("cpu")
    assert torch.exp(torch.ones(1, dtype=torch.bfloat16)).dtype == torch.bfloat16  # op mode gone
    # hooks gone: under plain autocast the norm now sees bf16 input and returns bf16 on CPU
    model = nn.Sequential(nn.Linear(4, 4), FailingNorm(4)) if fail_before_region_hooks else model
    model[1].fail = False
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert model(torch.randn(2, 4)).dtype == torch.bfloat16
    with mixprec.autocast(policy, model):
        assert model(torch.randn(2, 4)).dtype == torch.float32


@pytest.mark.parametrize("policy", ["mixed_bf16,kernels=native", "mixed_bf16,kernels=emulated", "fp32"])
def test_region_owns_the_precision_inside_an_outer_autocast_and_restores_it(policy):
    name, _, kernels = policy.partition(",kernels=")
    inner = mixprec.get_policy(name).replace(kernels=kernels or "auto")
    expected = torch.float32 if name == "fp32" else torch.bfloat16
    with torch.autocast("cpu", dtype=torch.float16):
        with mixprec.autocast(inner, device="cpu"):
            assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == expected  # not the outer region's fp16
        assert torch.get_autocast_dtype("cpu") == torch.float16 and torch.is_autocast_enabled("cpu")


def test_tf32_on_cpu_is_plain_fp32():
    before = torch.get_float32_matmul_precision()
    with mixprec.autocast("tf32", device="cpu") as policy:
        assert torch.get_float32_matmul_precision() == before
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.float32
    assert policy.allow_tf32
    assert "no TF32 units" in mixprec.device_caps("cpu").tf32_note


def test_region_yields_resolved_policy():
    with mixprec.autocast("auto", device="cpu") as policy:
        assert policy == mixprec.get_policy("auto", device="cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_device_that_cannot_compute_is_refused():
    with (
        pytest.raises(ValueError, match=r"compute=float16 cannot run on no CUDA device"),
        mixprec.autocast("mixed_fp16", device="cuda"),
    ):
        pass


def test_bad_device():
    with (
        pytest.raises(ValueError, match=r"device='gpu0' \(of type str\) is not a device"),
        mixprec.autocast("mixed_bf16", device="gpu0"),
    ):
        pass
