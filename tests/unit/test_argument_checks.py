"""Inputs a review found taken as something else, or failing deep inside torch: each refused by name.

A string where a flag belongs is truthy ("false" turned TF32 on, "no" saturated); a loaded optimizer state
skipped the constructor's checks; a loss scale past FP32's normal range was accepted everywhere but the CLI.
"""

import math

import pytest
import torch
from torch import nn

import mixprec
from mixprec.app.config import TrainConfig


def _engine(policy: str = "mixed_fp16", **kwargs) -> tuple[nn.Module, mixprec.MixedPrecision]:
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    return model, mixprec.MixedPrecision(model, torch.optim.SGD(model.parameters(), lr=0.1), policy, **kwargs)


def _plateau_stepped() -> None:
    model, mp = _engine("mixed_bf16")
    with mp.autocast():
        loss = model(torch.ones(2, 4)).sum()
    mp.backward(loss)
    mp.step()
    mp.step_scheduler(torch.optim.lr_scheduler.ReduceLROnPlateau(mp.optimizer))  # torch: "missing 'metrics'"


@pytest.mark.parametrize(
    ("make", "error", "message"),
    [
        (lambda: mixprec.Policy(allow_tf32="false"), TypeError, r"Policy\(allow_tf32=\.\.\.\) needs True or False"),
        (lambda: mixprec.quantize(torch.ones(2), "fp16", saturate="no"), TypeError, r"saturate=\.\.\.\) needs True"),
        (lambda: mixprec.quantize(torch.ones(2), "fp16", "stochastic", generator="g"), TypeError, r"generator="),
        (lambda: mixprec.quantize(torch.ones(2), "mxfp8"), ValueError, "block-scaled formats mxfp8_e4m3"),
        (lambda: mixprec.AdamW([nn.Parameter(torch.ones(2))], lr=math.inf), ValueError, "lr must be a finite"),
        (lambda: mixprec.AdamW([nn.Parameter(torch.ones(2))], single_pass=1), TypeError, "single_pass"),
        (lambda: _engine(history=-1), ValueError, r"history=\.\.\.\) must be an integer >= 0"),
        (lambda: mixprec.DynamicLossScaler(init_scale=1e39), ValueError, "from 2\\^-126 to 3.4e38"),
        (lambda: mixprec.StaticLossScaler(1e-50), ValueError, "from 2\\^-126 to 3.4e38"),
        (lambda: TrainConfig(task="digits", loss_scale=1e39), ValueError, "config 'loss_scale' must be from"),
        (lambda: mixprec.checkpoint(nn.Linear(2, 2), torch.ones(2), use_reentrant="no"), TypeError, "use_reentrant"),
        (lambda: mixprec.checkpoint(None, torch.ones(2)), TypeError, r"function=\.\.\.\) needs a callable"),
        (lambda: mixprec.DynamicLossScaler().update(None), TypeError, r"update\(found_inf=\.\.\.\) needs a torch"),
        (lambda: mixprec.DynamicLossScaler().unscale_(None), TypeError, r"unscale_\(grads=\.\.\.\) needs a list"),
        (lambda: mixprec.StaticLossScaler(1.0).unscale_(None), TypeError, r"unscale_\(grads=\.\.\.\) needs a list"),
        (lambda: mixprec.StaticLossScaler(1.0).update(None), TypeError, r"update\(found_inf=\.\.\.\) needs a torch"),
        (lambda: mixprec.NoOpLossScaler().update(None), TypeError, r"update\(found_inf=\.\.\.\) needs a torch"),
        (lambda: mixprec.DynamicLossScaler().unscale_("grads"), TypeError, r"unscale_\(grads=\.\.\.\) needs a list"),
        (_plateau_stepped, TypeError, r"ReduceLROnPlateau steps on a validation metric, .* scheduler.step\(metric\)"),
    ],
)
def test_a_wrong_argument_is_refused_by_name(make, error, message):
    with pytest.raises(error, match=message):
        make()


def test_a_failed_backward_call_is_not_counted_and_clipping_takes_only_a_positive_norm_type():
    model, mp = _engine()
    loss = model(torch.ones(3, 4)).sum()
    with pytest.raises(TypeError, match=r"backward\(retain_graph=\.\.\.\) \(or None\) needs True or False"):
        mp.backward(loss, retain_graph="yes")
    with pytest.raises(RuntimeError, match=r"step\(\) without backward\(\)"):  # it had counted a backward
        mp.step()
    mp.backward(loss)
    for norm_type in (math.nan, "2", 0):
        with pytest.raises(ValueError, match=r"clip_grad_norm_\(norm_type=\.\.\.\) needs a positive number"):
            mp.clip_grad_norm_(1.0, norm_type=norm_type)
    assert mp.step().applied


def test_lbfgs_is_refused_where_every_adapter_builds_the_engine():
    model = nn.Linear(4, 2)
    with pytest.raises(ValueError, match=r"LBFGS re-evaluates the loss inside step\(\)"):
        mixprec.MixedPrecision(model, torch.optim.LBFGS(model.parameters()), "mixed_bf16")


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda m: m.half(), "is torch.float16"),
        (lambda m: m.fill_(math.nan), "is not finite"),
        (lambda m: torch.empty_like(m, device="meta"), "is on the meta device"),
    ],
)
def test_loaded_master_weights_must_be_finite_fp32_values(change, message):
    _, mp = _engine("o2_bf16")
    state = mp.state_dict()
    state["masters"][0] = change(state["masters"][0].clone())
    with pytest.raises(ValueError, match=f"master weight 0 in the checkpoint {message}"):
        mp.load_state_dict(state)


def test_a_loaded_optimizer_state_is_checked_and_takes_the_defaults_it_lacks():
    params = [nn.Parameter(torch.ones(4, dtype=torch.bfloat16))]
    ours = mixprec.AdamW(params)
    saved = ours.state_dict()
    saved["param_groups"][0]["update"] = "Kahan"  # stochastic rounding, where the constructor refuses it
    with pytest.raises(ValueError, match="update must be one of"):
        ours.load_state_dict(saved)
    with pytest.raises(ValueError, match="needs what an optimizer's state_dict"):
        ours.load_state_dict({})
    theirs = nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    torch_adamw = torch.optim.AdamW([theirs], betas=(torch.tensor(0.9), torch.tensor(0.999)))  # tensor betas too
    theirs.grad = torch.ones(4, dtype=torch.bfloat16)
    torch_adamw.step()  # a state with moments and no compensation
    ours.load_state_dict(torch_adamw.state_dict())
    assert ours.param_groups[0]["update"] == "kahan"  # torch's state has none: the default (was a KeyError at step)
    params[0].grad = torch.ones(4, dtype=torch.bfloat16)
    ours.step()
    assert "kahan_comp" in ours.state[params[0]]


def test_the_lightning_plugins_flags_are_flags():
    lightning = pytest.importorskip("mixprec.integrations.lightning")
    for name in ("log_stats", "fp32_after_fit", "allow_optimizer_step_override"):
        with pytest.raises(TypeError, match=rf"MixprecPrecision\({name}=\.\.\.\) needs True or False"):
            lightning.MixprecPrecision("mixed_bf16", **{name: "false"})


@pytest.mark.parametrize(
    ("make", "error", "message"),
    [
        (lambda: _engine("mixd"), ValueError, r"^MixedPrecision\(policy='mixd'\): unknown policy"),
        (lambda: mixprec.autocast(None, nn.Linear(2, 2)).__enter__(), TypeError, r"^autocast\(policy=\.\.\.\) takes"),
        (lambda: mixprec.autocast("bf16", "model").__enter__(), TypeError, r"autocast\(model=\.\.\.\) needs an nn"),
        (lambda: mixprec.fully_shard(nn.Linear(2, 2), "fp32"), ValueError, "no process group and no mesh="),
        (
            lambda: mixprec.diagnose(nn.Linear(2, 2), None, nn.MSELoss()),
            TypeError,
            r"diagnose\(batches=\.\.\.\) needs an iterable",
        ),
        (lambda: mixprec.device_caps("gpu"), ValueError, "device='gpu' .* is not a device"),
    ],
)
def test_an_entry_point_names_itself_and_the_argument(make, error, message):
    with pytest.raises(error, match=message):
        make()


def test_a_policy_given_by_name_where_a_policy_is_taken_and_one_device_type_one_answer():
    model = nn.Sequential(nn.Linear(2, 2), nn.LayerNorm(2))
    assert [name for name, _ in mixprec.fp32_modules(model, "base=mixed_bf16,mods=LayerNorm")] == ["1"]
    assert mixprec.cast_module(model, "o2_bf16")[0].weight.dtype == torch.bfloat16
    assert mixprec.device_caps("cuda:0") == mixprec.device_caps("cuda")  # the type counts, not the index


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"counters": {}}, "the counters lack inf_steps"),
        ({"scalers": None}, "'scalers' must be a list"),
        ({"micro_step": -1}, "'micro_step' must be an integer >= 0"),
        ({"accumulation_steps": "1"}, "'accumulation_steps' must be an integer >= 1; received '1'"),
    ],
)
def test_a_loaded_engine_state_with_a_wrong_field_is_refused_by_name(change, message):
    _, mp = _engine()
    with pytest.raises(ValueError, match=message):
        mp.load_state_dict({**mp.state_dict(), **change})


def test_the_trainer_adapter_names_arguments_that_are_not_training_arguments():
    transformers_adapter = pytest.importorskip("mixprec.integrations.transformers")
    with pytest.raises(ValueError, match=r"args=\.\.\. needs a transformers\.TrainingArguments .* received str"):
        transformers_adapter.MixprecTrainer(nn.Linear(2, 2), "out", policy="mixed_bf16")


def test_numpys_bools_are_flags_and_a_scalers_bounds_load_back():
    import numpy as np

    assert mixprec.quantize(torch.tensor([1e6]), "fp16", saturate=np.bool_(True)).item() == 65504.0
    with pytest.raises(ValueError, match=r"min_scale=\.\.\.\) must be from 2\^-126"):  # a floor no load would take
        mixprec.DynamicLossScaler(init_scale=1.0, min_scale=2.0**-130)
    scaler = mixprec.DynamicLossScaler(init_scale=1.0, min_scale=0.7)  # backs off to 0.7 as FP32 holds it
    scaler.update(torch.tensor([1.0]))
    restored = mixprec.DynamicLossScaler()
    restored.load_state_dict(scaler.state_dict())  # refused before: "min_scale=0.7 is above init_scale=0.6999"
    assert restored.get_scale() == scaler.get_scale() == restored.min_scale
