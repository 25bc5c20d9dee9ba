"""FP8 training: exact emulation against torch's float8 casts, scaling, recipes and policies."""

import copy
import math
import re

import pytest
import torch
from torch import nn

import mixprec
from mixprec.policy import Fp8Recipe
from mixprec.regions.fp8 import Fp8LinearState, cast_to_fp8, fp8_layers, fp8_linear, fp8_region, power_of_two_scale

TORCH_FP8 = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2"])
def test_scaled_casts_match_torch_float8_bit_for_bit(fmt):
    torch.manual_seed(0)
    x = torch.randn(50000) * torch.exp2(torch.randint(-30, 10, (50000,)).float())
    scale = power_of_two_scale(x.abs().amax(), mixprec.get_format(fmt).max)
    ours = cast_to_fp8(x, scale, fmt)
    reference = (x * scale).to(TORCH_FP8[fmt]).float()
    assert torch.equal(ours, reference)
    assert torch.equal(ours, mixprec.quantize(x * scale, fmt))  # mixprec's own emulation agrees
    # every value as a float8 bit pattern: the emulation reproduces it exactly
    assert torch.equal(ours.to(TORCH_FP8[fmt]).view(torch.uint8), (x * scale).to(TORCH_FP8[fmt]).view(torch.uint8))


def test_power_of_two_scales_are_the_largest_that_fit():
    amax = torch.tensor([448.0, 449.0, 1.0, 3e-5, 65504.0, 0.0, float("inf"), float("nan")])
    scale = power_of_two_scale(amax, 448.0)
    finite = amax[:5]
    assert torch.all(finite * scale[:5] <= 448) and torch.all(finite * scale[:5] * 2 > 448)
    assert torch.all(torch.log2(scale) == torch.log2(scale).round())
    assert scale[5:].tolist() == [1.0, 1.0, 1.0]
    assert power_of_two_scale(torch.tensor(1.0), 448.0, margin=2).item() == 64.0


@pytest.mark.parametrize("fmt_max", [448.0, 57344.0, 6.0])
@pytest.mark.parametrize("margin", [0, 3])
def test_power_of_two_scales_equal_a_search_over_every_binade(fmt_max, margin):
    """The scale from amax's bits against the largest 2**k found by trying every k, for amaxes across every FP32
    binade (subnormals included) and the edges; unguarded, the same wherever amax is positive and finite."""

    def largest_fitting(a: float) -> float:
        if not 0 < a < math.inf:
            return 1.0
        k = 300
        while a * 2.0**k > fmt_max * 2.0**-margin:
            k -= 1
        return 2.0 ** max(-126, min(126, k))

    gen = torch.Generator().manual_seed(0)
    binades = torch.arange(-149, 128, dtype=torch.float64).repeat_interleave(12)
    spread = (1 + torch.rand(binades.shape, generator=gen, dtype=torch.float64)) * 2.0**binades
    edges = [0.0, math.inf, math.nan, 1e-45, 1.1754943508222875e-38, 3.4028234663852886e38, fmt_max, fmt_max / 2]
    amax = torch.cat([spread.float(), torch.tensor(edges), torch.tensor(edges).nextafter(torch.tensor(math.inf))])
    expected = torch.tensor([largest_fitting(a) for a in amax.tolist()])
    assert torch.equal(power_of_two_scale(amax, fmt_max, margin), expected)
    valid = (amax > 0) & (amax < math.inf)
    assert torch.equal(power_of_two_scale(amax, fmt_max, margin, guard=False)[valid], expected[valid])


def test_cast_saturates_finite_values_and_keeps_non_finite_ones_non_finite():
    x = torch.tensor([1000.0, -1e6, float("inf"), float("nan"), -float("inf")])
    out = cast_to_fp8(x, torch.tensor(1.0), "fp8_e5m2")
    assert out[:2].tolist() == [1024.0, -57344.0]
    assert torch.isinf(out[2]) and torch.isnan(out[3]) and out[4] == -float("inf")
    e4m3 = cast_to_fp8(x, torch.tensor(1.0), "fp8_e4m3")  # no infinity: ±inf is NaN (torch's cast gives ±448)
    assert e4m3[:2].tolist() == [448.0, -448.0] and torch.isnan(e4m3[2:]).all()
    assert torch.isnan(e4m3.to(torch.float8_e4m3fn).float()[2:]).all()  # and stays NaN in FP8 storage


@pytest.mark.parametrize("policy", ["fp8", "fp8_hybrid", "base=fp8,fp8=(scaling=current)"])
def test_an_infinite_input_makes_the_fp8_step_skip(policy):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    mp = mixprec.MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), policy)
    x = torch.randn(8, 4)
    x[0, 0] = float("inf")
    before = [p.detach().clone() for p in model.parameters()]
    with mp.autocast():
        loss = nn.functional.cross_entropy(model(x).float(), torch.randint(0, 2, (8,)))
    mp.backward(loss)
    assert not torch.isfinite(loss) and not mp.step()  # skipped, as under every other policy
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def _reference_linear(x, w, b, fwd, bwd, grad):
    """The FP8 GEMMs spelled out with torch's float8 casts and current scaling."""
    fmax = mixprec.get_format(fwd).max
    sx, sw = power_of_two_scale(x.abs().amax(), fmax), power_of_two_scale(w.abs().amax(), fmax)
    xq, wq = (x * sx).to(TORCH_FP8[fwd]).float(), (w * sw).to(TORCH_FP8[fwd]).float()
    y = xq @ wq.t() / (sx * sw) + b
    sg = power_of_two_scale(grad.abs().amax(), mixprec.get_format(bwd).max)
    gq = (grad * sg).to(TORCH_FP8[bwd]).float()
    return y, gq @ wq / (sg * sw), gq.t() @ xq / (sg * sx), grad.sum(0)


def _equals_reference(x, scaling, formats, reference, device="cpu"):
    """The layer under ``scaling``, forward and backward, bit for bit against ``reference``; returns its output."""
    x = x.to(device).requires_grad_()
    w = nn.Parameter((torch.randn(8, 32) * 0.1).to(device))
    b = nn.Parameter(torch.randn(8).to(device))
    grad = (torch.randn(16, 8) * 1e-3).to(device)
    # every product promoted to FP32 on CUDA's kernel: bit for bit is a claim of FP32 accumulation
    recipe = Fp8Recipe(forward=formats[0], backward=formats[1], scaling=scaling, fast_accum="none")
    y = fp8_linear(x, w, b, Fp8LinearState(recipe), torch.float32)
    y.backward(grad)
    ref_y, ref_dx, ref_dw, ref_db = reference(x.detach(), w.detach(), b.detach(), *formats, grad)
    assert torch.equal(y, ref_y)
    assert torch.equal(x.grad, ref_dx) and torch.equal(w.grad, ref_dw) and torch.equal(b.grad, ref_db)
    return y.detach(), w.detach(), b.detach()


@pytest.mark.parametrize("formats", [("fp8_e4m3", "fp8_e5m2"), ("fp8_e4m3", "fp8_e4m3")])
def test_fp8_linear_forward_and_backward_equal_the_reference(formats):
    torch.manual_seed(0)
    _equals_reference(torch.randn(16, 32), "current", formats, _reference_linear)


def _rowwise_reference(x, w, b, fwd, bwd, grad):
    """Rowwise scaling spelled out: a power-of-two scale per slice orthogonal to each product's reduction,
    torch's float8 casts, one product per GEMM."""

    def cast(t, fmt, dim):
        scale = power_of_two_scale(t.abs().amax(dim=dim, keepdim=True), mixprec.get_format(fmt).max)
        return (t * scale).to(TORCH_FP8[fmt]).float(), scale

    (xq, sx), (wq, sw) = cast(x, fwd, 1), cast(w, fwd, 1)
    y = xq @ wq.t() / (sx * sw.t()) + b
    (gq, sg), (wq0, sw0) = cast(grad, bwd, 1), cast(w, fwd, 0)  # dx = g @ w: g per row, w per column
    dx = gq @ wq0 / (sg * sw0)
    (gq0, sg0), (xq0, sx0) = cast(grad, bwd, 0), cast(x, fwd, 0)  # dw = g^T @ x: both per column
    dw = gq0.t() @ xq0 / (sg0.t() * sx0)
    return y, dx, dw, grad.sum(0)


@pytest.mark.parametrize("formats", [("fp8_e4m3", "fp8_e5m2"), ("fp8_e4m3", "fp8_e4m3")])
def test_rowwise_fp8_linear_equals_the_reference(formats, device):
    torch.manual_seed(0)
    x = torch.randn(16, 32) * torch.logspace(-3, 3, 16).unsqueeze(1)  # rows six decades apart
    y, w, b = _equals_reference(x, "rowwise", formats, _rowwise_reference, device)
    x = x.to(device)
    # per row, the small rows keep their precision: a tensorwise scale set by the largest row flushes them
    tensorwise = fp8_linear(x, w, b, Fp8LinearState(Fp8Recipe(scaling="current")), torch.float32)
    exact = x @ w.t() + b
    row_error = lambda out: ((out - exact).norm(dim=1) / (exact - b).norm(dim=1))[:4].max()  # noqa: E731
    assert row_error(y.detach()) < 0.1 < row_error(tensorwise)


@pytest.mark.parametrize("scaling", ["rowwise", "blockwise", "mxfp8", "mxfp4", "nvfp4"])
def test_a_model_trains_under_finer_scaling_and_the_plan_says_it_is_emulated(scaling, train_mlp):
    mp, losses = train_mlp(f"base=fp8,fp8=(scaling={scaling})", steps=30, samples=128, classes=16)
    bits = "FP4 emulated with FP32 arithmetic (fp4_e2m1" if scaling.endswith("fp4") else "FP8 emulated with FP32"
    assert f"GEMM layers in {bits}" in mp.compute_plan.reason
    assert losses[-1] < 0.7 * losses[0]
    assert str(mp.policy.fp8) == f"hybrid(scaling={scaling})" and mixprec.get_policy(str(mp.policy)) == mp.policy


def _blockwise_reference(x, w, fwd, bwd, grad):
    """DeepSeek-V3's tiles spelled out in float64 with torch's float8 casts: a scale per 1x128 tile of x and g
    (along each product's reduction), per 128x128 tile of w, per 128x1 tile of g and x for dw."""

    def cast(t, fmt, rows, cols):
        out = torch.zeros_like(t, dtype=torch.float64)
        scales = torch.ones_like(t, dtype=torch.float64)
        fmax = mixprec.get_format(fmt).max
        for r in range(0, t.shape[0], rows):
            for c in range(0, t.shape[1], cols):
                tile = t[r : r + rows, c : c + cols]
                scale = power_of_two_scale(tile.abs().amax(), fmax)
                out[r : r + rows, c : c + cols] = (tile * scale).to(TORCH_FP8[fmt]).double()
                scales[r : r + rows, c : c + cols] = scale.double()
        return out / scales  # the dequantized values: exact in float64

    y = cast(x, fwd, 1, 128) @ cast(w, fwd, 128, 128).t()
    dx = cast(grad, bwd, 1, 128) @ cast(w, fwd, 128, 128)
    dw = cast(grad, bwd, 128, 1).t() @ cast(x, fwd, 128, 1)
    return y, dx, dw


@pytest.mark.parametrize("integers", [True, False], ids=["exact-sums", "random"])
def test_blockwise_fp8_linear_equals_the_reference(integers, device):
    torch.manual_seed(0)
    shapes = {"x": (5, 200), "w": (130, 200), "g": (5, 130)}  # K and N past one block of 128, padded
    if integers:  # small integers: every partial sum is exact, so the result must be too, bit for bit
        x, w, grad = (torch.randint(-4, 5, shape).float() for shape in shapes.values())
    else:
        x, w, grad = (torch.randn(shape) for shape in shapes.values())
        x[0] *= 1e4  # an outlier token, and tiles of other ranges: each needs its own scale
        x[:, 128:] *= 1e-3
        w[128:] *= 1e3
        grad[:, :64] *= 1e5  # columns whose tiles for dw (128x1) must not share the others' scale
    x, w, grad = x.to(device).requires_grad_(), nn.Parameter(w.to(device)), grad.to(device)
    state = Fp8LinearState(Fp8Recipe(scaling="blockwise", backward="fp8_e4m3"))
    y = fp8_linear(x, w, None, state, torch.float32)
    y.backward(grad)
    ref_y, ref_dx, ref_dw = _blockwise_reference(x.detach(), w.detach(), "fp8_e4m3", state.grad.fmt, grad)
    for ours, ref in ((y, ref_y), (x.grad, ref_dx), (w.grad, ref_dw)):
        if integers:
            assert torch.equal(ours.double(), ref)
        else:  # FP32 sums in another order than float64's: within K roundings of the magnitudes
            assert ((ours.double() - ref).abs() <= 1e-5 * ref.abs().amax(dim=-1, keepdim=True)).all()


def test_mxfp8_fp8_linear_takes_its_blocks_along_each_products_reduction(device):
    torch.manual_seed(0)
    x = (torch.randn(40, 64) * torch.logspace(-4, 4, 40).unsqueeze(1)).to(device)  # tokens eight decades apart
    x.requires_grad_()
    w = nn.Parameter((torch.randn(48, 64) * torch.logspace(-4, 4, 64)).to(device))  # features eight decades apart
    grad = (torch.randn(40, 48) * torch.logspace(-4, 4, 48)).to(device)
    y = fp8_linear(x, w, None, Fp8LinearState(Fp8Recipe(scaling="mxfp8")), torch.float32)
    y.backward(grad)

    def mx(t, fmt):  # the public block format, its blocks along the last dimension
        return mixprec.quantize(t.detach(), f"mxfp8_{fmt}")

    assert torch.equal(y, mx(x, "e4m3") @ mx(w, "e4m3").t())
    assert torch.equal(x.grad, mx(grad, "e5m2") @ mx(w.t(), "e4m3").t())  # reduced over w's rows
    assert torch.equal(w.grad, mx(grad.t(), "e5m2") @ mx(x.t(), "e4m3").t())  # reduced over the tokens
    wrong = mx(grad, "e5m2") @ mx(w, "e4m3")  # w's blocks along the wrong dimension lose its small features
    assert (x.grad - wrong).abs().max() > 0


def test_delayed_scaling_uses_the_amax_history():
    recipe = Fp8Recipe(scaling="delayed", history=2, amax="max")
    state = Fp8LinearState(recipe)
    scales = [state.input.scale_for(torch.tensor([value])).item() for value in (1.0, 100.0, 1.0, 1.0, 1.0)]
    # first call: current amax (1 -> 256); then max of the previous two amaxes
    assert scales == [256.0, 256.0, 4.0, 4.0, 256.0]
    recent = Fp8LinearState(Fp8Recipe(scaling="delayed", amax="recent")).input
    assert [recent.scale_for(torch.tensor([v])).item() for v in (1.0, 100.0, 1.0)] == [256.0, 256.0, 4.0]


def test_region_swaps_the_selected_linears_and_restores_them():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.Linear(8, 2))
    recipe = Fp8Recipe(keep=("first", "last"))
    assert [n for n, _ in fp8_layers(model, recipe)] == ["2"]
    assert [n for n, _ in fp8_layers(model, Fp8Recipe(keep=("2",)))] == ["0", "3"]
    with pytest.raises(RuntimeError), fp8_region(model, recipe, torch.float32):
        assert "forward" in vars(model[2])
        raise RuntimeError("boom")
    assert "forward" not in vars(model[2])


def test_layers_routed_through_fp8_run_their_own_forward_outside_the_region_and_copy_with_the_model():
    model = _mlp()
    plain = copy.deepcopy(model)
    mp = mixprec.MixedPrecision(model, torch.optim.AdamW(model.parameters()), "fp8")
    x = torch.randn(8, 16)
    with torch.no_grad():
        assert torch.equal(model(x), plain(x))  # routed once for the engine's region, inert outside it
        with mp.autocast():
            assert not torch.equal(model(x), plain(x))  # FP8 inside
        twin = copy.deepcopy(model)
        for parameter in twin.parameters():
            parameter.zero_()
        assert torch.equal(twin(x), torch.zeros(8, 4))  # the copy's layers compute with the copy's weights
    with mixprec.autocast("fp8", plain):
        assert all("forward" in vars(plain[i]) for i in (0, 2, 4))
    assert all("forward" not in vars(plain[i]) for i in (0, 2, 4))  # a one-off region leaves them as it found them
    routed = vars(model[2])["forward"]
    with mixprec.autocast("base=fp8,fp8=(scaling=delayed)", model):  # another recipe, then the engine's again
        assert vars(model[2])["forward"] is not routed
    assert vars(model[2])["forward"] is routed


def test_two_engines_on_one_model_released_out_of_order_leave_the_others_fp8_and_then_nothing():
    model = _mlp()
    first = mixprec.MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), "fp8")
    second = mixprec.MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), "fp8")
    first.release()  # it had dropped the second's routing: the second then computed in bf16, silently
    with second.autocast():
        out = model[2](torch.randn(4, 64))
    assert type(out.grad_fn).__name__ == "_Fp8LinearBackward"
    second.release()
    assert all("forward" not in vars(module) for module in model)


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 4))


def _train(mp: mixprec.MixedPrecision, steps: int) -> list[float]:
    generator = torch.Generator().manual_seed(0)
    x, y = torch.randn(256, 16, generator=generator), torch.randint(0, 4, (256,), generator=generator)
    losses = []
    for _ in range(steps):
        with mp.autocast():
            loss = nn.functional.cross_entropy(mp.model(x), y)
        mp.backward(loss)
        mp.step()
        losses.append(loss.item())
    return losses


def test_fp8_policies_train_and_checkpoint_their_scale_state():
    model = _mlp()
    mp = mixprec.MixedPrecision(model, torch.optim.AdamW(model.parameters(), lr=3e-3), "base=fp8,fp8=(scaling=delayed)")
    losses = _train(mp, 60)
    assert losses[-1] < 0.7 * losses[0]
    state = mp.state_dict()
    assert set(state["fp8"]) == {"0", "2", "4"}
    assert state["fp8"]["2"]["input"]["recorded"] == 60 and type(state["fp8"]["2"]["input"]["recorded"]) is int
    other = mixprec.MixedPrecision(model, torch.optim.AdamW(model.parameters()), "base=fp8,fp8=(scaling=delayed)")
    other.load_state_dict(state)
    assert torch.equal(other.state_dict()["fp8"]["2"]["grad"]["history"], state["fp8"]["2"]["grad"]["history"])


def test_fp8_policy_grammar_round_trips_and_explains_errors():
    for spec in (
        "fp8",
        "fp8_hybrid",
        "base=fp8,fp8=(scaling=current,history=4)",
        "c=bf16,fp8=e4m3(keep=first+*.head)",
        "c=bf16,fp8=e5m2/e4m3(margin=1,gemm=emulated,amax=recent)",
        "base=fp8,fp8=e4m3(scaling=mxfp8,scale_rule=ceil)",
    ):
        policy = mixprec.get_policy(spec)
        assert mixprec.get_policy(str(policy)) == policy
    assert mixprec.get_policy("fp8_hybrid").fp8.keep == ("first", "last")
    assert mixprec.get_policy("fp8").fp8.backward == "fp8_e5m2"
    # with a base, the options named change the preset's recipe and keep the rest
    changed = mixprec.get_policy("base=fp8_hybrid,fp8=(scaling=delayed)").fp8
    assert changed == Fp8Recipe(scaling="delayed", keep=("first", "last"))
    assert str(changed) == "hybrid(scaling=delayed,keep=first+last)"
    assert mixprec.get_policy("base=fp8,fp8=none").fp8 is None
    for spec, message in (
        ("fp8=e5m3", "unknown formats 'e5m3'; use hybrid"),
        ("c=bf16,fp8=(scaling=current)", "name the formats first"),
        ("fp8=hybrid(colour=red)", "unknown option 'colour=red'"),
        ("fp8=hybrid(history=4", "one pair of parentheses"),
        ("fp8=hybrid(history=four)", "history='four' is not a whole number"),
        ("fp8=hybrid(scale_rule=ceil)", "scale_rule='ceil') chooses how MXFP8's E8M0 block scales round"),
        ("fp8=hybrid(scaling=mxfp8,scale_rule=up)", "scale_rule=...): received 'up'; use one of ocp, ceil"),
        (
            "fp8=hybrid(scaling=later)",
            "received 'later'; use one of current, delayed, rowwise, blockwise, mxfp8, mxfp4",
        ),
    ):
        with pytest.raises(ValueError, match=re.escape(message)):
            mixprec.get_policy(spec)
    with pytest.raises(ValueError, match="needs the model"), mixprec.autocast("fp8"):
        pass


@pytest.mark.parametrize("spec", ["base=fp8,p=bf16", "base=fp8,p=bf16,m=bf16", "base=fp8_hybrid,fp8=(scaling=current)"])
def test_fp8_with_bf16_weights_and_either_master(spec):
    model = _mlp()
    policy = mixprec.get_policy(spec)
    bf16_masters = policy.master_dtype == torch.bfloat16
    optimizer = (mixprec.AdamW if bf16_masters else torch.optim.AdamW)(model.parameters(), lr=3e-3)
    mp = mixprec.MixedPrecision(model, optimizer, policy)
    losses = _train(mp, 40)
    assert losses[-1] < 0.7 * losses[0]
    assert model[2].weight.dtype == (torch.bfloat16 if "p=bf16" in spec else torch.float32)
    assert (mp.masters is None) == (bf16_masters or "p=bf16" not in spec)


@pytest.mark.parametrize("recipe", ["scaling=delayed,amax=recent", "scaling=delayed,history=1", "scaling=delayed"])
def test_an_overflowing_step_leaves_the_amax_history_as_it_was(recipe):
    # the step after an overflow scales with the amaxes before it: recorded as 0, an inf would have given
    # scale 1 there (amax=recent, history=1), and every e5m2 gradient of 1e-6 would have rounded to zero
    state = Fp8LinearState(mixprec.get_policy(f"base=fp8,fp8=({recipe})").fp8)
    torch.manual_seed(0)
    x, weight = torch.randn(8, 4), torch.randn(3, 4, requires_grad=True)
    largest = []
    for step in range(5):
        y = fp8_linear(x, weight, None, state, torch.float32)
        y.backward(torch.full_like(y, float("inf") if step == 2 else 1e-6))
        largest.append(weight.grad.abs().max().item())
        weight.grad = None
    assert not torch.isfinite(torch.tensor(largest[2]))  # the overflow itself
    assert largest[3] == largest[4] == largest[1] > 0, largest


@pytest.mark.parametrize(("policy", "fp8"), [("base=fp8,names=1", ["0", "2"]), ("base=fp8,mods=Linear", [])])
def test_the_policys_fp32_modules_stay_out_of_fp8(policy, fp8):
    # policies.md: FP32 modules run with autocast off and FP32 inputs (cast inside their forward: a hook sees the
    # input as given); a Linear among them is no FP8 layer
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(3)])
    seen = {}
    model[1].register_forward_hook(lambda module, inputs, output: seen.update(x=inputs[0], y=output))
    mp = mixprec.MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), policy)
    with mp.autocast():
        model(torch.randn(4, 16))
    assert seen["y"].dtype == torch.float32
    assert torch.equal(seen["y"], nn.functional.linear(seen["x"].float(), model[1].weight, model[1].bias))
    assert sorted(mp.state_dict()["fp8"]) == fp8


def test_fp8_layers_train_on_pure_bf16_weights_at_twelve_bytes_a_parameter():
    """FP8 GEMM layers on bf16 weights with the compensated AdamW: the memory-lean base under FP8, the loss going
    down as under FP8 on FP32 masters, 12 bytes a parameter against 16."""
    losses, stats = {}, {}
    for base in ("mixed_bf16", "pure_bf16"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32), nn.GELU(), nn.Linear(32, 4))
        optimizer = mixprec.AdamW(model.parameters(), lr=3e-3)
        mp = mixprec.MixedPrecision(model, optimizer, f"base={base},fp8=hybrid(keep=none)")
        assert len(mixprec.regions.fp8.fp8_layers(model, mp.policy.fp8)) == 3
        data = torch.Generator().manual_seed(1)
        x, y = torch.randn(128, 32, generator=data), torch.randint(0, 4, (128,), generator=data)
        losses[base] = []
        for _ in range(40):
            with mp.autocast():
                loss = nn.functional.cross_entropy(model(x).float(), y)
            mp.backward(loss)
            mp.step()
            losses[base].append(loss.item())
        stats[base] = mp.stats().bytes_per_param.total
        assert all(p.dtype == (torch.bfloat16 if base == "pure_bf16" else torch.float32) for p in model.parameters())
    assert losses["pure_bf16"][-1] < 0.6 * losses["pure_bf16"][0]
    assert abs(losses["pure_bf16"][-1] - losses["mixed_bf16"][-1]) < 0.05 * losses["mixed_bf16"][-1]
    assert stats == {"mixed_bf16": pytest.approx(16, abs=0.01), "pure_bf16": pytest.approx(12, abs=0.01)}


@pytest.mark.parametrize("recipe", ["scaling=delayed,amax=recent", "scaling=delayed,history=1"])
@pytest.mark.parametrize("tensor", ["input", "gradient"])
def test_a_zero_amax_leaves_the_delayed_history_as_it_was(recipe, tensor):
    # a fully masked loss or a zero batch: recorded, the zero gave the next step scale 1, where every e5m2
    # gradient of 1e-6 rounded to zero (Transformer Engine keeps the scale before)
    state = Fp8LinearState(mixprec.get_policy(f"base=fp8,fp8=({recipe})").fp8)
    torch.manual_seed(0)
    x, weight = torch.randn(8, 4) * 1e-4, torch.randn(3, 4, requires_grad=True)  # at scale 1, e4m3 flushes x
    largest = []
    for step in range(4):
        zero = step == 1
        y = fp8_linear(x * 0 if zero and tensor == "input" else x, weight, None, state, torch.float32)
        y.backward(torch.full_like(y, 0.0 if zero and tensor == "gradient" else 1e-6))
        largest.append(weight.grad.abs().max().item())
        weight.grad = None
    assert largest[0] == largest[2] == largest[3] > 0, largest


def _delayed_run(skip_at: int | None, drop: bool, evaluate: bool = False) -> tuple[dict, dict]:
    """8 steps of a small regression under delayed FP8 scaling; at ``skip_at`` one corrupted target (1e37): a
    finite output gradient whose weight gradient overflows, so the update is skipped (or, ``drop``, the batch is
    left out); ``evaluate``: a forward without gradients after each step."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 1))
    mp = mixprec.MixedPrecision(
        model, torch.optim.SGD(model.parameters(), lr=0.05), "base=fp8,fp8=(scaling=delayed,keep=none)"
    )
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(32, 8, generator=generator)
    y = x[:, :1] * 2 + 0.5
    for step in range(8):
        target = y.clone()
        if step == skip_at:
            if drop:
                continue
            target[0] = 1e37
        with mp.autocast():
            loss = ((model(x).float() - target) ** 2).mean()
        mp.backward(loss)
        assert bool(mp.step()) == (step != skip_at)
        if evaluate:
            with torch.no_grad(), mp.autocast():
                model(torch.randn(64, 8, generator=generator) * 100)
    return model.state_dict(), mp.state_dict()["fp8"]


def _same(first: dict, second: dict) -> bool:
    if isinstance(first, dict):
        return first.keys() == second.keys() and all(_same(first[k], second[k]) for k in first)
    if isinstance(first, (tuple, list)):
        return len(first) == len(second) and all(map(_same, first, second))
    return torch.equal(first, second) if isinstance(first, torch.Tensor) else first == second


def test_a_skipped_update_takes_its_amaxes_back_out_of_the_delayed_histories():
    # the skipped step's gradient amax (about 1e36, finite) stayed in the history: the next 16 steps' gradients
    # were scaled by about 2^-104 and flushed to zero in e5m2, their updates "applied" with zero weight gradients
    skipped, dropped = _delayed_run(2, drop=False), _delayed_run(2, drop=True)
    assert _same(skipped[0], dropped[0]) and _same(skipped[1], dropped[1])


def test_an_evaluation_without_gradients_records_no_amax():
    # an evaluation between steps recorded its inputs' amaxes into the delayed histories and changed training
    assert _same(_delayed_run(None, False, evaluate=True), _delayed_run(None, False))


def test_delayed_gradient_scales_follow_the_loss_scale(device):
    # the gradient histories held amaxes of gradients under the loss scale before: after each growth the next
    # step's largest gradients saturated (weight gradients 0.44 off); after a backoff they used half the range.
    # On CUDA the scales and histories live on the device, and the products run on the kernel where it takes them
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 1)).to(device)
    mp = mixprec.MixedPrecision(
        model,
        torch.optim.SGD(model.parameters(), lr=0.0),
        "base=mixed_fp16,fp8=hybrid(scaling=delayed,keep=none)",
        mixprec.DynamicLossScaler(init_scale=1.0, growth_interval=1),
    )
    x = torch.randn(32, 8, device=device)
    grads, scales = [], []
    for step in range(6):
        with mp.autocast():
            loss = ((model(x).float() - x[:, :1] * 2) ** 2).mean()
        mp.backward(loss * math.inf if step == 3 else loss)
        mp.unscale_()
        grads.append(model[0].weight.grad.clone())
        assert bool(mp.step()) == (step != 3)
        scales.append(mp.scalers[0].get_scale())
    assert scales == [2.0, 4.0, 8.0, 4.0, 8.0, 16.0]
    assert all(torch.equal(grads[0], grads[step]) for step in (1, 2, 4, 5))


def test_a_skip_flagged_on_the_device_restores_the_histories_as_one_known_on_the_host():
    # a fused optimizer on an accelerator skips on the device: the histories are masked with the device flag
    results = {}
    for skipped in (True, torch.ones(1), False, torch.zeros(1)):
        model = _mlp()
        state = mixprec.regions.fp8.fp8_state(model, mixprec.get_policy("base=fp8,fp8=(scaling=delayed)").fp8)
        with fp8_region(model, state.recipe, torch.float32):
            model(torch.randn(4, 16)).sum().backward()
        state.end_window(skipped)
        results[str(skipped)] = copy.deepcopy(state.state_dict())
    assert _same(results["True"], results[str(torch.ones(1))])
    assert _same(results["False"], results[str(torch.zeros(1))])
    assert all(role["recorded"] == 0 for layer in results["True"].values() for role in layer.values())
    assert any(role["recorded"] == 1 for layer in results["False"].values() for role in layer.values())


@pytest.mark.parametrize("scaling", ["current", "delayed", "rowwise", "blockwise"])
def test_an_fp8_layer_given_no_rows_returns_none(scaling):
    # an MoE expert given no tokens: torch's inf-norm refused the empty tensor
    state = Fp8LinearState(mixprec.get_policy(f"base=fp8,fp8=(scaling={scaling})").fp8)
    x, weight = torch.randn(0, 32, requires_grad=True), torch.randn(16, 32, requires_grad=True)
    y = fp8_linear(x, weight, None, state, torch.float32)
    y.sum().backward()
    assert y.shape == (0, 16) and x.grad.shape == (0, 32) and torch.equal(weight.grad, torch.zeros(16, 32))
