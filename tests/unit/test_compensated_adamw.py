import contextlib

import pytest
import torch

import mixprec


def run_pair(steps, dtype=torch.float32, lr=3e-3, **kwargs):
    """mixprec.AdamW and torch.optim.AdamW (FP32, single-tensor) on the same gradients."""
    torch.manual_seed(0)
    start = torch.randn(64)
    bias = torch.randn(64) * 0.5  # gradients with a consistent direction, so weights drift
    ref = torch.nn.Parameter(start.clone())
    ours = torch.nn.Parameter(start.clone().to(dtype))
    groups = dict(lr=lr, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.05)
    ref_opt = torch.optim.AdamW([ref], foreach=False, **groups)
    our_opt = mixprec.AdamW([ours], **groups, **kwargs)
    for _ in range(steps):
        grad = torch.randn(64) + bias
        ref.grad, ours.grad = grad.clone(), grad.to(dtype)
        ref_opt.step()
        our_opt.step()
    return ref, ours, our_opt


def test_fp32_parameters_match_torch_adamw_bit_for_bit():
    ref, ours, _ = run_pair(50)
    assert torch.equal(ref, ours)


def test_param_groups_and_lr_changes_are_honoured():
    a, b = torch.nn.Parameter(torch.ones(4)), torch.nn.Parameter(torch.ones(4))
    opt = mixprec.AdamW([{"params": [a], "lr": 0.1}, {"params": [b]}], lr=0.0, weight_decay=0.0)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    a.grad, b.grad = torch.ones(4), torch.ones(4)
    opt.step()
    assert torch.all(a < 1) and torch.equal(b, torch.ones(4))
    scheduler.step()
    assert opt.param_groups[0]["lr"] == 0.05


@pytest.mark.parametrize("update", ["kahan", "stochastic"])
def test_bf16_compensated_updates_track_fp32_better_than_rounding(update):
    # lr 1e-4: most single updates are below half a bf16 ulp, so plain rounding loses them
    ref, ours, _ = run_pair(1000, torch.bfloat16, lr=1e-4, update=update, generator=torch.Generator().manual_seed(0))
    _, rounded, _ = run_pair(1000, torch.bfloat16, lr=1e-4, update="nearest")
    error = (ours.float() - ref).abs().mean().item()
    rounding_error = (rounded.float() - ref).abs().mean().item()
    assert error < rounding_error / 2, (error, rounding_error)


def test_kahan_keeps_tiny_updates():
    p = torch.nn.Parameter(torch.ones(1000, dtype=torch.bfloat16))
    opt = mixprec.AdamW([p], lr=1e-4, weight_decay=0.0)  # each update is far below bf16's ulp at 1.0
    for _ in range(200):
        p.grad = torch.ones(1000, dtype=torch.bfloat16)
        opt.step()
    total = p.float() + opt.state[p]["kahan_comp"].float()
    assert total.mean().item() == pytest.approx(1 - 200 * 1e-4, rel=1e-3)  # nothing lost
    nearest = torch.nn.Parameter(torch.ones(1000, dtype=torch.bfloat16))
    plain = mixprec.AdamW([nearest], lr=1e-4, weight_decay=0.0, update="nearest")
    for _ in range(200):
        nearest.grad = torch.ones(1000, dtype=torch.bfloat16)
        plain.step()
    assert torch.equal(nearest, torch.ones(1000, dtype=torch.bfloat16))  # plain bf16 rounds every update away


def test_state_is_stored_in_the_parameter_dtype_but_the_second_moment_in_fp32():
    _, ours, opt = run_pair(2, torch.bfloat16)
    state = opt.state[ours]
    assert {k: v.dtype for k, v in state.items()} == {
        "step": torch.float32,
        "exp_avg": torch.bfloat16,
        "exp_avg_sq": torch.float32,
        "kahan_comp": torch.bfloat16,
    }
    _, ours, opt = run_pair(2, torch.bfloat16, update="nearest")  # a bf16 torch optimizer's state
    assert opt.state[ours]["exp_avg_sq"].dtype == torch.bfloat16
    _, ours, opt = run_pair(2, torch.bfloat16, update="stochastic")
    assert "kahan_comp" not in opt.state[ours]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"lr": -1.0}, "lr must be a finite number >= 0; received -1.0"),
        ({"lr": "1e-3"}, "lr must be a finite number >= 0; received '1e-3'"),
        ({"betas": 0.9}, "betas must be two numbers"),
        ({"betas": (1.0, 0.9)}, "betas"),
        ({"eps": -1.0}, "eps"),
        ({"update": "fast"}, "update must be one of 'kahan', 'stochastic', 'nearest'; received 'fast'"),
    ],
)
def test_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        mixprec.AdamW([torch.nn.Parameter(torch.ones(1))], **kwargs)


def test_kahan_steps_the_fp32_value_parameter_plus_compensation():
    # Reference: torch.optim.AdamW (FP32, single-tensor) on w = p + c with the bf16-stored first moment and the
    # FP32 second moment, then p = round(w) and c = w - p, every step.
    torch.manual_seed(1)
    ours = torch.nn.Parameter(torch.randn(256).bfloat16())
    opt = mixprec.AdamW([ours], lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1)
    p, c = ours.detach().clone(), torch.zeros(256, dtype=torch.bfloat16)
    m, v = torch.zeros(256, dtype=torch.bfloat16), torch.zeros(256)
    for step in range(1, 21):
        grad = torch.randn(256).bfloat16()
        ours.grad = grad.clone()
        opt.step()
        w = torch.nn.Parameter(p.float() + c.float())
        ref = torch.optim.AdamW([w], lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1, foreach=False)
        ref.state[w] = {"step": torch.tensor(float(step - 1)), "exp_avg": m.float(), "exp_avg_sq": v.float()}
        w.grad = grad.float()
        ref.step()
        m, v = ref.state[w]["exp_avg"].bfloat16(), ref.state[w]["exp_avg_sq"].clone()
        p = w.detach().bfloat16()
        c = (w.detach() - p.float()).bfloat16()
    total = ours.float() + opt.state[ours]["kahan_comp"].float()
    torch.testing.assert_close(total, p.float() + c.float(), rtol=1e-5, atol=1e-7)
    assert (ours != p).sum() <= 2  # a last-bit difference between kernels may flip a rounding


@pytest.mark.parametrize("update", ["kahan", "stochastic", "nearest"])
def test_updating_in_chunks_gives_the_same_result(update, monkeypatch):
    def train(chunk_elements):
        monkeypatch.setattr("mixprec.master.compensated.CHUNK_ELEMENTS", chunk_elements)
        torch.manual_seed(2)
        params = [torch.nn.Parameter(torch.randn(n).bfloat16()) for n in (7, 300, 20, 5)]
        opt = mixprec.AdamW(params, lr=1e-3, update=update, generator=torch.Generator().manual_seed(0))
        for _ in range(5):
            for param in params:
                param.grad = torch.randn_like(param)
            opt.step()
        return params

    for one, other in zip(train(2**22), train(16), strict=True):
        assert torch.equal(one, other)


def _require_single_pass() -> None:
    """Skip, with the optimizer's own reason, where the compiled kernel cannot run; asking for it there fails."""
    param = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    param.grad = torch.ones(4, dtype=torch.bfloat16)
    try:
        mixprec.AdamW([param], lr=1e-3, single_pass=True).step()
    except RuntimeError as error:
        assert "single_pass=True): the compiled kernel is unavailable here (" in str(error)
        pytest.skip(str(error))


def _kahan_runs(shapes, steps, lr=1e-3, weight_decay=0.1):
    """The same bf16 parameters and gradients through the eager and the single-pass compensated AdamW."""
    runs = {}
    for single_pass in (False, True):
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(*shape).bfloat16()) for shape in shapes]
        optimizer = mixprec.AdamW(params, lr=lr, weight_decay=weight_decay, single_pass=single_pass)
        gradients = torch.Generator().manual_seed(1)
        for step in range(steps):
            for param in params:
                param.grad = (torch.randn(param.shape, generator=gradients) * 0.01).bfloat16()
            if step == steps // 2:
                optimizer.param_groups[0]["lr"] = lr / 3  # a schedule's change reaches the kernel
            optimizer.step()
        runs[single_pass] = (params, optimizer)
    return runs


def test_the_single_pass_kernel_tracks_the_eager_update_within_its_stated_bound_over_1000_steps():
    """The bound argued in mixprec/master/single_pass.py: the FP32 value p + c agrees to 1e-4 relative; the
    stored bf16 tensors differ only where an FP32 ulp flipped a rounding (almost nowhere)."""
    _require_single_pass()
    runs = _kahan_runs([(64, 32), (1000,), (8, 16, 3, 3), (7, 3)], steps=1000)
    (eager, eager_opt), (single, single_opt) = runs[False], runs[True]
    for a, b in zip(eager, single, strict=True):
        wide_a = a.float() + eager_opt.state[a]["kahan_comp"].float()
        wide_b = b.float() + single_opt.state[b]["kahan_comp"].float()
        assert ((wide_a - wide_b).abs() <= 1e-4 * wide_a.abs().clamp(min=1e-2)).all()
        assert (a == b).float().mean() >= 0.99
        assert (eager_opt.state[a]["exp_avg"] == single_opt.state[b]["exp_avg"]).float().mean() >= 0.99
        # the FP32 second moment: an FP32 ulp apart where the generated code contracted an operation
        torch.testing.assert_close(
            single_opt.state[b]["exp_avg_sq"], eager_opt.state[a]["exp_avg_sq"], rtol=1e-5, atol=0
        )


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_the_cuda_group_step_tracks_the_eager_path_and_skips_and_unscales_on_the_device(compiled):
    """The graph CUDA parameters take (a whole group in one compiled graph, the skip and the step counts on the
    device), run on the CPU: as Python and compiled by Inductor (C++ here, Triton on CUDA). Held to the eager
    path within the single-pass kernel's bound, through a schedule's lr change, loss-scaled gradients and a
    skipped step."""
    from mixprec.master import single_pass

    if compiled:
        _require_single_pass()  # Inductor's C++ backend needs a compiler
    kernel = single_pass.compile_group_kernel() if compiled else single_pass._kahan_adamw_group_
    torch.manual_seed(0)
    starts = [torch.randn(*shape).bfloat16() for shape in ((64, 32), (1000,), (7, 3))]
    params = [torch.nn.Parameter(start.clone()) for start in starts]
    eager = mixprec.AdamW(params, lr=1e-3, weight_decay=0.1, single_pass=False)
    group = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.1}
    weights = [start.clone() for start in starts]
    compensations, avgs = ([torch.zeros_like(w) for w in weights] for _ in range(2))
    avg_sqs = [torch.zeros_like(w, dtype=torch.float32) for w in weights]  # the second moment in FP32
    steps = [torch.zeros(()) for _ in weights]
    gradients = torch.Generator().manual_seed(1)
    scale = torch.tensor(1024.0)
    for step in range(60):
        grads = [(torch.randn(w.shape, generator=gradients) * 0.01).bfloat16() * 1024 for w in weights]
        found = torch.tensor(1.0 if step == 20 else 0.0)
        if step == 30:
            group["lr"] = eager.param_groups[0]["lr"] = 1e-3 / 3
        for param, grad in zip(params, grads, strict=True):
            param.grad = grad.clone()
        eager.grad_scale, eager.found_inf = scale, found.reshape(1)
        eager.step()
        tensors = (weights, compensations, grads, avgs, avg_sqs)
        single_pass.run_kahan_adamw_group(kernel, tensors, steps, group, scale, found)
    for param, weight, compensation, avg, avg_sq, count in zip(params, *tensors[:2], *tensors[3:], steps, strict=True):
        state = eager.state[param]
        wide_eager = param.float() + state["kahan_comp"].float()
        wide = weight.float() + compensation.float()
        assert ((wide - wide_eager).abs() <= 1e-4 * wide_eager.abs().clamp(min=1e-2)).all()
        assert (weight == param).float().mean() >= 0.99
        assert (avg == state["exp_avg"]).float().mean() >= 0.99
        torch.testing.assert_close(avg_sq, state["exp_avg_sq"], rtol=1e-5, atol=0)
        assert count.item() == state["step"].item() == 59  # the skipped step not counted


def test_a_group_kernel_that_fails_to_compile_changes_nothing_and_hands_over_to_the_eager_path(monkeypatch):
    from mixprec.master import single_pass

    def failing(*args):
        raise torch._dynamo.exc.TorchDynamoException("no Triton today")  # what compiling raises, at its root

    monkeypatch.setattr(single_pass, "_unavailable", {})
    weights = [torch.ones(8, dtype=torch.bfloat16)]
    tensors = (weights, *([torch.zeros(8, dtype=torch.bfloat16)] for _ in range(4)))
    steps = [torch.zeros(())]
    group = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}
    assert single_pass.run_kahan_adamw_group(failing, tensors, steps, group, None, None) is False
    assert torch.equal(weights[0], torch.ones(8, dtype=torch.bfloat16)) and steps[0].item() == 0
    # later steps on that device type (the tensors' own: CPU here) take the eager path
    assert single_pass.kahan_adamw_kernel("cpu") is None
    assert single_pass.why_unavailable("cpu") == "compiling failed: no Triton today"


def test_a_group_with_a_strided_tensor_changes_nothing_and_takes_the_eager_path_this_step(monkeypatch):
    from mixprec.master import single_pass

    monkeypatch.setattr(single_pass, "_unavailable", {})
    weights = [torch.ones(4, 8, dtype=torch.bfloat16).t()]  # a transposed view: no flat view of it
    tensors = (weights, *([torch.zeros(8, 4, dtype=torch.bfloat16)] for _ in range(4)))
    group = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}
    ran = single_pass.run_kahan_adamw_group(
        single_pass._kahan_adamw_group_, tensors, [torch.zeros(())], group, None, None
    )
    assert ran is False and torch.equal(weights[0], torch.ones(8, 4, dtype=torch.bfloat16))
    assert single_pass._unavailable == {}  # only this step: the kernel stays available


def test_single_pass_true_refuses_where_it_cannot_run(monkeypatch):
    monkeypatch.setenv("MIXPREC_SINGLE_PASS", "0")
    param = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    param.grad = torch.ones_like(param)
    with pytest.raises(RuntimeError, match=r"single_pass=True\): the compiled kernel is unavailable"):
        mixprec.AdamW([param], single_pass=True).step()
    optimizer = mixprec.AdamW([param])
    optimizer.step()  # the default takes the eager path
    assert optimizer.state[param]["kahan_comp"].abs().sum() > 0


def test_a_step_under_a_dispatch_mode_runs_eager_and_leaves_the_compiler_as_it_was():
    # FlopCounterMode around a step (a user counting FLOPs): torch.compile cannot trace under it, and a compile
    # that failed there switched dynamo's static sizes off for the rest of the process
    import torch._dynamo.config
    from torch.utils.flop_counter import FlopCounterMode

    torch.manual_seed(0)
    start = torch.randn(37).to(torch.bfloat16)
    params = [torch.nn.Parameter(start.clone()) for _ in range(2)]
    ours, eager = mixprec.AdamW([params[0]], single_pass=True), mixprec.AdamW([params[1]], single_pass=False)

    def step_both(under_mode: bool) -> None:
        grad = torch.randn(37).to(torch.bfloat16)
        params[0].grad, params[1].grad = grad.clone(), grad.clone()
        with FlopCounterMode(display=False) if under_mode else contextlib.nullcontext():
            ours.step()
        eager.step()

    step_both(under_mode=True)  # the first step, where the kernel would compile: the eager path, no refusal
    assert torch.equal(params[0], params[1])
    assert torch.equal(ours.state[params[0]]["kahan_comp"], eager.state[params[1]]["kahan_comp"])
    assert torch._dynamo.config.assume_static_by_default
    _require_single_pass()  # the rest needs the kernel (torch 2.11's inductor on a CPU folds its bf16 round trip)
    for _ in range(2):  # outside the mode the kernel compiles and runs (single_pass=True would refuse otherwise)
        step_both(under_mode=False)
    ours_value = params[0].float() + ours.state[params[0]]["kahan_comp"].float()
    eager_value = params[1].float() + eager.state[params[1]]["kahan_comp"].float()
    torch.testing.assert_close(ours_value, eager_value, rtol=0, atol=1e-6)  # the kernel's stated bound


def test_a_compiled_kernel_that_drops_the_compensation_is_caught_and_the_eager_path_keeps_it(monkeypatch, caplog):
    # what inductor does where it ignores emulate_precision_casts (torch 2.11 on the CPU): the bf16 round trip
    # folded, the compensation always 0; the optimizer checks the kernel once and keeps the eager path
    from mixprec.master import single_pass

    def folding_compile(fn, **options):
        def folded(p, c, *rest):
            fn(p, c, *rest)
            c.zero_()

        return folded

    monkeypatch.setattr(single_pass.torch, "compile", folding_compile)
    monkeypatch.setattr(single_pass, "_unavailable", {})
    single_pass._compiled_kernel.cache_clear()
    try:
        param = torch.nn.Parameter(torch.ones(1000, dtype=torch.bfloat16))
        optimizer = mixprec.AdamW([param], lr=1e-4, weight_decay=0.0)  # steps far below bf16's ulp at 1.0
        with caplog.at_level("WARNING", logger="mixprec"):
            for _ in range(10):
                param.grad = torch.ones_like(param)
                optimizer.step()
    finally:
        single_pass._compiled_kernel.cache_clear()  # the next test compiles the real kernel again
    if "no C++ compiler" in caplog.text:
        pytest.skip("no C++ compiler: the kernel is never compiled here")
    assert "the single-pass kernel drops the Kahan compensation under torch" in caplog.text
    total = param.float() + optimizer.state[param]["kahan_comp"].float()
    assert total.mean().item() == pytest.approx(1 - 10 * 1e-4, rel=1e-4)  # nothing lost: the eager path ran


AMP_CASES = [  # (parameter dtype, update mode, single_pass): the fused-kernel path and the host-read paths
    (torch.bfloat16, "kahan", False),
    (torch.bfloat16, "kahan", None),
    (torch.bfloat16, "nearest", None),
    (torch.bfloat16, "stochastic", None),
    (torch.float32, "kahan", None),
]


def _stepped_twice(device, dtype, update, single_pass, scale=None, found=None):
    """Two steps: a plain one, then one with gradients times ``scale`` handed over as GradScaler does."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape).to(device, dtype)) for shape in ((33, 7), (5,))]
    optimizer = mixprec.AdamW(params, lr=1e-2, update=update, single_pass=single_pass, generator=torch.Generator())
    for step in range(2):
        for p in params:
            p.grad = torch.randn(p.shape).to(device, dtype)
        if step == 1 and scale is not None:
            for p in params:
                p.grad *= scale  # a power of two: unscaling is exact
            optimizer.grad_scale = torch.tensor(scale, device=device)
            optimizer.found_inf = torch.tensor([float(found)], device=device)
        optimizer.step()
        optimizer.__dict__.pop("grad_scale", None), optimizer.__dict__.pop("found_inf", None)
        if step == 0:
            before = _snapshot(params, optimizer)
    return before, _snapshot(params, optimizer)


def _snapshot(params, optimizer):
    tensors = [p.detach().clone() for p in params]
    for p in params:
        tensors += [v.clone() for v in optimizer.state[p].values()]  # moments, compensation, step
    return tensors


@pytest.mark.parametrize(("dtype", "update", "single_pass"), AMP_CASES)
def test_found_inf_handed_to_step_leaves_everything_as_it_was(device, dtype, update, single_pass):
    before, after = _stepped_twice(device, dtype, update, single_pass, scale=1024.0, found=1)
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))


@pytest.mark.parametrize(("dtype", "update", "single_pass"), AMP_CASES)
def test_grad_scale_handed_to_step_equals_the_unscaled_step_bit_for_bit(device, dtype, update, single_pass):
    _, reference = _stepped_twice(device, dtype, update, single_pass)
    _, scaled = _stepped_twice(device, dtype, update, single_pass, scale=1024.0, found=0)
    assert all(torch.equal(a, b) for a, b in zip(reference, scaled, strict=True))


def test_torch_grad_scaler_drives_it_through_the_same_protocol():
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(8, 4))
    optimizer = mixprec.AdamW([weight], lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    scaler.scale((weight * float("inf")).sum()).backward()
    scaler.step(optimizer)  # GradScaler hands found_inf and its scale to step(), which skips
    scaler.update()
    assert not optimizer.state[weight] or optimizer.state[weight]["step"].item() == 0
    assert scaler.get_scale() == 2.0**9


def _pretrained_pair(steps, lr=1e-5):
    """The same FP32 model and batches under o2_bf16 (FP32 masters) and pure_bf16 (compensated bf16)."""
    import torch.nn.functional as F

    runs = {}
    for policy in ("o2_bf16", "pure_bf16"):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 4))
        adamw = mixprec.AdamW if policy == "pure_bf16" else torch.optim.AdamW
        mp = mixprec.MixedPrecision(model, adamw(model.parameters(), lr=lr, weight_decay=0.0), policy)
        data = torch.Generator().manual_seed(1)
        for _ in range(steps):
            x, y = torch.randn(16, 32, generator=data), torch.randint(0, 4, (16,), generator=data)
            with mp.autocast():
                mp.backward(F.cross_entropy(model(x), y))
            mp.step()
        runs[policy] = mp.fp32_state_dict() if policy == "o2_bf16" else _effective(mp)
    torch.manual_seed(0)
    exact = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 4)).state_dict()
    return exact, runs


def _effective(mp):
    """pure_bf16's weights as the optimizer steps them: parameter + compensation, in FP32."""
    state = mp.optimizer.state
    return {
        name: p.float() + (state[p]["kahan_comp"].float() if "kahan_comp" in state[p] else 0)
        for name, p in mp.model.named_parameters()
    }


def test_pure_bf16_starts_from_the_exact_fp32_weights_and_tracks_o2s_masters():
    # Cast to bf16, a pretrained FP32 weight loses up to 2^-9 of itself; the compensation starts at that loss
    # (at the first step), so parameter + compensation is the FP32 weight to 16 bits, and fine-tuning moves
    # that, as o2's masters move the exact weight (a compensation starting at 0 was 1e-2 behind on a
    # pretrained MiniLM's eval loss)
    exact, unmoved = _pretrained_pair(steps=1, lr=0.0)
    _, runs = _pretrained_pair(steps=5)
    for name, weight in exact.items():
        assert (unmoved["pure_bf16"][name] - weight).abs().max() <= weight.abs().max() * 2**-16
        assert (runs["pure_bf16"][name] - runs["o2_bf16"][name]).abs().max() <= weight.abs().max() * 2**-14


def test_weights_loaded_after_the_cast_and_frozen_ones_start_without_a_residual():
    def first_step(load: bool):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
        model[1].requires_grad_(False)
        optimizer = mixprec.AdamW(model.parameters(), lr=0.0, weight_decay=0.0)
        mp = mixprec.MixedPrecision(model, optimizer, "pure_bf16")
        if load:  # e.g. a checkpoint loaded into the cast model: the residual no longer describes its weights
            model.load_state_dict({k: torch.randn_like(v) for k, v in model.state_dict().items()})
        with mp.autocast():
            mp.backward(model(torch.randn(4, 8)).sum())
        mp.step()
        return model, optimizer

    model, optimizer = first_step(load=False)
    assert optimizer.state[model[0].weight]["kahan_comp"].abs().max() > 0
    assert not optimizer.state[model[1].weight]  # frozen: no state, no residual kept
    model, optimizer = first_step(load=True)
    assert optimizer.state[model[0].weight]["kahan_comp"].abs().max() == 0


@pytest.mark.parametrize("update", ["kahan", "stochastic"])
def test_the_second_moment_decays_as_fp32_adamws_after_large_gradients(update):
    # In bf16, 0.999 * v rounds back to v (a 0.1% change, under half a bf16 unit): after a burst of large
    # gradients the second moment stayed high and the weight moved a third as far as FP32 AdamW's (before
    # 2026-11-28, 100 + 4,900 steps)
    def train(param, optimizer):
        for step in range(1100):
            param.grad = torch.full_like(param, 1.0 if step < 100 else 0.01)
            optimizer.step()

    ours = torch.nn.Parameter(torch.ones(64, dtype=torch.bfloat16))
    generator = torch.Generator().manual_seed(0)
    opt = mixprec.AdamW([ours], lr=1e-3, weight_decay=0.0, update=update, generator=generator)
    train(ours, opt)
    reference = torch.nn.Parameter(torch.ones(64))
    ref = torch.optim.AdamW([reference], lr=1e-3, weight_decay=0.0)
    train(reference, ref)
    torch.testing.assert_close(opt.state[ours]["exp_avg_sq"], ref.state[reference]["exp_avg_sq"], rtol=1e-4, atol=0)
    moved = 1 - ours.float() - (opt.state[ours]["kahan_comp"].float() if update == "kahan" else 0)
    expected = 1 - reference.detach()
    # the first moment stays bf16 (0.4% apart here); stochastic rounding is unbiased, not exact
    torch.testing.assert_close(moved.mean(), expected.mean(), rtol=1e-2, atol=0)


def test_a_loaded_state_keeps_the_fp32_second_moment_and_resumes_bit_for_bit():
    def make(start):
        param = torch.nn.Parameter(start.clone())
        return param, mixprec.AdamW([param], lr=1e-2, weight_decay=0.1)

    def steps(param, opt, first, count):
        for step in range(first, first + count):
            param.grad = (torch.randn(32, generator=torch.Generator().manual_seed(step))).bfloat16()
            opt.step()

    start = torch.randn(32, generator=torch.Generator().manual_seed(9)).bfloat16()
    whole, whole_opt = make(start)
    steps(whole, whole_opt, 0, 6)
    half, half_opt = make(start)
    steps(half, half_opt, 0, 3)
    saved = half_opt.state_dict()
    resumed, resumed_opt = make(half.detach())
    resumed_opt.load_state_dict(saved)  # torch's load casts state to the parameter's dtype: not this one
    assert resumed_opt.state[resumed]["exp_avg_sq"].dtype == torch.float32
    steps(resumed, resumed_opt, 3, 3)
    assert torch.equal(resumed, whole)
    for key in ("exp_avg", "exp_avg_sq", "kahan_comp"):
        assert torch.equal(resumed_opt.state[resumed][key], whole_opt.state[whole][key]), key


def test_a_state_saved_with_a_bf16_second_moment_loads_widened():
    param = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    opt = mixprec.AdamW([param])
    param.grad = torch.ones_like(param)
    opt.step()
    saved = opt.state_dict()
    saved["state"][0]["exp_avg_sq"] = saved["state"][0]["exp_avg_sq"].bfloat16()  # an earlier release's file
    opt.load_state_dict(saved)
    assert opt.state[param]["exp_avg_sq"].dtype == torch.float32
    assert torch.equal(opt.state[param]["exp_avg_sq"], saved["state"][0]["exp_avg_sq"].float())


def test_start_residuals_are_dropped_once_a_loaded_state_makes_them_unusable():
    # a resume gives start_from its residuals before the optimizer state is loaded: they were kept for the whole
    # run (2 bytes a parameter) before 2026-11-28
    param = torch.nn.Parameter(torch.ones(8, dtype=torch.bfloat16))
    trained = mixprec.AdamW([param])
    param.grad = torch.ones_like(param)
    trained.step()
    opt = mixprec.AdamW([param])
    assert opt.start_from({param: torch.full_like(param, 2**-10)}) == 1
    opt.load_state_dict(trained.state_dict())
    param.grad = torch.ones_like(param)
    opt.step()
    assert opt.start_from({}) == 0  # none pending


def test_a_param_groups_bad_update_mode_is_refused_like_the_constructors():
    # a typo in a group's own update was taken as stochastic rounding before 2026-11-28
    params = [torch.nn.Parameter(torch.ones(2, dtype=torch.bfloat16)) for _ in range(2)]
    with pytest.raises(ValueError, match="update must be one of 'kahan', 'stochastic', 'nearest'; received 'Kahan'"):
        mixprec.AdamW([{"params": [params[0]]}, {"params": [params[1]], "update": "Kahan"}])
    opt = mixprec.AdamW([params[0]])
    with pytest.raises(ValueError, match="lr must be a finite number >= 0; received -1"):
        opt.add_param_group({"params": [params[1]], "lr": -1})
    with pytest.raises(TypeError, match=r"generator=...\) takes a torch.Generator"):
        mixprec.AdamW([params[0]], update="stochastic", generator="x")


def test_a_skipped_step_on_the_eager_kahan_path_moves_no_weight():
    # the eager path re-rounded p + c on a skipped step: a weight whose compensation was exactly half a unit moved
    # by one (871 of 2**20 before 2026-11-28)
    torch.manual_seed(0)
    param = torch.nn.Parameter(torch.randn(2**18, dtype=torch.bfloat16))
    opt = mixprec.AdamW([param], lr=1e-3, single_pass=False)
    for _ in range(3):
        param.grad = torch.randn_like(param)
        opt.step()
    before = {key: value.clone() for key, value in opt.state[param].items()}
    weights = param.detach().clone()
    param.grad = torch.full_like(param, float("inf"))
    opt.found_inf, opt.grad_scale = torch.ones(()), None  # GradScaler's protocol
    opt.step()
    assert torch.equal(param, weights)
    assert all(torch.equal(opt.state[param][key], value) for key, value in before.items())


def test_float64_parameters_step_as_torchs_adamw_in_every_mode():
    for update in ("kahan", "stochastic", "nearest"):
        ours, reference = (torch.nn.Parameter(torch.ones(4, dtype=torch.float64)) for _ in range(2))
        opt = mixprec.AdamW([ours], lr=1e-9, update=update)
        ref = torch.optim.AdamW([reference], lr=1e-9)
        for _ in range(10):
            ours.grad, reference.grad = torch.ones_like(ours), torch.ones_like(reference)
            opt.step()
            ref.step()
        torch.testing.assert_close(ours, reference, rtol=1e-15, atol=0)
        assert (1 - ours.detach()).min() > 0  # 1e-8 moved, not lost in an FP32 round trip
