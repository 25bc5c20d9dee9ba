"""What a task provides to the trainer, and how tasks are found by name or by ``module:factory`` path.

A task factory takes a :class:`TaskConfig` and returns :class:`TaskParts`: the model, the training and
evaluation data (re-iterable, yielding ``(inputs, targets)``), the loss function and an evaluation
metric, plus its default hyperparameters and, optionally, its LR schedule and the parameters AdamW
leaves undecayed. Built-in tasks: ``digits``, ``charlm``, ``hf``, ``minilm``, ``vision``; a user's own is
``pkg.module:factory`` (see ``examples/``).

Training data that should shuffle reproducibly carries a ``generator`` attribute (``torch.utils.data.DataLoader``
does when built with one): the trainer seeds it at the start of every epoch, which is what makes a
resumed run see the same batches as an uninterrupted one.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

__all__ = [
    "BUILTIN_TASKS",
    "Metric",
    "TaskConfig",
    "TaskParts",
    "accuracy",
    "bits_per_char",
    "build_task",
    "classification_loss",
    "warmup_linear",
]


@dataclass(frozen=True)
class Metric:
    """An evaluation metric accumulated over batches: ``batch(outputs, targets) -> (sum, count)``."""

    name: str
    batch: Callable[[Any, torch.Tensor], tuple[torch.Tensor, int]]
    higher_is_better: bool


def _logits(outputs: Any) -> torch.Tensor:
    return outputs.logits if hasattr(outputs, "logits") else outputs  # transformers' ModelOutput


def _accuracy(outputs: Any, targets: torch.Tensor) -> tuple[torch.Tensor, int]:
    return (_logits(outputs).argmax(-1) == targets).sum(), targets.numel()


def _bits(outputs: Any, targets: torch.Tensor) -> tuple[torch.Tensor, int]:
    logits = _logits(outputs).float()
    nats = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum")
    return nats / math.log(2), targets.numel()


accuracy = Metric("accuracy", _accuracy, higher_is_better=True)
bits_per_char = Metric("bits_per_char", _bits, higher_is_better=False)


def classification_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy, computed in FP32: the fine-tuning tasks' loss (minilm, vision)."""
    return nn.functional.cross_entropy(logits.float(), targets)


@dataclass(frozen=True)
class TaskConfig:
    """What a factory may read; None means the task's own default."""

    batch_size: int | None = None
    seed: int = 0
    device: str = "cpu"
    size: str = "default"  # "tiny" for tests and smoke runs


@dataclass
class TaskParts:
    """Everything the trainer needs for one task."""

    model: nn.Module
    train_data: Iterable
    eval_data: Iterable
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor]
    metric: Metric | None = None
    defaults: dict[str, Any] = field(default_factory=dict)  # lr, epochs or steps, weight_decay, max_grad_norm
    description: str = ""
    # updates in the run -> the LR multiplier of each update (e.g. warmup_linear(0.1)); None: cosine from 1 to 0.1
    schedule: Callable[[int], Callable[[int], float]] | None = None
    # (name, parameter) -> True for parameters AdamW does not decay (e.g. biases and norms); None: decay all
    no_weight_decay: Callable[[str, nn.Parameter], bool] | None = None
    # a held-out split that training never sees (eval_data guides the run): what export and serve-bench report on
    test_data: Iterable | None = None
    # (name, parameter) -> True for a pretrained body that fine-tuning freezes for defaults["frozen_epochs"]
    frozen: Callable[[str, nn.Parameter], bool] | None = None

    def held_out(self) -> tuple[str, Iterable]:
        """The split a trained model is judged on, and its name: the test data where the task has one (the
        validation data guided the run), else the validation data."""
        data = self.test_data if self.test_data is not None else self.eval_data
        if data is None:
            raise ValueError("the task has no evaluation data to measure accuracy on.")
        return ("test" if self.test_data is not None else "validation"), data


def warmup_linear(warmup: float) -> Callable[[int], Callable[[int], float]]:
    """BERT's fine-tuning schedule, for ``TaskParts(schedule=...)``: the LR multiplier rises linearly over the
    first ``warmup`` fraction of the updates, then falls linearly to 0 at the last one.

    Example:
        >>> multiplier = warmup_linear(0.1)(100)
        >>> [round(multiplier(step), 2) for step in (0, 5, 10, 55, 100)]
        [0.1, 0.6, 1.0, 0.5, 0.0]
    """
    if not 0 <= warmup < 1:
        raise ValueError(f"warmup_linear(warmup=...): received {warmup!r}; use a fraction in [0, 1), e.g. 0.1.")

    def for_run(total: int) -> Callable[[int], float]:
        ramp = max(1, round(warmup * total))
        # a closure, not a callable object: LambdaLR's state_dict then holds no function state
        return lambda step: (step + 1) / ramp if step < ramp else max(0.0, (total - step) / max(1, total - ramp))

    return for_run


BUILTIN_TASKS = {
    "digits": "mixprec.app.tasks.digits:build",
    "charlm": "mixprec.app.tasks.charlm:build",
    "hf": "mixprec.app.tasks.hf:build",
    "minilm": "mixprec.app.tasks.minilm:build",
    "vision": "mixprec.app.tasks.vision:build",
}


def build_task(spec: str, config: TaskConfig) -> TaskParts:
    """Build a task from a built-in name or a ``package.module:factory`` path.

    Raises:
        ValueError: unknown name, malformed path, a factory that does not import or returns the wrong thing.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"task: received {spec!r}; use one of {', '.join(BUILTIN_TASKS)} or 'package.module:factory'.")
    path = BUILTIN_TASKS.get(spec, spec)
    module_name, sep, attribute = path.partition(":")
    if not sep or not module_name or not attribute.isidentifier():
        raise ValueError(
            f"task {spec!r} is neither a built-in task ({', '.join(BUILTIN_TASKS)}) "
            "nor a 'package.module:factory' path."
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        hint = " (install the extra it needs: pip install 'mixprec[hf]')" if spec == "hf" else ""
        raise ValueError(f"task {spec!r}: cannot import {module_name!r}: {exc}{hint}") from None
    except (Exception, SystemExit) as exc:  # the user's module failed as it was imported (a SyntaxError, an exit)
        if spec in BUILTIN_TASKS:
            raise
        said = " ".join(f"{type(exc).__name__}: {exc}".split())
        raise ValueError(f"task {spec!r}: importing {module_name!r} failed ({said[:200]}).") from exc
    factory = getattr(module, attribute, None)
    if not callable(factory):
        raise ValueError(f"task {spec!r}: {module_name!r} has no callable {attribute!r}.")
    try:
        parts = factory(config)
    except (Exception, SystemExit) as error:  # the user's factory: said as its own (a built-in's is a bug: raised)
        if spec in BUILTIN_TASKS:
            raise
        said = " ".join(f"{type(error).__name__}: {error}".split())
        raise ValueError(
            f"task {spec!r}: the factory {attribute}(config) failed ({said[:200]}); a factory takes one "
            "mixprec.app.TaskConfig and returns mixprec.app.TaskParts (see examples/). MIXPREC_DEBUG=1 shows where."
        ) from error
    if not isinstance(parts, TaskParts):
        raise ValueError(
            f"task {spec!r}: the factory returned {type(parts).__name__}; it must return "
            "mixprec.app.TaskParts(model=..., train_data=..., eval_data=..., loss_fn=...)."
        )
    if not isinstance(parts.model, nn.Module) or not callable(parts.loss_fn):
        raise ValueError(f"task {spec!r}: TaskParts.model must be an nn.Module and loss_fn callable.")
    return parts
