"""TrainConfig: one typed, frozen description of a training run, shared by the CLI and the run folder.

The CLI parses its flags into it, every run writes it to ``config.json``, ``--resume`` and ``export``
read it back. Reading checks every key: unknown keys and wrong types are errors, and nothing is
evaluated.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mixprec.app.stop_signals import check_stop_signals
from mixprec.checks import loss_scale, unique_keys

# A run's seed is below 2^32: its epochs' data-order seeds (seed * 1_000_003 + epoch) then fit torch's 64 bits, and
# NumPy's legacy seed takes it as it is.
SEED_LIMIT = 2**32

__all__ = ["CONFIG_FILE", "SEED_LIMIT", "TrainConfig"]

CONFIG_FILE = "config.json"
SIZES = ("default", "tiny")
PARALLEL_MODES = ("ddp", "fsdp")


def check_device(spec: str, where: str) -> None:
    """ValueError unless ``spec`` names a device mixprec trains on: auto, cpu, cuda or cuda:N."""
    if not isinstance(spec, str) or not re.fullmatch(r"auto|cpu|cuda(:\d+)?", spec):
        raise ValueError(
            f"{where}: received {spec!r}; use auto, cpu, cuda or cuda:N (mixprec trains on CPUs and CUDA GPUs)."
        )


def decided_by_the_machine(policy: str) -> bool:
    """Whether a policy spec holds ``auto``, which the machine and its kernel probe decide when the run starts: the
    run's config.json keeps the policy as decided, and a resume goes on with it, not with what ``auto`` would pick
    there and then."""
    return re.search(r"\bauto\b", policy) is not None


@dataclass(frozen=True)
class TrainConfig:
    """Everything that defines a training run (None: the task's default)."""

    task: str
    policy: str = "auto"
    epochs: int | None = None
    steps: int | None = None
    batch_size: int | None = None
    lr: float | None = None
    weight_decay: float | None = None
    max_grad_norm: float | None = None
    frozen_epochs: int | None = None  # fine-tuning: epochs with the pretrained body frozen (tasks that have one)
    seed: int = 0
    size: str = "default"
    accumulation_steps: int = 1
    eval_every: int | None = None
    log_every: int = 10
    checkpoint_every: int | None = None
    keep_checkpoints: int = 3
    checkpoint_every_minutes: float | None = None  # also checkpoint by wall clock
    stop_signals: str = "SIGINT,SIGTERM,SIGUSR1"  # stop after the current update, with a checkpoint
    skip_bad_batches: bool = False
    device: str = "auto"
    loss_scale: float | None = None
    trace_nonfinite: bool = False
    parallel: str = "ddp"  # under torchrun: "ddp" (replicas) or "fsdp" (FSDP2 shards)
    reduce_fp32: bool = False  # under torchrun: reduce gradients in FP32
    collective_timeout: float | None = None  # under torchrun: seconds to wait for a peer (None: torch's default)
    compile: bool = False  # the training forward through torch.compile

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if not _has_type(value, typing.get_type_hints(TrainConfig)[field.name]):
                raise ValueError(
                    f"config '{field.name}': received {value!r} (of type {type(value).__name__}); "
                    f"expected {_type_name(typing.get_type_hints(TrainConfig)[field.name])}."
                )
        if self.epochs is not None and self.steps is not None:
            raise ValueError("config: give epochs or steps, not both.")
        for name in (
            "epochs",
            "steps",
            "batch_size",
            "accumulation_steps",
            "eval_every",
            "log_every",
            "checkpoint_every",
            "keep_checkpoints",
        ):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"config '{name}' must be >= 1; received {value}.")
        if not 0 <= self.seed < SEED_LIMIT:
            raise ValueError(f"config 'seed' must be from 0 to {SEED_LIMIT - 1}; received {self.seed}.")
        if self.frozen_epochs is not None and self.frozen_epochs < 0:
            raise ValueError(f"config 'frozen_epochs' must be >= 0; received {self.frozen_epochs}.")
        if self.loss_scale is not None:
            loss_scale(self.loss_scale, "config 'loss_scale'")
        for name in ("lr", "weight_decay"):
            value = getattr(self, name)
            if value is not None and not 0 <= value < math.inf:
                raise ValueError(f"config '{name}' must be a finite number >= 0; received {value}.")
        minutes = self.checkpoint_every_minutes
        if minutes is not None and not 0 < minutes < math.inf:
            raise ValueError(
                f"config 'checkpoint_every_minutes' must be a positive finite number of minutes; received {minutes}."
            )
        check_stop_signals(self.stop_signal_names, "config 'stop_signals'")
        timeout = self.collective_timeout
        if timeout is not None and not 0 < timeout < math.inf:
            raise ValueError(
                f"config 'collective_timeout' must be a positive finite number of seconds; received {timeout} "
                "(leave it out for torch's default: 30 minutes with gloo, 10 with NCCL)."
            )
        if self.max_grad_norm is not None and not 0 < self.max_grad_norm < math.inf:
            raise ValueError(
                f"config 'max_grad_norm' must be a positive finite number; received {self.max_grad_norm} "
                "(a clip to 0 would zero every update); leave it out to not clip."
            )
        if self.parallel not in PARALLEL_MODES:
            raise ValueError(f"config 'parallel': received {self.parallel!r}; use one of {', '.join(PARALLEL_MODES)}.")
        check_device(self.device, "config 'device'")
        if self.size not in SIZES:
            raise ValueError(f"config 'size': received {self.size!r}; use one of {', '.join(SIZES)}.")

    @property
    def stop_signal_names(self) -> tuple[str, ...]:
        """``stop_signals`` as a tuple of names (empty: no graceful stop)."""
        return tuple(name.strip().upper() for name in self.stop_signals.split(",") if name.strip())

    def replace(self, **changes: Any) -> TrainConfig:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Any, source: str = "config") -> TrainConfig:
        if not isinstance(data, dict):
            raise ValueError(f"{source}: expected a JSON object; received {type(data).__name__}.")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"{source}: unknown keys {unknown}; known keys: {', '.join(sorted(known))}.")
        if "task" not in data:
            raise ValueError(f"{source}: the key 'task' is missing.")
        try:
            return cls(**data)
        except (TypeError, ValueError) as error:  # a value of the wrong type or range: said with the file's name
            if source == "config":
                raise
            raise ValueError(f"{source}: {error}") from None

    def save(self, run_dir: Path) -> Path:
        from mixprec.persist import write_atomically  # imports torch: not when the CLI only checks its flags

        path = run_dir / CONFIG_FILE
        write_atomically(path, (json.dumps(self.to_dict(), indent=2) + "\n").encode())  # never half a config
        return path

    @classmethod
    def load(cls, run_dir: str | Path) -> TrainConfig:
        path = Path(run_dir) / CONFIG_FILE
        if not path.is_file():
            raise ValueError(
                f"{run_dir} is not a mixprec run folder: it has no {CONFIG_FILE} (a run stopped before it started has "
                "none yet: start it again, without --resume)."
            )
        try:
            data = json.loads(path.read_text(encoding="utf-8"), object_pairs_hook=unique_keys)
        except (OSError, ValueError) as exc:  # JSONDecodeError, UnicodeDecodeError, a key given twice
            raise ValueError(f"{path}: not readable JSON ({exc}).") from None
        return cls.from_dict(data, source=str(path))


def _has_type(value: Any, annotation: Any) -> bool:
    if isinstance(annotation, types.UnionType):
        return any(_has_type(value, arm) for arm in annotation.__args__)
    if annotation is type(None):
        return value is None
    if annotation is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if annotation is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, annotation)


def _type_name(annotation: Any) -> str:
    if isinstance(annotation, types.UnionType):
        return " or ".join(_type_name(arm) for arm in annotation.__args__)
    return "null" if annotation is type(None) else annotation.__name__
