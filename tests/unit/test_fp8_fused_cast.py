"""The compiled FP8 cast (a recipe's ``cast=compiled``: one pass per operand after its amax) equals the eager
operations it compiles, on every device (the GPU check runs the CUDA twins)."""

from __future__ import annotations

import math

import pytest
import torch

from mixprec.policy.fp8_recipe import Fp8Recipe
from mixprec.regions.fp8 import ScaleState, compiled_cast_failures, scaled_cast


def _operands(device: torch.device, dtype: torch.dtype) -> list[torch.Tensor]:
    """Values over many binades, with zeros, subnormal-sized values, and the non-finite values an overflow brings."""
    generator = torch.Generator().manual_seed(0)
    wide = torch.randn(96, 80, generator=generator) * torch.exp2(torch.randint(-30, 30, (96, 80), generator=generator))
    wide[0, :8] = 0.0
    small = torch.randn(33, 48, generator=generator) * 2.0**-20
    overflow = torch.randn(40, 32, generator=generator)
    overflow[3, 4], overflow[5, 6], overflow[7, 8] = math.inf, -math.inf, math.nan
    infinite = torch.randn(24, 16, generator=generator)  # infinities and no NaN: the amax is inf, the scale 1
    infinite[1, 2], infinite[3, 4] = math.inf, -math.inf
    limit = torch.finfo(dtype).max  # the finite values within the dtype; the non-finite ones kept
    operands = [torch.where(t.isfinite(), t.clamp(-limit, limit), t) for t in (wide, small, overflow, infinite)]
    return [t.to(device, dtype) for t in operands]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values, NaN equal to NaN (the compiled cast may set a NaN's sign bit otherwise)."""
    return (
        a.dtype == b.dtype
        and torch.equal(a.float().nan_to_num(nan=7.0), b.float().nan_to_num(nan=7.0))
        and bool((a.float().isnan() == b.float().isnan()).all())
    )


# a compile that failed would fall back to the eager path the test holds it to: fail instead
@pytest.mark.filterwarnings("error:.*compiling the FP8 cast failed:RuntimeWarning")
@pytest.mark.parametrize("scaling", ["current", "delayed"])
@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2"])
def test_compiled_cast_equals_eager(device: str, scaling: str, fmt: str) -> None:
    options = {"forward": fmt, "backward": fmt, "scaling": scaling, "history": 4, "margin": int(fmt == "fp8_e5m2")}
    device = torch.device(device)
    eager = ScaleState(fmt, Fp8Recipe(**options), device)
    compiled = ScaleState(fmt, Fp8Recipe(**options, cast="compiled"), device)
    for dtype in (torch.bfloat16, torch.float32):
        for tensor in _operands(device, dtype):
            want_q, want_scale, want_decode = scaled_cast(tensor, eager, decode=True)
            got_q, got_scale, got_decode = scaled_cast(tensor, compiled, decode=True)
            assert torch.equal(got_scale, want_scale), (dtype, tuple(tensor.shape))
            assert torch.equal(got_decode, want_decode) and torch.equal(
                got_decode * got_scale, torch.ones_like(got_scale)
            )
            assert _same(got_q, want_q), (dtype, tuple(tensor.shape))
            # the delayed state's history and count are updated in place, equally
            assert torch.equal(compiled.history, eager.history) and torch.equal(compiled.recorded, eager.recorded)
    if scaling == "delayed":
        assert int(eager.recorded) == 4  # the non-finite amaxes left out: 8 casts, 4 of them overflowing


@pytest.mark.filterwarnings("error:.*compiling the FP8 cast failed:RuntimeWarning")
@pytest.mark.parametrize("cast", ["eager", "compiled"])
def test_a_cast_that_does_not_record_reads_the_delayed_history_and_leaves_it(device: str, cast: str) -> None:
    # a forward without gradients (an evaluation) recorded its amaxes, changing the training's later scales
    device = torch.device(device)
    state = ScaleState("fp8_e4m3", Fp8Recipe(scaling="delayed", history=4, cast=cast), device)
    first, second = (torch.randn(64, 32, generator=torch.Generator().manual_seed(s)).to(device) for s in (0, 1))
    scaled_cast(first, state)  # recorded: the history the next scales read
    history, recorded = state.history.clone(), state.recorded.clone()
    _, scale = scaled_cast(second * 1000, state, record=False)
    assert torch.equal(state.history, history) and torch.equal(state.recorded, recorded)
    _, recorded_scale = scaled_cast(second * 1000, state)  # the same scale, from the same history, now recorded
    assert torch.equal(scale, recorded_scale) and int(state.recorded) == 2


def test_scaled_cast_is_scale_for_then_cast() -> None:
    """The eager path is the ScaleState's scale and cast_to_fp8_storage, as the FP8 Linear used them before."""
    from mixprec.regions.fp8.scaling import cast_to_fp8_storage

    recipe = Fp8Recipe(scaling="delayed", history=3)
    a, b = ScaleState("fp8_e4m3", recipe), ScaleState("fp8_e4m3", recipe)
    for tensor in _operands(torch.device("cpu"), torch.float32):
        q, scale = scaled_cast(tensor, a)
        want_scale = b.scale_for(tensor)
        assert torch.equal(scale, want_scale)
        assert _same(q, cast_to_fp8_storage(tensor, want_scale, "fp8_e4m3"))


def test_compiled_cast_is_a_recipe_option_of_the_per_tensor_scalings() -> None:
    from mixprec.policy import get_policy

    assert get_policy("base=fp8,fp8=hybrid(cast=compiled)").fp8 == Fp8Recipe(cast="compiled")
    assert str(Fp8Recipe(scaling="delayed", cast="compiled")) == "hybrid(scaling=delayed,cast=compiled)"
    with pytest.raises(ValueError, match=r"cast=\.\.\.\): received 'fused'; use one of eager, compiled"):
        Fp8Recipe(cast="fused")
    with pytest.raises(ValueError, match="scaling='rowwise' casts per row or block"):
        Fp8Recipe(scaling="rowwise", cast="compiled")


@pytest.mark.filterwarnings("error:.*compiling the FP8 cast failed:RuntimeWarning")
def test_every_layer_shape_shares_the_compiled_pass() -> None:
    """A model's many shapes (square ones too), weights as Parameters and two dtypes stay within dynamo's
    recompile limit, which would otherwise end the compiled cast for the rest of the process."""
    state, eager = ScaleState("fp8_e4m3", Fp8Recipe(cast="compiled")), ScaleState("fp8_e4m3", Fp8Recipe())
    shapes = [(64, 48), (48, 48), (96, 48), (48, 96), (96, 96), (7, 48), (128, 64), (64, 64), (3, 5, 16), (300,)]
    for dtype in (torch.float32, torch.bfloat16):
        for shape in shapes:
            tensor = torch.nn.Parameter(torch.randn(shape).to(dtype)) if len(shape) == 2 else torch.randn(shape)
            q, scale = scaled_cast(tensor, state)
            want_q, want_scale = scaled_cast(tensor, eager)
            assert q.shape == tensor.shape and torch.equal(scale, want_scale) and _same(q, want_q)


@pytest.mark.filterwarnings("error:.*compiling the FP8 cast failed:RuntimeWarning")
@pytest.mark.parametrize("scaling", ["current", "delayed"])
def test_training_with_the_compiled_cast_equals_the_eager_cast_bit_for_bit(device: str, scaling: str) -> None:
    """Steps at three batch sizes (one of a single row), an evaluation under inference mode, and an overflowing
    step (an infinite input: its gradient, e5m2, must stay infinite for the step to be skipped), all within the
    compiled cast's variants, and the same weights as the eager cast at the end."""
    import mixprec

    def train(cast: str) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4)).to(device)
        policy = f"base=fp8,fp8=(scaling={scaling},cast={cast},keep=none,shapes=all)"  # FP8 whatever its speed
        mp = mixprec.MixedPrecision(model, torch.optim.AdamW(model.parameters(), lr=1e-2), policy)
        assert mp.policy.fp8.cast == cast and mixprec.regions.fp8.fp8_layers(model, mp.policy.fp8)
        data = torch.Generator().manual_seed(1)
        for step, rows in enumerate((24, 7, 24, 1, 24)):
            x, y = torch.randn(rows, 16, generator=data), torch.randint(0, 4, (rows,), generator=data)
            if step == 2:
                x[0, 0] = math.inf
            with mp.autocast():
                loss = torch.nn.functional.cross_entropy(model(x.to(device)).float(), y.to(device))
            mp.backward(loss)
            assert bool(mp.step()) == (step != 2)  # the overflowing step skipped
            with torch.inference_mode(), mp.autocast():
                model(torch.randn(5, 16, generator=data).to(device))
        return [p.detach().cpu().clone() for p in model.parameters()]

    assert all(torch.equal(a, b) for a, b in zip(train("compiled"), train("eager"), strict=True))
    assert compiled_cast_failures() == {}


def test_a_compiled_cast_keeps_e5m2_infinities(device: str) -> None:
    """Traced by torch.compile (a compiled training step), the saturating cast still gives ±inf for ±inf: an
    overflowing gradient stays non-finite for the loss scaler (Triton's own cast to e5m2 saturates on Hopper)."""
    from mixprec.regions.fp8 import cast_to_fp8

    values = torch.tensor([math.inf, -math.inf, 1e9, -3.0, math.nan], device=device)
    eager = cast_to_fp8(values, torch.tensor(1.0, device=device), "fp8_e5m2")
    compiled = torch.compile(lambda t: cast_to_fp8(t, torch.ones((), device=t.device), "fp8_e5m2"), fullgraph=True)
    got = compiled(values)
    assert got[:4].tolist() == eager[:4].tolist() == [math.inf, -math.inf, 57344.0, -3.0]
    assert got[4].isnan() and eager[4].isnan()


@pytest.mark.filterwarnings("error:.*compiling the FP8 cast failed:RuntimeWarning")
def test_under_a_dispatch_mode_the_cast_runs_eager_and_compiles_after() -> None:
    """torch.compile cannot trace under a user's TorchDispatchMode (FlopCounterMode around a step): the cast runs
    eagerly there, records no failure, and compiles once outside (a failure would have ended it for good)."""
    import torch._dynamo.config
    from torch.utils.flop_counter import FlopCounterMode

    recipe = Fp8Recipe(forward="fp8_e5m2", backward="fp8_e5m2", margin=2, cast="compiled")  # a key of its own
    state, eager = ScaleState("fp8_e5m2", recipe), ScaleState("fp8_e5m2", Fp8Recipe(margin=2))
    for tensor in _operands(torch.device("cpu"), torch.float32):
        with FlopCounterMode(display=False):
            q, scale = scaled_cast(tensor, state)
        want_q, want_scale = scaled_cast(tensor, eager)
        assert torch.equal(scale, want_scale) and _same(q, want_q)
        assert compiled_cast_failures() == {} and torch._dynamo.config.assume_static_by_default
        q, scale = scaled_cast(tensor, state)  # outside the mode: the compiled pass
        assert torch.equal(scale, want_scale) and _same(q, want_q)


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2"])
def test_the_cast_under_a_tensors_own_scale_equals_the_saturating_cast(device: str, fmt: str) -> None:
    """own_scale_cast leaves out the clamp (and e5m2's infinity test): with a scale from the tensor's own amax, per
    tensor or per row, no finite value passes the format's largest. Held to the full saturating cast over many
    binades, zeros, subnormal-sized values, infinities and NaN, in FP32 and bf16, margins 0 and 2."""
    from mixprec.numerics.formats import get_format
    from mixprec.regions.fp8.scaling import cast_to_fp8_storage, own_scale_cast, power_of_two_scale

    spec = get_format(fmt)
    for dtype in (torch.float32, torch.bfloat16):
        for tensor in _operands(torch.device(device), dtype):
            for margin in (0, 2):
                whole = torch.linalg.vector_norm(tensor, math.inf, dtype=torch.float32)
                rows = torch.linalg.vector_norm(tensor, math.inf, dim=-1, keepdim=True, dtype=torch.float32)
                for amax in (whole, rows):
                    scale = power_of_two_scale(amax, spec.max, margin, guard=False)
                    got, want = own_scale_cast(tensor, scale, spec), cast_to_fp8_storage(tensor, scale, spec)
                    assert _same(got, want), (dtype, tuple(tensor.shape), margin, amax.numel())
    # the largest finite values of the source dtype, alone and beside an infinity (an amax of inf)
    for dtype in (torch.float32, torch.bfloat16):
        big = torch.finfo(dtype).max
        for values in ([big, -big, 1.0], [math.inf, big, -big, 3.0]):
            tensor = torch.tensor(values, dtype=dtype, device=device)
            scale = power_of_two_scale(torch.linalg.vector_norm(tensor, math.inf), spec.max, guard=False)
            assert _same(own_scale_cast(tensor, scale, spec), cast_to_fp8_storage(tensor, scale, spec)), values


def test_the_cast_under_a_tensors_own_scale_is_two_or_three_operations() -> None:
    """Eager, each operation is a kernel launch on a GPU: the multiply, e4m3's infinities to NaN, the conversion."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from mixprec.regions.fp8.scaling import own_scale_cast

    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.names: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    tensor, scale = torch.randn(64, 32, dtype=torch.bfloat16), torch.tensor(4.0)
    for fmt, want in (("fp8_e4m3", ["mul", "nan_to_num_", "_to_copy"]), ("fp8_e5m2", ["mul", "_to_copy"])):
        own_scale_cast(tensor, scale, fmt)  # the first call probes the cast (once per device and dtypes)
        with Ops() as ops:
            own_scale_cast(tensor, scale, fmt)
        assert ops.names == want, fmt


@pytest.mark.parametrize("scaling", ["current", "rowwise"])
def test_an_fp8_layer_runs_under_fake_tensors_before_any_real_cast(monkeypatch, scaling) -> None:
    """The cast's probe reads values back: under FakeTensorMode (a model's FLOPs or memory counted with fake
    tensors) there are none, so the first cast there takes the full saturating cast and probes nothing."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from mixprec.regions.fp8 import Fp8LinearState, fp8_linear
    from mixprec.regions.fp8 import scaling as scaling_module

    monkeypatch.setattr(scaling_module, "_KEEPS_INFINITIES", {})  # as in a fresh process
    with FakeTensorMode():
        x, w = torch.randn(16, 32, requires_grad=True), torch.nn.Parameter(torch.randn(48, 32))
        y = fp8_linear(x, w, None, Fp8LinearState(Fp8Recipe(scaling=scaling)), torch.bfloat16)
        y.float().sum().backward()
        assert y.shape == (16, 48) and x.grad.shape == x.shape and w.grad.shape == w.shape
    assert scaling_module._KEEPS_INFINITIES == {}
