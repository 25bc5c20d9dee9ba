"""How a policy's compute dtype runs on a device: the compute plan, and whether the device can run it at all.

On CPUs a per-machine timing probe (:mod:`mixprec.compute.kernels`) chooses, for each op family, PyTorch's
16-bit kernels or mixprec's exact emulation; on GPUs the kernels are native unless the policy says
``kernels=emulated``. Every choice carries its reason and the probe's figures.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from mixprec.compute.device import device_caps
from mixprec.compute.kernels import KernelPlan, kernel_plan
from mixprec.policy.policy import DTYPE_NAMES, Policy
from mixprec.regions.fp8.gemm import (
    recipe_kernel_missing,
    recipe_uses_kernel,
    scaled_mm_unavailable_reason,
    uses_kernel,
    wants_kernel,
)
from mixprec.regions.fp8.gemm_layers import GemmSelection

__all__ = [
    "ComputePlan",
    "bf16_plan",
    "check_device_supports",
    "compute_plan",
    "tf32_matmuls",
    "uses_gemm_attention",
    "warn_without_fp8_layers",
    "with_gemm_layers",
]

logger = logging.getLogger("mixprec")


@dataclass(frozen=True)
class ComputePlan:
    """How a policy's compute dtype runs on a device.

    ``mode``: "fp32", "native" (torch.autocast), "emulated" (FP32 arithmetic with 16-bit rounding) or
    "hybrid" (torch.autocast, with the op families in ``kernels`` that measured slower natively emulated).
    ``kernels``: on CPUs, the kernel chosen for each op family and the timings behind the choice.
    """

    mode: str
    dtype: torch.dtype
    reason: str
    kernels: KernelPlan | None = None

    @property
    def emulates(self) -> bool:
        """Whether some 16-bit ops run emulated: FP32 arithmetic with 16-bit roundings."""
        return self.mode in ("emulated", "hybrid")

    def kernel(self, family: str) -> str:
        """The kernel of one op family ("native", "emulated", "gemm"); without a kernel plan, the mode's."""
        if self.kernels is not None:
            return self.kernels.kernel(family)
        return "emulated" if self.mode == "emulated" else "native"


def compute_plan(policy: Policy, device_type: str) -> ComputePlan:
    """16-bit compute on CPUs as the per-machine timing probe chose it (:mod:`mixprec.compute.kernels`), each
    op family native or emulated; native on GPUs unless the policy says ``kernels=emulated``.
    FP8 GEMM layers run on PyTorch's FP8 GEMM where the recipe picks it, else emulated exactly."""
    plan = _compute_plan(policy, device_type)
    bf16 = bf16_plan(policy, device_type)
    if bf16 is not None:
        note = f"the modules of bf16_names ({'+'.join(policy.bf16_names)}) in bf16: {bf16.reason}"
        plan = dataclasses.replace(plan, reason=f"{plan.reason}; {note}")
    if policy.fp8 is None:
        return plan
    recipe = policy.fp8
    device = torch.device(device_type)
    kernel = recipe_uses_kernel(recipe, device)
    how = "on PyTorch's FP8 GEMM (torch._scaled_mm)" if kernel else "emulated with FP32 arithmetic"
    missing = recipe_kernel_missing(recipe, device) if uses_kernel(recipe.gemm, device) else None
    if wants_kernel(recipe.gemm, device) and not kernel:  # asked for here but absent: say why
        how += f" ({missing or scaled_mm_unavailable_reason(device)})"
    elif kernel and missing:  # on the kernel, some of the products emulated (blockwise's weight gradient)
        how += f" ({missing})"
    kept = f", kept out: {'+'.join(recipe.keep)}" if recipe.keep else ""
    if kernel and device.type == "cuda":  # the CPU's kernel sums in FP32 whatever it is asked
        fast = ", ".join(_PRODUCTS[p] for p in recipe.fast_products)
        kept += f", fast accumulation in the {fast}" if fast else ""
    if recipe.precision == "FP4":
        note = f"GEMM layers in FP4 {how} (fp4_e2m1 inputs, weights and gradients, {recipe.scaling} scaling{kept})"
    else:
        note = (
            f"GEMM layers in FP8 {how} ({recipe.forward} inputs and weights, {recipe.backward} "
            f"gradients, {recipe.scaling} scaling{kept})"
        )
    return dataclasses.replace(plan, reason=f"{plan.reason}; {note}")


def bf16_plan(policy: Policy, device_type: str) -> ComputePlan | None:
    """How the modules of an fp16 policy's ``bf16_names`` compute here (None without them): bf16's own plan."""
    if not policy.bf16_names:
        return None
    return _compute_plan(policy.replace(compute_dtype=torch.bfloat16, bf16_names=(), fp8=None), device_type)


def with_gemm_layers(plan: ComputePlan, selection: GemmSelection) -> ComputePlan:
    """``plan`` with a model's FP8 layers in its reason: how many GEMM layers run FP8, each kept one and why."""
    return dataclasses.replace(plan, reason=f"{plan.reason}; {selection.describe()}")


def warn_without_fp8_layers(selection: GemmSelection) -> None:
    """A warning when an FP8 policy selects none of the model's layers (a model it cannot reach, a recipe that
    keeps everything)."""
    if not selection.fp8:
        logger.warning("mixprec: the FP8 policy computes none of this model's layers in FP8: %s", selection.describe())


_PRODUCTS = {"output": "forward product", "input_grad": "input gradient", "weight_grad": "weight gradient"}
_EMULATION_NOTE = "GEMM inputs and outputs rounded to the 16-bit format, FP32 accumulation, as on tensor cores"


def _compute_plan(policy: Policy, device_type: str) -> ComputePlan:
    caps = device_caps(device_type)
    dtype = policy.compute_dtype
    if dtype == torch.float32:
        return ComputePlan("fp32", torch.float32, caps.tf32_note if policy.allow_tf32 else "FP32 compute")
    name = DTYPE_NAMES[dtype]
    if device_type == "cpu":
        kernels = kernel_plan(dtype, kernels=policy.kernels)
        mode = kernels.mode
        why = {"native": "torch.autocast", "emulated": f"{name} emulated in FP32: {_EMULATION_NOTE}"}.get(
            mode, f"torch.autocast, the families marked emulated in FP32 ({_EMULATION_NOTE})"
        )
        return ComputePlan(mode, dtype, f"{why}; {kernels.describe()}", kernels)
    if policy.kernels == "emulated":
        return ComputePlan("emulated", dtype, f"{name} emulated in FP32 (policy kernels=emulated): {_EMULATION_NOTE}")
    note = caps.fp16_note if dtype == torch.float16 else caps.bf16_note
    return ComputePlan("native", dtype, f"{note}; torch.autocast")


def check_device_supports(policy: Policy, device_type: str) -> None:
    """Raise ValueError when ``device_type`` cannot compute in the policy's compute dtype."""
    caps = device_caps(device_type)
    dtype = policy.compute_dtype
    supported = {
        torch.float32: True,
        torch.float16: caps.supports_fp16,
        torch.bfloat16: caps.supports_bf16,
    }[dtype]
    if supported and policy.bf16_names and not caps.supports_bf16:
        raise ValueError(
            f"policy {policy} computes the modules of bf16_names in bf16, which {caps.description} cannot run "
            f"({caps.bf16_note}); keep them in FP32 instead (fp32_names)."
        )
    if not supported:
        note = caps.bf16_note if dtype == torch.bfloat16 else caps.fp16_note
        raise ValueError(
            f"policy compute={DTYPE_NAMES[dtype]} cannot run on {caps.description} ({note}); "
            "use policy 'auto', or 'mixed_fp16' / 'mixed_bf16' as the device allows."
        )


def uses_gemm_attention(policy: Policy, plan: ComputePlan) -> bool:
    """bf16 attention from GEMMs (mixprec.compute.attention) where the probe chose it, unless kept in FP32."""
    return plan.kernel("attention") == "gemm" and "scaled_dot_product_attention" not in policy.fp32_ops


@contextlib.contextmanager
def tf32_matmuls(device_type: str) -> Iterator[None]:
    """Let FP32 matmuls use TF32 units where ``device_type`` has them; a no-op elsewhere."""
    if not device_caps(device_type).tf32:
        yield
        return
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(previous)
