"""The precision policy: an immutable value saying which dtype each part of training uses.

A policy names four dtypes and three exception lists:

    params   dtype the model's parameters are stored in
    compute  dtype of matmuls and convolutions inside the autocast region (``tf32``: FP32 storage,
             TF32 matmuls where the hardware has them)
    output   dtype the model's outputs are cast to, so that losses are computed in it
    master   dtype the optimizer updates; FP32 masters are kept when it is wider than ``params``
    fp32_modules  module classes kept and computed in FP32 (``norm`` = every normalization layer)
    fp32_names    module name globs kept and computed in FP32 (``*.lm_head``)
    fp32_ops      torch ops computed in FP32 inside the low-precision region (``softmax``, ``exp``)
    fp8           an FP8 recipe (:class:`mixprec.regions.fp8.Fp8Recipe`): Linear layers compute in FP8
    kernels       ``auto`` (measured per machine, see :mod:`mixprec.compute.kernels`), ``native``
                  (PyTorch's 16-bit kernels) or ``emulated`` (FP32 arithmetic, 16-bit rounding)

``str(policy)`` is the policy in the grammar of :func:`mixprec.get_policy`, and parses back to an
equal policy.

Example:
    >>> p = Policy(param_dtype=torch.float32, compute_dtype=torch.bfloat16)
    >>> str(p.replace(fp32_ops=("softmax",)))
    'params=float32,compute=bfloat16,output=float32,fp32_ops=softmax'
"""

from __future__ import annotations

import dataclasses
import keyword
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from mixprec.checks import flag
from mixprec.compute.kernels import KERNEL_SETTINGS
from mixprec.numerics.formats import get_format
from mixprec.policy.fp8_recipe import Fp8Recipe

__all__ = ["DTYPE_NAMES", "NORM", "Policy"]

# The dtypes a policy may name, with their canonical spelling in policy strings.
DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float32: "float32",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
}
NORM = "norm"  # alias in fp32_modules for every normalization layer
_FORBIDDEN_IN_NAMES = ",+= "  # separators of the policy grammar


@dataclass(frozen=True)
class Policy:
    """Which dtype the parameters, the compute and the outputs use, and what stays FP32.

    Dtypes may be given as ``torch.dtype`` or any name :func:`mixprec.get_format` knows
    (``"bf16"``, ``"half"``); they are stored as ``torch.dtype``. ``reason`` explains an automatic
    choice and takes no part in equality. ``bf16_names``: in an fp16 policy with FP32 weights, modules (dotted-name
    globs) whose forward, submodules included, computes in bf16 instead: fp16's precision for the model, bf16's
    range where values pass fp16's 65504 (modules kept in FP32 stay FP32, inside them or around them).

    Raises:
        ValueError / TypeError: a dtype that a policy cannot use, a malformed name or glob, an op
            that torch does not have.
    """

    param_dtype: torch.dtype = torch.float32
    compute_dtype: torch.dtype = torch.float32
    output_dtype: torch.dtype = torch.float32
    master_dtype: torch.dtype = torch.float32
    allow_tf32: bool = False
    fp32_modules: tuple[str, ...] = ()
    fp32_names: tuple[str, ...] = ()
    bf16_names: tuple[str, ...] = ()
    fp32_ops: tuple[str, ...] = ()
    fp8: Fp8Recipe | None = None
    kernels: str = "auto"
    reason: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        for name in ("param_dtype", "compute_dtype", "output_dtype", "master_dtype"):
            object.__setattr__(self, name, _as_policy_dtype(getattr(self, name), name))
        flag(self.allow_tf32, "Policy(allow_tf32=...)")
        if self.allow_tf32 and self.compute_dtype != torch.float32:
            raise ValueError(
                f"Policy(allow_tf32=True) needs compute_dtype=float32; received "
                f"compute_dtype={DTYPE_NAMES[self.compute_dtype]}. TF32 only applies to FP32 matmuls."
            )
        if self.master_dtype not in (torch.float32, self.param_dtype):
            raise ValueError(
                f"Policy(master_dtype=...): received {DTYPE_NAMES[self.master_dtype]} with "
                f"param_dtype={DTYPE_NAMES[self.param_dtype]}; masters are either float32 or the "
                "parameters themselves (master_dtype == param_dtype)."
            )
        object.__setattr__(self, "fp32_modules", _check_list(self.fp32_modules, "fp32_modules", _check_class))
        object.__setattr__(self, "fp32_names", _check_list(self.fp32_names, "fp32_names", _check_glob))
        object.__setattr__(self, "bf16_names", _check_list(self.bf16_names, "bf16_names", _check_glob))
        object.__setattr__(self, "fp32_ops", _check_list(self.fp32_ops, "fp32_ops", _check_op))
        if self.bf16_names:
            _check_bf16_names(self)
        if self.kernels not in KERNEL_SETTINGS:
            raise ValueError(
                f"Policy(kernels=...): received {self.kernels!r}; use one of {', '.join(KERNEL_SETTINGS)} "
                "(auto: chosen by timing on this machine)."
            )
        if self.fp8 is not None and not isinstance(self.fp8, Fp8Recipe):
            raise TypeError(f"Policy(fp8=...) takes a mixprec.Fp8Recipe or None; received {self.fp8!r}.")

    # -- derived facts -----------------------------------------------------------------------
    @property
    def is_mixed(self) -> bool:
        """True when anything computes or is stored below FP32."""
        return self.compute_dtype != torch.float32 or self.param_dtype != torch.float32

    @property
    def keeps_fp32_masters(self) -> bool:
        """True when the optimizer updates FP32 copies of low-precision parameters."""
        return self.master_dtype == torch.float32 and self.param_dtype != torch.float32

    @property
    def is_pure(self) -> bool:
        """True when low-precision parameters have no FP32 copy (``pure_bf16``): updates land on them."""
        return self.master_dtype == self.param_dtype != torch.float32

    # -- a new policy from this one ----------------------------------------------------------
    def replace(self, **changes: object) -> Policy:
        """This policy with ``changes`` (field names, e.g. ``fp32_ops=("softmax",)``), validated as in the
        constructor; the reason is cleared, and a new compute dtype turns TF32 off unless it is also given."""
        fields = [f.name for f in dataclasses.fields(self)]
        unknown = [name for name in changes if name not in fields]
        if unknown:
            raise TypeError(
                f"Policy.replace: received {', '.join(map(repr, unknown))}, not a Policy field; use "
                f"{', '.join(fields)} (the policy string's short keys, such as compute=, go in a string: "
                "get_policy('base=mixed_bf16,compute=fp16'))."
            )
        if "compute_dtype" in changes:
            changes.setdefault("allow_tf32", False)
        return dataclasses.replace(self, **{"reason": "", **changes})

    # -- the grammar ---------------------------------------------------------------------------
    def __str__(self) -> str:
        compute = "tf32" if self.allow_tf32 else DTYPE_NAMES[self.compute_dtype]
        parts = [
            f"params={DTYPE_NAMES[self.param_dtype]}",
            f"compute={compute}",
            f"output={DTYPE_NAMES[self.output_dtype]}",
        ]
        if self.master_dtype != torch.float32:
            parts.append(f"master={DTYPE_NAMES[self.master_dtype]}")
        for key in ("fp32_modules", "fp32_names", "bf16_names", "fp32_ops"):
            values = getattr(self, key)
            if values:
                parts.append(f"{key}={'+'.join(values)}")
        if self.kernels != "auto":
            parts.append(f"kernels={self.kernels}")
        if self.fp8 is not None:
            parts.append(f"fp8={self.fp8}")
        return ",".join(parts)


def _as_policy_dtype(value: object, argument: str) -> torch.dtype:
    fmt = get_format(value, argument=argument)  # type: ignore[arg-type]
    if fmt.torch_dtype in DTYPE_NAMES:
        return fmt.torch_dtype
    raise ValueError(
        f"Policy({argument}=...): received {value!r}, which has no PyTorch compute support as a policy "
        f"dtype; use one of {', '.join(DTYPE_NAMES.values())} (fp8 training has its own policies)."
    )


def _check_list(values: object, argument: str, check) -> tuple[str, ...]:
    if isinstance(values, str) or not isinstance(values, (tuple, list)):
        raise TypeError(
            f"Policy({argument}=...) takes a tuple of strings; received {values!r} "
            f"(of type {type(values).__name__}). Write e.g. {argument}=({values!r},)."
        )
    unique: list[str] = []
    for value in values:
        if not isinstance(value, str) or not value.strip():
            raise TypeError(f"Policy({argument}=...): every entry must be a non-empty string; received {value!r}.")
        value = value.strip()
        check(value, argument)
        if value not in unique:
            unique.append(value)
    return tuple(unique)


def _check_bf16_names(policy: Policy) -> None:
    """bf16 modules exist in an fp16 policy with FP32 weights: fp16's precision for the model, bf16's range for
    the modules whose values pass fp16's 65504 (a bf16 policy computes every module in bf16 already)."""
    if policy.compute_dtype != torch.float16:
        raise ValueError(
            f"Policy(bf16_names=...) computes the named modules in bf16 inside an fp16 policy; received "
            f"compute={DTYPE_NAMES[policy.compute_dtype]}. Use it with compute=float16 (base=mixed_fp16); "
            "to keep modules in FP32, use fp32_names."
        )
    if policy.param_dtype != torch.float32:
        raise ValueError(
            f"Policy(bf16_names=...) needs FP32 parameters (base=mixed_fp16); received "
            f"params={DTYPE_NAMES[policy.param_dtype]}: fp16 weights would keep fp16's range in the named modules. "
            "Use fp32_names to keep their weights and compute in FP32."
        )


def _check_class(value: str, argument: str) -> None:
    if value != NORM and (not value.isidentifier() or keyword.iskeyword(value)):
        raise ValueError(
            f"Policy({argument}=...): {value!r} is not a class name; use a module class name such as "
            f"'LayerNorm' or 'Embedding', or '{NORM}' for every normalization layer. "
            "To keep modules by their dotted name, use fp32_names."
        )


def _check_glob(value: str, argument: str) -> None:
    bad = [c for c in _FORBIDDEN_IN_NAMES if c in value]
    if bad:
        raise ValueError(
            f"Policy({argument}=...): the glob {value!r} contains {''.join(bad)!r}, which separate parts "
            "of a policy string; module names never contain them."
        )


def _check_op(value: str, argument: str) -> None:
    # a function, not any attribute: 'nn', 'Tensor', 'float32' or 'cuda' matched no op, silently
    found = [getattr(namespace, value, None) for namespace in (torch, torch.Tensor, F)]
    if not any(callable(attr) and not isinstance(attr, type) for attr in found):
        raise ValueError(
            f"Policy({argument}=...): {value!r} is not a function of torch, torch.Tensor or "
            "torch.nn.functional; use the op's name as PyTorch spells it, e.g. 'softmax', 'exp', 'matmul'."
        )
