import dataclasses
import re

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import mixprec

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


@pytest.mark.parametrize(
    ("preset", "params", "compute", "output", "master", "fp32_modules"),
    [
        ("fp32", F32, F32, F32, F32, ()),
        ("mixed_fp16", F32, F16, F32, F32, ()),
        ("mixed_float16", F32, F16, F32, F32, ()),
        ("mixed_bf16", F32, BF16, F32, F32, ()),
        ("mixed_bfloat16", F32, BF16, F32, F32, ()),
        ("o2_fp16", F16, F16, F32, F32, ("norm",)),
        ("o2_bf16", BF16, BF16, F32, F32, ("norm",)),
        ("pure_bf16", BF16, BF16, F32, BF16, ()),
    ],
)
def test_presets(preset, params, compute, output, master, fp32_modules):
    policy = mixprec.get_policy(preset)
    assert (policy.param_dtype, policy.compute_dtype, policy.output_dtype, policy.master_dtype) == (
        params,
        compute,
        output,
        master,
    )
    assert policy.fp32_modules == fp32_modules
    assert policy.reason  # every preset says what it is for
    assert mixprec.get_policy(str(policy)) == policy


def test_master_weights_flags():
    assert mixprec.get_policy("o2_bf16").keeps_fp32_masters
    assert not mixprec.get_policy("pure_bf16").keeps_fp32_masters
    assert not mixprec.get_policy("mixed_bf16").keeps_fp32_masters
    assert not mixprec.get_policy("fp32").is_mixed and mixprec.get_policy("mixed_fp16").is_mixed
    # pure: 16-bit parameters with no FP32 copy anywhere (the optimizer must compensate its rounding)
    assert [name for name in mixprec.PRESETS if mixprec.get_policy(name).is_pure] == ["pure_bf16"]
    assert mixprec.get_policy("p=fp16,c=fp16,o=fp16,m=fp16").is_pure


def test_tf32_preset():
    policy = mixprec.get_policy("tf32")
    assert policy.allow_tf32 and policy.compute_dtype == F32
    assert str(policy) == "params=float32,compute=tf32,output=float32"


def test_auto_chooses_with_a_reason():
    policy = mixprec.get_policy("auto", device="cpu")  # measured on this machine (cached per machine)
    assert policy.reason.startswith("auto on CPU") and "measured" in policy.reason
    tag = {BF16: "bf16 matmuls measured", F16: "fp16 matmuls measured", F32: "fp32: no 16-bit matmul"}
    assert tag[policy.compute_dtype] in policy.reason


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("p=f32,c=bf16,o=f32", "params=float32,compute=bfloat16,output=float32"),
        ("params=float32,compute=bfloat16,output=float32", "params=float32,compute=bfloat16,output=float32"),
        ("c=f16", "params=float32,compute=float16,output=float16"),  # output follows compute
        ("p=bf16", "params=bfloat16,compute=bfloat16,output=bfloat16,master=float32".replace(",master=float32", "")),
        ("bf16", "params=bfloat16,compute=bfloat16,output=bfloat16"),
        (" P = half , C = half , O = float ", "params=float16,compute=float16,output=float32"),
        (
            "p=f32,c=bf16,o=f32,ops=softmax+exp,names=*.lm_head,mods=norm+Embedding",
            "params=float32,compute=bfloat16,output=float32,fp32_modules=norm+Embedding,"
            "fp32_names=*.lm_head,fp32_ops=softmax+exp",
        ),
        ("p=bf16,m=bf16", "params=bfloat16,compute=bfloat16,output=bfloat16,master=bfloat16"),
    ],
)
def test_grammar(spec, expected):
    assert str(mixprec.get_policy(spec)) == expected


DTYPES = st.sampled_from([F32, F16, BF16])


@st.composite
def policies(draw):
    params = draw(DTYPES)
    compute = draw(DTYPES)
    return mixprec.Policy(
        param_dtype=params,
        compute_dtype=compute,
        output_dtype=draw(DTYPES),
        master_dtype=draw(st.sampled_from([F32, params])),
        allow_tf32=compute == F32 and draw(st.booleans()),
        fp32_modules=tuple(draw(st.lists(st.sampled_from(["norm", "Embedding", "MyBlock"]), max_size=3))),
        fp32_names=tuple(draw(st.lists(st.sampled_from(["*.lm_head", "encoder.layers.0", "head?"]), max_size=2))),
        fp32_ops=tuple(draw(st.lists(st.sampled_from(["softmax", "exp", "gelu", "matmul"]), max_size=3))),
    )


@given(policies())
def test_str_round_trips(policy):
    assert mixprec.get_policy(str(policy)) == policy


def test_policy_is_a_frozen_value():
    policy = mixprec.get_policy("mixed_bf16")
    with pytest.raises(dataclasses.FrozenInstanceError):
        policy.compute_dtype = F16  # type: ignore[misc]
    assert policy == mixprec.Policy(param_dtype="f32", compute_dtype="bf16", output_dtype="float32")
    assert hash(policy) == hash(mixprec.get_policy("p=f32,c=bf16,o=f32"))  # reason is not compared


def test_replace_returns_a_new_validated_policy():
    base = mixprec.get_policy("mixed_bf16")
    changed = base.replace(fp32_ops=("softmax",), output_dtype="bf16", fp32_names=("*.head",))
    assert base.fp32_ops == () and base.output_dtype == F32
    assert changed.fp32_ops == ("softmax",) and changed.output_dtype == BF16 and changed.fp32_names == ("*.head",)
    assert changed.reason == "" and base.reason
    assert mixprec.get_policy("tf32").replace(compute_dtype="f16").allow_tf32 is False
    assert base.replace(param_dtype="bf16", master_dtype="bf16").master_dtype == BF16
    with pytest.raises(ValueError, match="output_dtype"):
        base.replace(output_dtype="int8")
    with pytest.raises(TypeError):
        base.replace(colour="red")


def test_lists_are_deduplicated_in_order():
    assert mixprec.Policy(fp32_ops=("exp", "softmax", "exp")).fp32_ops == ("exp", "softmax")


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (
            "mixed_fp8",
            r"unknown policy\. Did you mean mixed_fp16 or mixed_bf16\? Valid presets: fp32, tf32, mixed_fp16",
        ),
        ("mixd_bf16", r"unknown policy\. Did you mean mixed_bf16"),
        ("bogus", r"unknown policy\. Valid presets"),
        ("p=f33", r"'f33' is not a known float format"),
        ("p=bf16,p=f32", r"the key 'params' is given twice"),
        ("x=1", r"unknown key 'x'; valid keys: .*params"),
        ("p=f32,c", r"the part 'c' is not 'key=value'"),
        ("p=f32,c=", r"the part 'c=' is not 'key=value'"),
        ("c=fp8_e4m3", r"compute_dtype.*'fp8_e4m3'.*use one of float32, float16, bfloat16"),
        ("p=fp64", r"param_dtype.*'fp64'"),
        ("p=f32,ops=sofmax", r"'sofmax' is not a function of torch"),
        # attributes that are no functions matched no op, silently
        ("p=f32,ops=nn", r"'nn' is not a function of torch"),
        ("p=f32,ops=Tensor", r"'Tensor' is not a function of torch"),
        ("p=f32,ops=float32", r"'float32' is not a function of torch"),
        ("p=f32,mods=layer-norm", r"'layer-norm' is not a class name"),
        ("p=f16,m=bf16", r"masters are either float32 or the parameters themselves"),
        ("p=bf16,c=bf16,o=tf32", r"output_dtype.*'tf32'"),
    ],
)
def test_bad_specs_name_the_problem(spec, message):
    with pytest.raises(ValueError, match=message) as err:
        mixprec.get_policy(spec)
    assert f"spec={spec!r}" in str(err.value)


@pytest.mark.parametrize(
    "spec", ["o2_bf16," + "x" * 90_000, "z" * 100_000, "p=bf16,fp8=" + "q" * 50_000, "c=bf16," * 10_000]
)
def test_a_huge_spec_is_echoed_cut_with_its_length(spec):
    with pytest.raises(ValueError) as err:
        mixprec.get_policy(spec)
    message = str(err.value)
    assert len(message) < 1000 and f"({len(spec)} characters)" in message


def test_bad_types():
    with pytest.raises(TypeError, match=r"received 3 \(of type int\)"):
        mixprec.get_policy(3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"fp32_ops=\('softmax',\)"):
        mixprec.Policy(fp32_ops="softmax")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="allow_tf32=True\\) needs compute_dtype=float32"):
        mixprec.Policy(compute_dtype=BF16, allow_tf32=True)
    with pytest.raises(ValueError, match="contains ','"):
        mixprec.Policy(fp32_names=("a,b",))


def test_policy_list_parsing():
    from mixprec.policy.parse import parse_policy_list

    specs = [spec for spec, _ in parse_policy_list("fp32,mixed_bf16,p=f32,c=bf16,p=bf16,ops=exp;o2_bf16")]
    assert specs == ["fp32", "mixed_bf16", "p=f32,c=bf16", "p=bf16,ops=exp", "o2_bf16"]
    with pytest.raises(ValueError, match="needs at least one policy"):
        parse_policy_list(" ")


@pytest.mark.parametrize(
    ("name", "preset"),
    [("O0", "fp32"), ("O1", "mixed_fp16"), ("o2", "o2_fp16"), ("bf16-mixed", "mixed_bf16"), ("16-mixed", "mixed_fp16"),
     ("32-true", "fp32"), ("mixed_bfloat16", "mixed_bf16")],
)  # fmt: skip
def test_names_users_bring_from_apex_lightning_and_keras_map_onto_the_presets(name, preset):
    assert mixprec.get_policy(name) == mixprec.get_policy(preset)


@pytest.mark.parametrize(
    ("name", "said"),
    [("O3", "Apex's O3 is pure fp16"), ("bf16-true", "use pure_bf16"), ("16-true", "use o2_fp16"),
     ("bf16-mixd", "Did you mean bf16_mixed")],
)  # fmt: skip
def test_names_that_map_onto_no_preset_say_what_to_use(name, said):
    with pytest.raises(ValueError, match=re.escape(said)):
        mixprec.get_policy(name)
