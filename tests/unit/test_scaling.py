import math

import pytest
import torch

import mixprec

INF = float("inf")


def run(scaler, pattern):
    """Feed a pattern of overflow (1) / clean (0) steps; return the scale after each."""
    scales = []
    for bad in pattern:
        grads = [torch.full((4,), INF if bad else 1.0)]
        scaler.update(scaler.unscale_(grads))
        scales.append(scaler.get_scale())
    return scales


@pytest.mark.parametrize(
    "scaler", [mixprec.NoOpLossScaler(), mixprec.StaticLossScaler(128.0), mixprec.DynamicLossScaler(init_scale=8.0)]
)
def test_one_protocol(scaler, device):
    loss = torch.tensor(2.0, device=device)
    scaled = scaler.scale(loss)
    assert scaled.item() == 2.0 * scaler.get_scale()
    grads = [torch.full((3,), scaler.get_scale(), device=device), torch.ones(2, device=device, dtype=torch.bfloat16)]
    found = scaler.unscale_(grads)
    assert found.device.type == device and found.item() == 0.0
    assert grads[0].tolist() == [1.0, 1.0, 1.0]
    assert scaler.unscale_([torch.tensor([float("nan")], device=device)]).item() == 1.0
    scaler.update(found)


def test_noop_checks_without_changing_the_gradients():
    grads = [torch.tensor([1e-40, 3.0]), torch.tensor([float("inf"), 1.0], dtype=torch.bfloat16)]
    before = [g.clone() for g in grads]
    assert mixprec.NoOpLossScaler().unscale_(grads).tolist() == [1.0]  # the inf is found
    assert all(torch.equal(a, b) for a, b in zip(grads, before, strict=True))  # subnormals and all, unchanged
    assert mixprec.NoOpLossScaler().unscale_(grads[:1]).tolist() == [0.0]
    assert mixprec.NoOpLossScaler().unscale_([]).tolist() == [0.0]


def test_noop_checks_off_the_cpu_by_one_read_whose_magnitudes_tell_inf_from_nan(device):
    inf, nan = float("inf"), float("nan")
    grads = [
        torch.tensor([-0.0, 1e-40, inf, 2.0], device=device),
        torch.tensor([nan, 1.0], device=device, dtype=torch.bfloat16),
        torch.zeros(0, device=device),  # an empty shard
        torch.tensor([3.0, -5.0], device=device),
    ]
    before = [g.clone() for g in grads]
    found, magnitudes = mixprec.NoOpLossScaler().unscale_checked_(grads)
    assert found.tolist() == [1.0] and found.device.type == device
    for got, want in zip(grads, before, strict=True):  # not written: the same bits, -0.0 and NaN included
        bits = torch.int16 if got.dtype == torch.bfloat16 else torch.int32
        assert torch.equal(got.view(bits), want.view(bits))
    if device == "cpu":  # PyTorch's AMP kernel read them (a multiply by one): no magnitudes
        assert magnitudes is None
    else:  # the empty tensor left out; an inf and a NaN told apart with no further pass
        assert magnitudes.tolist()[2] == 5.0 and math.isinf(magnitudes[0]) and math.isnan(magnitudes[1])
        assert [bool(kind) for kind in mixprec.numerics.kinds_of(magnitudes)] == [True, True]
    clean = [torch.ones(3, device=device), torch.zeros(0, device=device)]
    assert mixprec.NoOpLossScaler().unscale_checked_(clean)[0].tolist() == [0.0]


def test_noops_read_only_check_equals_the_amp_kernels_flag(monkeypatch):
    # the accelerators' path, run on the CPU: the same flag as PyTorch's AMP kernel, nothing written
    from mixprec.scaling import static

    cases = [[torch.ones(3)], [torch.tensor([1.0, float("inf")])], [torch.zeros(0), torch.tensor([float("nan")])], []]
    monkeypatch.setattr(static, "_AMP_KERNEL_DEVICES", ())
    for grads in cases:
        before = [g.clone() for g in grads]
        found, magnitudes = mixprec.NoOpLossScaler().unscale_checked_(grads)
        want = mixprec.numerics.unscale_and_check_([g.clone() for g in grads], torch.ones(1)) if grads else None
        assert found.tolist() == (want.tolist() if want is not None else [0.0])
        assert magnitudes is not None and len(magnitudes) == sum(g.numel() > 0 for g in grads)
        for got, was in zip(grads, before, strict=True):  # not written
            assert torch.equal(got.view(torch.int32), was.view(torch.int32))


def test_a_scaler_that_overrides_unscale_is_what_the_step_calls():
    class Halving(mixprec.StaticLossScaler):
        def unscale_(self, grads):
            self.calls = getattr(self, "calls", 0) + 1
            return super().unscale_(grads)

    scaler = Halving(2.0)
    model = torch.nn.Linear(4, 2)
    mp = mixprec.MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), "mixed_bf16", scaler=scaler)
    with mp.autocast():
        loss = model(torch.ones(3, 4)).float().sum()
    mp.backward(loss)
    assert mp.step() and scaler.calls == 1


def test_max_magnitudes_flag_and_kinds():
    from mixprec.numerics import kinds_of, magnitudes_not_finite, max_magnitudes

    grouped = {(torch.device("cpu"), torch.float32): [torch.tensor([1.0, -7.0]), torch.zeros(0)]}
    magnitudes = max_magnitudes(grouped, torch.device("cpu"))
    assert magnitudes.tolist() == [7.0] and magnitudes_not_finite(magnitudes).tolist() == [0.0]
    magnitudes = max_magnitudes([torch.tensor([float("nan"), float("inf")]), torch.tensor([float("-inf")])], "cpu")
    assert magnitudes_not_finite(magnitudes).tolist() == [1.0]
    assert [bool(k) for k in kinds_of(magnitudes)] == [True, True]  # a tensor holding both counts as NaN
    assert magnitudes_not_finite(max_magnitudes([], torch.device("cpu"))).tolist() == [0.0]


def test_noop_returns_the_loss_itself():
    loss = torch.tensor(3.0, requires_grad=True)
    assert mixprec.NoOpLossScaler().scale(loss) is loss


def test_only_no_scaling_has_a_scale_known_without_a_read():
    assert mixprec.NoOpLossScaler().fixed_scale == 1.0
    assert mixprec.StaticLossScaler(8.0).fixed_scale is None  # a loaded state may change it
    assert mixprec.DynamicLossScaler().fixed_scale is None


def test_static_never_moves():
    assert run(mixprec.StaticLossScaler(64.0), [1, 0, 0, 1, 1, 0]) == [64.0] * 6


def test_dynamic_backoff_and_growth():
    scaler = mixprec.DynamicLossScaler(init_scale=16.0, growth_interval=2)
    assert run(scaler, [1, 0, 0, 0, 1, 0, 0]) == [8.0, 8.0, 16.0, 16.0, 8.0, 8.0, 16.0]


def test_growth_never_passes_max_scale():
    scaler = mixprec.DynamicLossScaler(init_scale=2.0**23, growth_interval=1, max_scale=2.0**24)
    assert run(scaler, [0, 0, 0]) == [2.0**24] * 3
    unbounded = mixprec.DynamicLossScaler(init_scale=2.0**126, growth_interval=1, max_scale=None)
    assert run(unbounded, [0, 0]) == [2.0**127, 2.0**127]  # never grows to inf


def test_min_scale_is_a_floor():
    scaler = mixprec.DynamicLossScaler(init_scale=4.0, min_scale=1.0)
    assert run(scaler, [1, 1, 1, 1]) == [2.0, 1.0, 1.0, 1.0]
    assert scaler.is_floor(1.0) and not scaler.is_floor(2.0)
    assert mixprec.DynamicLossScaler().is_floor(0.5) and not mixprec.DynamicLossScaler().is_floor(1.0)


def test_hysteresis_absorbs_overflows_deepspeed_style():
    scaler = mixprec.DynamicLossScaler(init_scale=64.0, growth_interval=3, hysteresis=2)
    # 1st overflow absorbed, 2nd backs off, 3rd backs off (budget stays spent), growth refills it.
    assert run(scaler, [1, 1, 1, 0, 0, 0, 1, 1]) == [64.0, 32.0, 16.0, 16.0, 16.0, 32.0, 32.0, 16.0]


def test_overflow_resets_the_growth_run():
    scaler = mixprec.DynamicLossScaler(init_scale=8.0, growth_interval=3)
    assert run(scaler, [0, 0, 1, 0, 0, 0]) == [8.0, 8.0, 4.0, 4.0, 4.0, 8.0]


def test_dynamic_state_round_trips_every_field():
    scaler = mixprec.DynamicLossScaler(
        init_scale=2.0**12,
        growth_factor=3.0,
        backoff_factor=0.25,
        growth_interval=5,
        hysteresis=3,
        min_scale=2.0,
        max_scale=2.0**20,
        recover_below=4.0,
    )
    run(scaler, [0, 0, 1, 0])
    state = scaler.state_dict()
    assert state == {
        "type": "dynamic",
        "scale": 2.0**12,
        "growth_factor": 3.0,
        "backoff_factor": 0.25,
        "growth_interval": 5,
        "hysteresis": 3,
        "min_scale": 2.0,
        "max_scale": 2.0**20,
        "recover_below": 4.0,
        "growth_tracker": 1,
        "hysteresis_left": 2,
    }
    restored = mixprec.DynamicLossScaler()
    restored.load_state_dict(state)
    assert restored.state_dict() == state
    assert run(restored, [1, 1, 0]) == run(scaler, [1, 1, 0])  # the trackers came along


def test_a_collapsed_scale_recovers_one_clean_step_at_a_time_below_one():
    scaler = mixprec.DynamicLossScaler(init_scale=2.0, growth_interval=2000)
    scales = run(scaler, [1] * 4 + [0] * 6)  # four overflows: 2 -> 1/8; then clean steps
    assert scales == [1.0, 0.5, 0.25, 0.125, 0.25, 0.5, 1.0, 1.0, 1.0, 1.0]  # back to 1 in 3, then the interval
    gradscaler_like = mixprec.DynamicLossScaler(init_scale=2.0, growth_interval=2000, recover_below=None)
    assert run(gradscaler_like, [1] * 4 + [0] * 6)[-1] == 0.125  # stays collapsed for 2000 clean steps


def test_a_state_saved_before_recovery_existed_loads_with_the_old_behaviour():
    state = mixprec.DynamicLossScaler(init_scale=0.5).state_dict()
    del state["recover_below"]
    restored = mixprec.DynamicLossScaler()
    restored.load_state_dict(state)
    assert restored.recover_below is None and run(restored, [0, 0]) == [0.5, 0.5]


def test_static_and_noop_state_round_trip():
    static = mixprec.StaticLossScaler(32.0)
    other = mixprec.StaticLossScaler(1.0)
    other.load_state_dict(static.state_dict())
    assert other.get_scale() == 32.0
    mixprec.NoOpLossScaler().load_state_dict(mixprec.NoOpLossScaler().state_dict())


def test_loading_foreign_state_is_refused():
    with pytest.raises(ValueError, match="from a 'static' scaler, this one is 'dynamic'"):
        mixprec.DynamicLossScaler().load_state_dict({**mixprec.DynamicLossScaler().state_dict(), "type": "static"})
    with pytest.raises(ValueError, match=r"missing \['scale'\]"):
        mixprec.StaticLossScaler(2.0).load_state_dict({"type": "static"})
    with pytest.raises(TypeError, match="needs a dict; received list"):
        mixprec.NoOpLossScaler().load_state_dict([])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"init_scale": 0}, r"init_scale=...\) must be a positive finite number; received 0"),
        ({"init_scale": float("inf")}, "positive finite"),
        ({"growth_factor": 1.0}, r"growth_factor=...\) must be > 1"),
        ({"backoff_factor": 1.5}, r"backoff_factor=...\) must be < 1"),
        ({"growth_interval": 0}, "must be an integer >= 1; received 0"),
        ({"growth_interval": 2.5}, r"received 2.5 \(of type float\)"),
        ({"hysteresis": True}, "integer >= 1; received True"),
        ({"min_scale": 2.0**20}, "min_scale=1048576.0 is above init_scale"),
        ({"max_scale": 2.0}, "max_scale=2.0 is below init_scale"),
    ],
)
def test_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        mixprec.DynamicLossScaler(**kwargs)


def test_scale_needs_a_tensor():
    with pytest.raises(TypeError, match=r"needs a torch\.Tensor; received float"):
        mixprec.StaticLossScaler(2.0).scale(1.0)


def test_repr_shows_the_configuration_without_reading_the_device(monkeypatch):
    dynamic, static = mixprec.DynamicLossScaler(init_scale=8.0), mixprec.StaticLossScaler(128.0)
    for scaler in (dynamic, static):
        scaler.scale(torch.tensor(1.0))  # places the scale on the device

    def no_read(tensor):
        raise AssertionError("__repr__ read a device value: a host sync on GPUs")

    monkeypatch.setattr(torch.Tensor, "item", no_read)
    assert repr(dynamic).startswith("DynamicLossScaler(init_scale=8.0, growth_factor=2.0")
    assert repr(static) == "StaticLossScaler(scale=128.0)"


@pytest.mark.parametrize("inv_scale", [2.0**-16, 3.0, 1 / 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_unscaling_is_the_fp32_multiply_rounded_once_and_flags_what_held_inf_or_nan(dtype, inv_scale, device):
    # bf16 on CUDA has no fused kernel in PyTorch (pure_bf16 failed on an H200): every dtype is held to one reference
    scaler = mixprec.StaticLossScaler(1 / inv_scale)
    finite = torch.tensor([1.5, -3.0e4, 2.0**-20, 0.0, 1.0078125 * 3], dtype=dtype, device=device)
    for bad in (None, INF, -INF, float("nan")):
        grads = [finite.clone(), finite.flip(0).clone()]
        if bad is not None:
            grads[1][2] = bad
        expected = [(g.float() * torch.tensor(inv_scale, dtype=torch.float32)).to(dtype) for g in grads]
        found = scaler.unscale_(grads)
        assert found.item() == (0.0 if bad is None else 1.0), bad
        for got, want in zip(grads, expected, strict=True):
            assert torch.equal(got.nan_to_num(), want.nan_to_num()) and torch.equal(got.isnan(), want.isnan())


def test_an_empty_gradient_is_unscaled_like_the_others(device):
    # FSDP2 leaves a rank an empty shard of a small parameter; CUDA's max-norm pass refuses an empty tensor
    grads = [torch.empty(0, dtype=torch.bfloat16, device=device), torch.full((3,), 4.0, dtype=torch.bfloat16,
                                                                             device=device)]  # fmt: skip
    assert mixprec.StaticLossScaler(4.0).unscale_(grads).item() == 0.0 and grads[1].tolist() == [1.0] * 3
    assert mixprec.StaticLossScaler(4.0).unscale_(grads[:1]).item() == 0.0


def _reference(init, interval, min_scale, max_scale, recover_below, pattern):
    """The documented rules, in Python floats (powers of two: exact): back off by 2 on an overflow to the floor
    (min_scale, else 2^-24); grow by 2 after `interval` clean steps, or after each below `recover_below`, to the
    ceiling; an overflow restarts the count."""
    scale, clean, scales = init, 0, []
    for bad in pattern:
        if bad:
            scale, clean = max(scale / 2, min_scale if min_scale is not None else 2.0**-24), 0
        else:
            clean += 1
            if clean >= interval or (recover_below is not None and scale < recover_below):
                scale, clean = scale * 2 if max_scale is None else min(scale * 2, max_scale), 0
        scales.append(scale)
    return scales


@pytest.mark.parametrize("seed", range(12))
def test_the_scale_follows_its_rules_over_random_overflows(seed):
    # the update without hysteresis runs GradScaler's own kernel with the floor, ceiling and recovery around it
    generator = torch.Generator().manual_seed(seed)
    draw = lambda n: int(torch.randint(n, (1,), generator=generator))  # noqa: E731
    init, interval = 2.0 ** (draw(30) - 10), 1 + draw(6)
    min_scale = [None, init / 8, init][draw(3)]
    max_scale = [None, init, init * 8][draw(3)]
    recover_below = [None, 1.0, init * 2][draw(3)]
    pattern = (torch.rand(300, generator=generator) < [0.05, 0.3, 0.7][draw(3)]).tolist()
    scaler = mixprec.DynamicLossScaler(
        init_scale=init, growth_interval=interval, min_scale=min_scale, max_scale=max_scale, recover_below=recover_below
    )
    assert run(scaler, pattern) == _reference(init, interval, min_scale, max_scale, recover_below, pattern)
