"""The policy a trained model is exported under: 16-bit parameters and compute, FP32 outputs, and in FP32 what
training kept there (normalization layers at least)."""

from __future__ import annotations

import torch

from mixprec.policy.policy import NORM, Policy

__all__ = ["EXPORT_DTYPES", "export_policy"]

EXPORT_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def export_policy(policy: Policy, dtype: str) -> Policy:
    """The policy of a ``dtype`` export of a run trained under ``policy``: parameters and compute in
    ``dtype``, outputs in FP32, and in FP32 the modules, names and ops that ``policy`` keeps there.

    A policy with FP32 parameters (fp32, tf32, mixed_*, fp8) keeps no modules because all of them are
    FP32 already; its export keeps the normalization layers, as the o2 presets do. The modules an fp16 policy
    computed in bf16 (``bf16_names``: fp16's range was too small for them) stay FP32 in an fp16 export."""
    if dtype not in EXPORT_DTYPES:
        raise ValueError(f"export dtype: received {dtype!r}; use one of {', '.join(EXPORT_DTYPES)}.")
    kept_modules = policy.fp32_modules if policy.param_dtype != torch.float32 else (NORM,)
    return Policy(
        param_dtype=EXPORT_DTYPES[dtype],
        compute_dtype=EXPORT_DTYPES[dtype],
        output_dtype=torch.float32,
        fp32_modules=kept_modules,
        fp32_names=policy.fp32_names + (policy.bf16_names if dtype == "fp16" else ()),
        fp32_ops=policy.fp32_ops,
        reason=f"{dtype} export, with the trained policy's FP32 modules kept",
    )
