"""Training on built-in tasks and your own models: the Trainer, tasks, checkpoints, reports."""

from mixprec.train.config import TrainConfig
from mixprec.train.task import Metric, TaskConfig, TaskParts, accuracy, bits_per_char, build_task
from mixprec.train.trainer import FitResult, Trainer, TrainingInterrupted

__all__ = [
    "FitResult",
    "Metric",
    "TaskConfig",
    "TaskParts",
    "TrainConfig",
    "Trainer",
    "TrainingInterrupted",
    "accuracy",
    "bits_per_char",
    "build_task",
]
