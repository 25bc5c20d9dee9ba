"""FSDP2 (``torch.distributed.fsdp.fully_shard``) under a precision policy.

:func:`fully_shard` shards a model so that FSDP2 itself carries out the parts of the policy it is
built for, and MixedPrecision the rest:

    mixed_* (FP32 weights, 16-bit compute)   shards hold FP32; all-gathers in FP32; compute under the
                                             policy's autocast; gradients reduced in FP32
    o2_* (16-bit weights, FP32 masters)      shards hold FP32 and *are* the master weights; FSDP2
                                             all-gathers them in the 16-bit dtype (MixedPrecisionPolicy
                                             ``param_dtype``), so no separate master copy exists;
                                             gradients reduced in that dtype, or FP32 on request
    pure_bf16 (bf16 weights, no masters)     shards hold bf16, stepped by mixprec.AdamW's compensated
                                             updates; gradients reduced in bf16, or FP32 on request
    fp32_modules / fp32_names                each kept module is its own FSDP2 unit with FP32 weights
                                             (a unit all-gathers one dtype), so norms stay FP32

Units: the kept modules, then each entry of every ``nn.ModuleList`` (the usual transformer blocks)
or the modules ``units`` names, then the root. Build the optimizer after sharding, on
``model.parameters()`` (the sharded parameters), then ``MixedPrecision(model, optimizer, policy)``.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
from torch import nn

from mixprec.master.compensated import remember_rounding_residual, rounding_residual
from mixprec.policy.parse import get_policy
from mixprec.policy.policy import Policy
from mixprec.regions.casting import cast_module, check_fp32_entries, fp32_modules, lowered_parameters

if TYPE_CHECKING:  # torch.distributed.fsdp is imported where used: it imports torch._dynamo (1.4 s)
    from torch.distributed.fsdp import MixedPrecisionPolicy

__all__ = ["fsdp_policy", "fully_shard", "is_sharded", "sharded_with"]

_MARK = "_mixprec_fsdp_policy"


def fsdp_policy(policy: Policy, reduce_dtype: torch.dtype | None = None) -> MixedPrecisionPolicy:
    """FSDP2's MixedPrecisionPolicy for the units that follow ``policy``'s parameter dtype.

    ``param_dtype`` is the dtype weights are all-gathered in for compute (the policy's parameter dtype
    when FP32 masters back it; otherwise the shards' own dtype); ``reduce_dtype`` the dtype gradients
    are reduced in (default: the gradients' own dtype). Outputs are left to the policy's autocast.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy

    gather = policy.param_dtype if policy.keeps_fp32_masters else None
    return MixedPrecisionPolicy(param_dtype=gather, reduce_dtype=reduce_dtype, cast_forward_inputs=False)


def fully_shard(
    model: nn.Module,
    policy: Policy | str = "auto",
    *,
    reduce_dtype: torch.dtype | None = None,
    units: Iterable[str] | None = None,
    mesh=None,
) -> nn.Module:
    """Shard ``model`` with FSDP2 so that it trains under ``policy`` (see the module docstring).

    Args:
        model: the model on its training device, FP32, inside an initialized process group.
        policy: the policy MixedPrecision will use; the same one must be passed there.
        reduce_dtype: reduce gradients in this dtype (``torch.float32`` for FP32 reductions of 16-bit
            gradients); default, the gradients' dtype.
        units: dotted-name globs of the modules to shard as units (default: every ModuleList entry).
        mesh: a DeviceMesh (default: all ranks, as FSDP2 chooses).

    Returns the model (sharded in place).
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    if not isinstance(model, nn.Module):
        raise TypeError(f"fully_shard(model=...) needs an nn.Module; received {type(model).__name__}.")
    if isinstance(units, str):
        raise TypeError(f"fully_shard(units=...) takes a list of name globs; received the string {units!r}.")
    if is_sharded(model):
        raise ValueError("fully_shard(model=...): the model is already sharded; shard it once.")
    if reduce_dtype is not None and reduce_dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"fully_shard(reduce_dtype=...): received {reduce_dtype!r}; use torch.float32 or None.")
    first = next(model.parameters(), None)
    if first is None:
        raise ValueError("fully_shard(model=...): the model has no parameters to shard.")
    policy = get_policy(policy, device=first.device, argument="fully_shard(policy=...)")
    check_fp32_entries(model, policy)  # before anything is cast or sharded
    if mesh is None and not torch.distributed.is_initialized():  # the arguments first; torch's error: env://
        raise ValueError(
            "fully_shard: no process group and no mesh=. Launch with torchrun and call "
            "torch.distributed.init_process_group() first (docs/training.md, 'Several processes'), or pass a "
            "DeviceMesh as mesh=."
        )
    residuals = {}
    if policy.is_pure:
        residuals = _rounding_residuals(model, policy)  # for mixprec.AdamW's compensation (MixedPrecision)
        cast_module(model, policy)  # pure_bf16: the shards themselves are 16-bit
    options = {"mesh": mesh} if mesh is not None else {}
    kept = [module for _, module in fp32_modules(model, policy)]
    fp32_unit = MixedPrecisionPolicy(reduce_dtype=torch.float32, cast_forward_inputs=False)
    for module in kept:
        if any(True for _ in module.parameters()):
            torch_fully_shard(module, mp_policy=fp32_unit, **options)
    main = fsdp_policy(policy, reduce_dtype)
    for module in _units(model, units):
        torch_fully_shard(module, mp_policy=main, **options)
    torch_fully_shard(model, mp_policy=main, **options)
    setattr(model, _MARK, str(policy))
    for (module, name), residual in residuals.items():
        _remember_shard(module, name, residual)
    return model


def _rounding_residuals(model: nn.Module, policy: Policy) -> dict[tuple[nn.Module, str], torch.Tensor]:
    """What casting each FP32 parameter to the policy's dtype loses, whole, by (module, name): FSDP2 puts new
    parameter objects in place."""
    lowered = {id(p) for p in lowered_parameters(model, policy)}
    dtype = policy.param_dtype
    return {
        (module, name): rounding_residual(p, dtype)
        for module in model.modules()
        for name, p in module.named_parameters(recurse=False)
        if id(p) in lowered and p.dtype == torch.float32 and p.requires_grad
    }


def _remember_shard(module: nn.Module, name: str, residual: torch.Tensor) -> None:
    """This rank's part of ``residual``, laid out as FSDP2's dim-0 shard of the parameter; nothing where the
    layout is another (the compensation then starts at 0)."""
    from torch.distributed.tensor import DTensor

    param = getattr(module, name)
    if not isinstance(param, DTensor) or len(param.placements) != 1 or not param.placements[0].is_shard(0):
        return
    mesh, local = param.device_mesh, param.to_local()
    chunks = torch.chunk(residual, mesh.size(), dim=0)
    rank = mesh.get_local_rank()
    piece = chunks[rank] if rank < len(chunks) else residual.new_empty((0, *residual.shape[1:]))
    if piece.shape == local.shape:  # a copy: the chunk, a view, would hold the whole residual at an offset
        shard = DTensor.from_local(
            piece.to(local.device).clone(), mesh, param.placements, run_check=False,
            shape=param.shape, stride=param.stride(),
        )  # fmt: skip
        remember_rounding_residual(module, name, shard)


def _units(model: nn.Module, globs: Iterable[str] | None) -> list[nn.Module]:
    if globs is not None:
        globs = list(globs)
        chosen = [m for name, m in model.named_modules() if name and any(fnmatch.fnmatchcase(name, g) for g in globs)]
        if globs and not chosen:
            raise ValueError(f"fully_shard(units={globs!r}): no submodule matches; see model.named_modules().")
        return chosen
    return [entry for module in model.modules() if isinstance(module, nn.ModuleList) for entry in module]


def is_sharded(model: nn.Module) -> bool:
    """Whether ``model`` holds FSDP2-sharded (DTensor) parameters."""
    return any(type(p).__name__ == "DTensor" for p in model.parameters())


def sharded_with(model: nn.Module) -> str | None:
    """The policy string :func:`fully_shard` sharded ``model`` for, or None if it did not.

    ``model`` itself or the submodules that hold its sharded parameters may have been sharded (a
    LightningModule whose ``configure_model`` shards ``self.model``). Sharded parameters outside every
    :func:`fully_shard` call, or calls with different policies, give None: the model as a whole was
    not sharded for one policy.
    """
    marks = {name: mark for name, module in model.named_modules() if (mark := getattr(module, _MARK, None))}
    if not marks or len(set(marks.values())) > 1:
        return None
    for name, parameter in model.named_parameters():
        if type(parameter).__name__ == "DTensor" and not any(_inside(name, root) for root in marks):
            return None
    return next(iter(marks.values()))


def _inside(parameter: str, module: str) -> bool:
    return not module or parameter.startswith(module + ".")
