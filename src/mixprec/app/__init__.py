"""The application, built on mixprec's public API: the Trainer, built-in tasks, runs, checkpoints,
reports, exports, benchmark suites and the ``mixprec`` command (:mod:`mixprec.app.cli`).

Names load on first use, so the command's ``--help`` and usage errors do not import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mixprec.lazy import lazy_names

if TYPE_CHECKING:
    from mixprec.app.config import TrainConfig
    from mixprec.app.failures import BadBatchError
    from mixprec.app.resume import ForeignCheckpointError
    from mixprec.app.task import Metric, TaskConfig, TaskParts, accuracy, bits_per_char, build_task, warmup_linear
    from mixprec.app.trainer import FitResult, Trainer, TrainingInterrupted
    from mixprec.app.trainer_options import BatchChecks, RunOptions, TrainData, UpdateOptions

_SOURCES = {
    "TrainConfig": "mixprec.app.config",
    "ForeignCheckpointError": "mixprec.app.resume",
    "Metric": "mixprec.app.task",
    "TaskConfig": "mixprec.app.task",
    "TaskParts": "mixprec.app.task",
    "accuracy": "mixprec.app.task",
    "bits_per_char": "mixprec.app.task",
    "build_task": "mixprec.app.task",
    "warmup_linear": "mixprec.app.task",
    "FitResult": "mixprec.app.trainer",
    "Trainer": "mixprec.app.trainer",
    "TrainingInterrupted": "mixprec.app.trainer",
    "BadBatchError": "mixprec.app.failures",
    "BatchChecks": "mixprec.app.trainer_options",
    "RunOptions": "mixprec.app.trainer_options",
    "TrainData": "mixprec.app.trainer_options",
    "UpdateOptions": "mixprec.app.trainer_options",
}

__getattr__, __dir__ = lazy_names(__name__, globals(), _SOURCES)

__all__ = [
    "BadBatchError",
    "BatchChecks",
    "FitResult",
    "ForeignCheckpointError",
    "Metric",
    "RunOptions",
    "TaskConfig",
    "TaskParts",
    "TrainConfig",
    "TrainData",
    "Trainer",
    "TrainingInterrupted",
    "UpdateOptions",
    "accuracy",
    "bits_per_char",
    "build_task",
    "warmup_linear",
]
