"""Named policies: the one-word switches users know from Keras, Apex and fastai, spelled out.

Every preset is an ordinary :class:`Policy`; ``str(get_policy("o2_bf16"))`` shows exactly what it means.
``auto`` depends on the device and carries the reason for its choice.
"""

from __future__ import annotations

import torch

from mixprec.compute.device import DeviceCaps, device_caps, device_type_of
from mixprec.compute.kernels import kernel_plan
from mixprec.policy.fp8_recipe import Fp8Recipe
from mixprec.policy.policy import NORM, Policy

__all__ = ["NO_PRESET", "PRESETS", "PRESET_ALIASES", "resolve_auto"]

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16

PRESETS: dict[str, Policy] = {
    "fp32": Policy(reason="FP32 everywhere: the reference"),
    "tf32": Policy(allow_tf32=True, reason="FP32 storage, matmuls in TF32 where the hardware has it"),
    "mixed_fp16": Policy(
        param_dtype=F32,
        compute_dtype=F16,
        output_dtype=F32,
        reason="FP32 weights, fp16 autocast compute, FP32 outputs for the loss; needs loss scaling",
    ),
    "mixed_bf16": Policy(
        param_dtype=F32,
        compute_dtype=BF16,
        output_dtype=F32,
        reason="FP32 weights, bf16 autocast compute, FP32 outputs for the loss",
    ),
    "o2_fp16": Policy(
        param_dtype=F16,
        compute_dtype=F16,
        output_dtype=F32,
        fp32_modules=(NORM,),
        reason="fp16 model with FP32 master weights, normalization layers in FP32; needs loss scaling",
    ),
    "o2_bf16": Policy(
        param_dtype=BF16,
        compute_dtype=BF16,
        output_dtype=F32,
        fp32_modules=(NORM,),
        reason="bf16 model with FP32 master weights, normalization layers in FP32",
    ),
    "pure_bf16": Policy(
        param_dtype=BF16,
        compute_dtype=BF16,
        output_dtype=F32,
        master_dtype=BF16,
        reason="everything bf16, no FP32 master copy (compensated updates); the leanest in memory",
    ),
    "fp8": Policy(
        param_dtype=F32,
        compute_dtype=BF16,
        output_dtype=F32,
        fp8=Fp8Recipe(),
        reason=(
            "every GEMM layer in FP8 but the language-model head (e4m3 inputs and weights, e5m2 gradients, current "
            "scaling), bf16 elsewhere"
        ),
    ),
    "fp8_hybrid": Policy(
        param_dtype=F32,
        compute_dtype=BF16,
        output_dtype=F32,
        fp8=Fp8Recipe(keep=("first", "last")),
        reason="GEMM layers in FP8 (e4m3/e5m2, current scaling) except the first and last, which stay bf16",
    ),
}

PRESET_ALIASES: dict[str, str] = {
    "float32": "fp32",
    "mixed_float16": "mixed_fp16",  # Keras' policy names
    "mixed_bfloat16": "mixed_bf16",
    # Apex's opt levels, where they map cleanly: O0 FP32, O1 mixed (fp16 autocast, FP32 weights), O2 a 16-bit
    # model with FP32 masters (Apex's are fp16)
    "o0": "fp32",
    "o1": "mixed_fp16",
    "o2": "o2_fp16",
    # Lightning's precision strings ('-' is read as '_')
    "32_true": "fp32",
    "16_mixed": "mixed_fp16",
    "bf16_mixed": "mixed_bf16",
}
# names users bring that map onto no preset, each with what to use instead
NO_PRESET: dict[str, str] = {
    "o3": "Apex's O3 is pure fp16 (no FP32 masters, no loss scaling); mixprec's pure 16-bit policy is pure_bf16 "
    "(bf16 weights with compensated updates), and o2_fp16 keeps FP32 masters",
    "16_true": "Lightning's '16-true' trains fp16 weights without FP32 masters, which loses small updates; use "
    "o2_fp16 (fp16 model, FP32 masters) or pure_bf16 (bf16 weights with compensated updates)",
    "bf16_true": "Lightning's 'bf16-true' trains bf16 weights with plain updates, which round small ones away; use "
    "pure_bf16 (the same memory, compensated updates) or o2_bf16 (FP32 masters)",
}


def resolve_auto(device: str | torch.device | None = None) -> Policy:
    """The best mixed policy for ``device``: bf16 where it is fast, else fp16, with the reason.

    On a CPU "fast" is measured (:mod:`mixprec.compute.kernels`): a 16-bit dtype is chosen when its
    matmuls, forward and backward, run at least 1.25x faster than FP32 on this machine; where neither
    does, ``auto`` stays FP32 and says why. On GPUs: bf16 where there are bf16 tensor cores, else fp16.
    """
    caps = device_caps(device_type_of(device))
    if caps.device_type == "cpu":
        base, note = _measured_cpu_choice(caps)
    elif caps.fast_bf16:
        base, note = PRESETS["mixed_bf16"], caps.bf16_note
    elif caps.supports_fp16:
        base, note = PRESETS["mixed_fp16"], caps.fp16_note
    else:
        base, note = PRESETS["fp32"], f"fp32: no fast 16-bit units ({caps.bf16_note}; {caps.fp16_note})"
    return Policy(
        param_dtype=base.param_dtype,
        compute_dtype=base.compute_dtype,
        output_dtype=base.output_dtype,
        reason=f"auto on {caps.description}: {note}",
    )


_AUTO_MIN_SPEEDUP = 1.25  # a 16-bit policy must buy at least this much matmul speed to be worth its numerics


def _measured_cpu_choice(caps: DeviceCaps) -> tuple[Policy, str]:
    measured = []
    for name, dtype, fast, note in (
        ("mixed_bf16", BF16, caps.fast_bf16, caps.bf16_note),
        ("mixed_fp16", F16, caps.fast_fp16, caps.fp16_note),
    ):
        speedup = kernel_plan(dtype).matmul_speedup()
        tag = name.removeprefix("mixed_")
        if speedup is None and fast:  # kernels fixed by MIXPREC_*_CPU: no figures, the flags decide
            return PRESETS[name], f"{note} (not measured: kernels set by the environment)"
        if speedup is not None and speedup >= _AUTO_MIN_SPEEDUP:
            return PRESETS[name], f"{tag} matmuls measured {speedup:.2f}x faster than FP32 here"
        if speedup is not None:
            measured.append(f"{tag} {speedup:.2f}x")
    shown = ", ".join(measured) or "no figures"
    return PRESETS["fp32"], f"fp32: no 16-bit matmul measured {_AUTO_MIN_SPEEDUP}x faster than FP32 ({shown})"
