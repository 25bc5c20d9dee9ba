"""Inference forwards captured in CUDA graphs and replayed: serving at small batches without launch cost.

At batch 1 a transformer's forward is hundreds of small kernels; each launch costs the host a few
microseconds, more than the kernel takes on a large GPU, so the GPU waits and a 16-bit model is no faster
than FP32 (seed 002's inference claim fails there). A CUDA graph records the forward's kernels once and
replays them with one launch. Captured here: the model's forward inside its precision region (the casts
the region makes are recorded with it), under ``torch.inference_mode``, one graph per input shape, made
at the first call with that shape (three warm-up forwards on a side stream, as PyTorch's docs prescribe,
then the capture). A call copies the input into the graph's static input, replays, and returns the
graph's static output: read it before the next call, which overwrites it.

A forward that syncs with the host (``.item()``, data-dependent shapes) cannot be captured: the capture
raises, and the error names the mode and what to do.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = ["GraphedForward", "require_cuda"]

WARMUP_FORWARDS = 3


def require_cuda(device: torch.device, argument: str) -> None:
    """Refuse CUDA graphs for a model on another device, naming ``argument``."""
    if device.type != "cuda":
        raise ValueError(
            f"{argument}: CUDA graphs need a CUDA device; this model runs on {device}. "
            f"Leave out {argument} there (on CPUs a forward has no launch cost to save)."
        )


class GraphedForward:
    """``model``'s forward under ``region`` as a CUDA graph per input shape (see the module docstring)."""

    def __init__(self, model: nn.Module, region: Callable[[], contextlib.AbstractContextManager]) -> None:
        self.model, self.region = model, region
        self._graphs: dict[tuple[tuple[int, ...], torch.dtype], tuple[torch.cuda.CUDAGraph, torch.Tensor, Any]] = {}

    def eval(self) -> GraphedForward:
        self.model.eval()
        return self

    def __call__(self, inputs: torch.Tensor) -> Any:
        key = (tuple(inputs.shape), inputs.dtype)
        if key not in self._graphs:
            self._graphs[key] = self._capture(inputs)
        graph, static_input, static_output = self._graphs[key]
        static_input.copy_(inputs)
        graph.replay()
        return static_output

    def _capture(self, inputs: torch.Tensor) -> tuple[torch.cuda.CUDAGraph, torch.Tensor, Any]:
        require_cuda(inputs.device, "CUDA graphs")
        static_input = inputs.clone()
        side = torch.cuda.Stream(inputs.device)
        side.wait_stream(torch.cuda.current_stream(inputs.device))
        with torch.inference_mode(), self.region():
            with torch.cuda.stream(side):  # warm-up off the default stream: lazy initialisations happen here
                for _ in range(WARMUP_FORWARDS):
                    self.model(static_input)
            torch.cuda.current_stream(inputs.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(graph):
                    static_output = self.model(static_input)
            except RuntimeError as error:
                raise RuntimeError(
                    f"capturing the forward in a CUDA graph failed (a host sync or a data-dependent shape in the "
                    f"model's forward?): {error}. Measure without CUDA graphs."
                ) from error
        return graph, static_input, static_output
