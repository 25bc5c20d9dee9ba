"""What MixprecTrainer refuses, with the fix: TrainingArguments and set-ups (another mixed-precision system,
DeepSpeed, FSDP, reentrant activation checkpointing, optimizers that update inside backward, several devices
per process) under which it could not guarantee skip-on-overflow, unscaled clipping, an unmoved schedule and
a backward that matches the forward."""

from __future__ import annotations

import dataclasses
from typing import Any

import transformers
from accelerate.utils import DistributedType

from mixprec.parallel import is_sharded

__all__ = [
    "CHECKPOINTING_ARGUMENT",
    "DDP_TYPES",
    "argument_problem",
    "optim_name",
    "setup_problem",
]

DDP_TYPES = (DistributedType.MULTI_CPU, DistributedType.MULTI_GPU)  # one device per process, Accelerate's DDP
# transformers renamed gradient checkpointing to activation checkpointing (after 5.17): the messages use the
# installed version's names
CHECKPOINTING_ARGUMENT = next(
    (f.name for f in dataclasses.fields(transformers.TrainingArguments) if f.name == "activation_checkpointing"),
    "gradient_checkpointing",
)


def optim_name(args: transformers.TrainingArguments) -> str:
    return str(getattr(args.optim, "value", args.optim))


def argument_problem(args: transformers.TrainingArguments, policy: Any) -> str | None:
    """What in TrainingArguments would fight mixprec or that the adapter cannot guarantee; None if nothing."""
    if not isinstance(args, transformers.TrainingArguments):
        return (
            f"args=... needs a transformers.TrainingArguments (the Trainer's second argument); received "
            f"{type(args).__name__}."
        )
    halves = [f"{name}=True" for name in ("fp16", "bf16", "fp16_full_eval", "bf16_full_eval") if getattr(args, name)]
    if halves:
        return (
            f"received TrainingArguments({', '.join(halves)}) together with policy={str(policy)!r}; two "
            "mixed-precision systems would fight (Accelerate's autocast and GradScaler, mixprec's region and loss "
            "scaler). The policy is the precision: set fp16=False and bf16=False (and their *_full_eval), and pass "
            "the policy that stands for them: fp16=True is policy='mixed_fp16', bf16=True policy='mixed_bf16' "
            "(FP32 weights, 16-bit compute; 'o2_bf16', the default, also stores the weights in bf16). Not "
            "policy='bf16': a lone dtype means it everywhere, weights, compute and outputs, with FP32 masters."
        )
    if getattr(args, "mixed_precision", "no") != "no":
        return (
            f"Accelerate's mixed precision is on (mixed_precision={args.mixed_precision!r}, from the launcher or "
            "ACCELERATE_MIXED_PRECISION); two mixed-precision systems would fight. Launch with --mixed_precision no."
        )
    optim = optim_name(args)
    checks = [
        (args.deepspeed, "a DeepSpeed config (args.deepspeed)"),
        (args.fsdp, f"FSDP (fsdp={args.fsdp!r})"),
        (getattr(args, "parallelism_config", None), "a parallelism_config"),
    ]
    for value, what in checks:
        if value:
            return (
                f"received {what}; MixprecTrainer runs on one device or under DDP (DeepSpeed and FSDP keep their own "
                "precision and optimizer step). Train with DDP, or use mixprec.fully_shard / mixprec.parallel "
                "with mixprec.MixedPrecision in a loop of your own (docs/training-step.md)."
            )
    checkpointing_kwargs = getattr(args, f"{CHECKPOINTING_ARGUMENT}_kwargs", None) or {}
    unsupported = {
        f"{CHECKPOINTING_ARGUMENT}_kwargs={checkpointing_kwargs!r}": bool(checkpointing_kwargs.get("use_reentrant")),
        "auto_find_batch_size=True": args.auto_find_batch_size,
        f"optim={optim!r}": optim in ("lomo", "adalomo") or optim.endswith("layerwise"),
    }
    why = {
        f"{CHECKPOINTING_ARGUMENT}_kwargs={checkpointing_kwargs!r}": "the reentrant checkpoint recomputes the "
        "forward outside the policy's region (its casts and FP32 ops), so backward would differ from forward; "
        "leave use_reentrant out (transformers' default is False), where mixprec re-enters the region",
        "auto_find_batch_size=True": "a retry after running out of memory would restart a half-trained mixed-"
        "precision run; set per_device_train_batch_size yourself",
        f"optim={optim!r}": "this optimizer updates inside the backward pass, before gradients can be unscaled "
        "and checked; choose another optim (e.g. 'adamw_torch')",
    }
    for name, present in unsupported.items():
        if present:
            return f"received TrainingArguments({name}), which MixprecTrainer does not support: {why[name]}."
    return None


def setup_problem(trainer: transformers.Trainer) -> str | None:
    """What the Trainer set up that the adapter cannot guarantee (launcher environment, devices)."""
    accelerator = trainer.accelerator
    if accelerator.mixed_precision != "no":
        return (
            f"Accelerate runs its own mixed precision ({accelerator.mixed_precision!r}, from the launcher or "
            "ACCELERATE_MIXED_PRECISION); two mixed-precision systems would fight. Launch with --mixed_precision no."
        )
    if trainer.is_deepspeed_enabled or trainer.is_fsdp_enabled:
        return "Accelerate enabled DeepSpeed or FSDP; MixprecTrainer runs on one device or under DDP."
    if is_sharded(trainer.model):
        return (
            "the model holds FSDP2-sharded parameters (DTensors), which the Trainer would wrap in DDP; "
            "MixprecTrainer runs on one device or under DDP. For FSDP2, shard with mixprec.fully_shard and train "
            "with mixprec.MixedPrecision in a loop of your own (Accelerate can launch it: docs/integrations.md)."
        )
    if trainer.args.n_gpu > 1 or trainer.is_model_parallel:
        return (
            f"the model is spread over {trainer.args.n_gpu} devices of one process (DataParallel, or a model split "
            "across devices); MixprecTrainer runs one device per process. Launch one process per device "
            "(torchrun --nproc_per_node N or accelerate launch): the Trainer then uses DistributedDataParallel."
        )
    if trainer.args.world_size > 1 and accelerator.distributed_type not in DDP_TYPES:
        return (
            f"the run spans {trainer.args.world_size} processes as {accelerator.distributed_type.value}; "
            "MixprecTrainer runs on one device or under DDP (MULTI_CPU, MULTI_GPU)."
        )
    return None
