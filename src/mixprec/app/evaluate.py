"""Evaluation: mean loss and a metric over a data set, inside a precision region, without gradients."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from mixprec.app.task import Metric

__all__ = ["evaluate", "to_device"]


def to_device(value: Any, device: torch.device) -> Any:
    return value.to(device, non_blocking=True) if isinstance(value, torch.Tensor) else value


def batch_size(targets: Any) -> int:
    return int(targets.shape[0]) if isinstance(targets, torch.Tensor) and targets.dim() > 0 else 1


def evaluate(
    model: nn.Module,
    data: Iterable,
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor],
    metric: Metric | None,
    region: Callable[[], contextlib.AbstractContextManager],
    device: torch.device,
) -> dict[str, float]:
    """``{"loss": mean loss, metric.name: value}`` over ``data``; each batch runs inside ``region()``.

    Runs under ``torch.random.fork_rng``, so evaluating never shifts a training run's random stream
    (a DataLoader draws a seed from the global RNG for every pass). Model mode is restored afterwards.
    """
    was_training = model.training
    model.eval()
    loss_sum, count, metric_sum, metric_count = 0.0, 0, 0.0, 0
    devices = [torch.cuda.current_device()] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), torch.no_grad():
        for inputs, targets in data:
            inputs, targets = to_device(inputs, device), to_device(targets, device)
            with region():
                outputs = model(inputs)
                loss = loss_fn(outputs, targets)
            size = batch_size(targets)
            loss_sum += float(loss) * size  # host sync per batch: evaluation only
            count += size
            if metric is not None:
                value, n = metric.batch(outputs, targets)
                metric_sum, metric_count = metric_sum + float(value), metric_count + n
    model.train(was_training)
    result = {"loss": loss_sum / max(count, 1)}
    if metric is not None:
        result[metric.name] = metric_sum / max(metric_count, 1)
    return result
