"""Serving a trained run: latency and throughput per precision, with accuracy and size, side by side.

From the run's exact FP32 weights (as ``mixprec export`` reads them) five models are made and measured
in one process, interleaved, so that they share the machine's state:

    mixprec fp32   the FP32 model in mixprec's fp32 region (the reference)
    mixprec bf16   the bf16 export (``mixprec export --dtype bf16``: normalization layers and whatever
                   else the run's policy keeps in FP32) in its region, outputs in FP32
    mixprec fp16   the fp16 export in its region: native fp16 kernels where the compute plan measured
                   them faster, emulated (bf16-exact rounding to fp16) where the machine has none
    plain fp32     the same FP32 model in plain torch (``inference_mode``, no mixprec)
    plain bf16     ``model.to(torch.bfloat16)`` in plain torch: what one does without mixprec

and, with ``cuda_graphs`` (CUDA only), each mixprec mode again with its forward captured in a CUDA graph
per batch size (:mod:`mixprec.app.cuda_graphs`): the same weights and kernels without the launch cost, which
dominates at small batches. Their accuracy is their eager twin's (the same kernels), not measured again.

For each: the weights' size as safetensors, the task's metric and loss on its held-out test split
(its validation split for tasks without one), latency of one input (p50 and p95 over ``latency_samples``
forwards), and throughput at each larger batch (inputs per second, median of ``repeats`` passes): an input is a
sequence for token tasks, a sample (an image) for the others. Token inputs are cut from that split's real
tokens to exactly ``seq`` tokens (by default as many as its longest row); other inputs (images) are its rows.
"""

from __future__ import annotations

import contextlib
import copy
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save as safetensors_bytes
from torch import nn

from mixprec.app.config import TrainConfig
from mixprec.app.cuda_graphs import GraphedForward, require_cuda
from mixprec.app.evaluate import evaluate
from mixprec.app.export import fp32_weights
from mixprec.app.run import build_trainer
from mixprec.policy import Policy, export_policy, get_policy
from mixprec.regions import Region, cast_module

__all__ = ["GRAPHED", "MODES", "ServeResult", "as_records", "serve_bench", "timing_batch"]

MODES = ("mixprec fp32", "mixprec bf16", "mixprec fp16", "plain fp32", "plain bf16")
GRAPHED = ", CUDA graph"  # the suffix of a mode replayed from CUDA graphs


@dataclass
class ServeResult:
    """One mode's figures; ``throughput`` maps a batch size to inputs (``unit``s) per second."""

    mode: str
    size_bytes: int
    evaluation: dict[str, float]
    split: str  # the data evaluated: the task's held-out test split, else its validation split
    latency_p50_ms: float = 0.0
    latency_p95_ms: float = 0.0
    throughput: dict[int, float] = field(default_factory=dict)
    unit: str = "sequence"  # what one input is: "sequence" (token rows) or "sample" (an image, a feature row)
    seq: int | None = None  # tokens per timed sequence (token inputs only)


@dataclass(frozen=True)
class _Mode:
    model: nn.Module
    region: Callable[[], contextlib.AbstractContextManager]


class _Bf16Inputs(nn.Module):
    """A bf16 model fed as one feeds it by hand: floating inputs cast to bf16 (token ids stay integers)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, inputs: torch.Tensor) -> Any:
        return self.model(inputs.to(torch.bfloat16) if inputs.is_floating_point() else inputs)


def _modes(fp32_model: nn.Module, trained: Policy, device: torch.device, cuda_graphs: bool) -> dict[str, _Mode]:
    modes = {}
    for name in ("fp32", "bf16", "fp16"):
        policy = get_policy("fp32") if name == "fp32" else export_policy(trained, name)
        model = cast_module(copy.deepcopy(fp32_model), policy)
        region = Region(policy, model, device)  # prepared once: entering it per forward costs nothing more
        modes[f"mixprec {name}"] = _Mode(model, region.enter)
    modes["plain fp32"] = _Mode(copy.deepcopy(fp32_model), contextlib.nullcontext)
    modes["plain bf16"] = _Mode(_Bf16Inputs(copy.deepcopy(fp32_model).to(torch.bfloat16)), contextlib.nullcontext)
    for mode in modes.values():
        mode.model.eval()
    if cuda_graphs:  # the region is captured with the forward: nothing to enter at replay
        for name in ("fp32", "bf16", "fp16"):
            eager = modes[f"mixprec {name}"]
            modes[f"mixprec {name}{GRAPHED}"] = _Mode(GraphedForward(eager.model, eager.region), contextlib.nullcontext)
    return modes


def timing_batch(eval_data, batch: int, seq: int | None) -> torch.Tensor:
    """``batch`` inputs for timing: token rows of exactly ``seq`` real tokens (padding, id 0, dropped)
    cut from the evaluation inputs, or the evaluation rows themselves, repeated as needed."""
    inputs = [inputs for inputs, _ in eval_data]
    if seq is not None and _token_rows(inputs[0]):
        tokens = torch.cat([rows[rows != 0] for rows in inputs])  # batches padded to their own lengths
        tokens = tokens.repeat(-(-batch * seq // tokens.numel()))[: batch * seq]
        return tokens.reshape(batch, seq)
    rows = torch.cat(inputs)
    return rows.repeat((-(-batch // rows.shape[0]),) + (1,) * (rows.dim() - 1))[:batch]


def _token_rows(inputs: torch.Tensor) -> bool:
    """Whether a batch of inputs is token ids, one row per sequence."""
    return not inputs.is_floating_point() and inputs.dim() == 2


def _forward(mode: _Mode, inputs: torch.Tensor, device: torch.device) -> float:
    """Seconds of one forward pass (finished: a host sync on accelerators, as timing needs)."""
    start = time.perf_counter()
    with torch.inference_mode(), mode.region():
        mode.model(inputs)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def _timed(modes: dict[str, _Mode], inputs: torch.Tensor, device: torch.device, samples: int) -> dict[str, list]:
    """Seconds of ``samples`` forwards of each mode on ``inputs``, the modes taking turns."""
    times: dict[str, list[float]] = {name: [] for name in modes}
    for sample in range(samples + 1):
        for name, mode in modes.items():
            seconds = _forward(mode, inputs, device)
            if sample:  # the first forward of each mode warms up
                times[name].append(seconds)
    return times


def _stored_bytes(model: nn.Module) -> int:
    """The size of the model's safetensors file, each tensor stored once: weights tied to each other (a
    GPT's embedding and output head) count once, as safetensors' ``save_model`` stores them."""
    seen, state = set(), {}
    for name, tensor in model.state_dict().items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape), tensor.stride())
        if key not in seen:  # a view of other storage is copied: safetensors refuses shared memory
            seen.add(key)
            state[name] = tensor.detach().contiguous().clone()
    return len(safetensors_bytes(state))


def _timing_seq(mode: _Mode, data, seq: int | None, device: torch.device) -> int:
    """The tokens per timed sequence: ``seq``, else the held-out split's longest row (what the task feeds the
    model). A length the model cannot take (past a GPT's position table) is refused here, naming ``--seq``,
    by one forward at batch 1 rather than in a traceback after the evaluations."""
    longest = max(inputs.shape[1] for inputs, _ in data)
    if seq is None:
        return longest
    try:
        _forward(mode, timing_batch(data, 1, seq).to(device), device)
    except (IndexError, RuntimeError) as error:
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ValueError(
            f"--seq: received {seq}; the model refused a sequence of {seq} tokens ({reason}). Its held-out "
            f"sequences have up to {longest} tokens: give --seq {longest} or less, or leave it out."
        ) from error
    return seq


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def serve_bench(
    run_dir: str | Path,
    batches: tuple[int, ...] = (1, 8, 64),
    seq: int | None = None,
    repeats: int = 3,
    latency_samples: int = 30,
    progress: Callable[[str], None] = lambda message: None,
    cuda_graphs: bool = False,
) -> list[ServeResult]:
    """Measure the run's model in every mode of :data:`MODES`, and with ``cuda_graphs`` the mixprec modes
    replayed from CUDA graphs (see the module docstring). Token inputs are ``seq`` tokens long; None: as
    long as the held-out split's longest row."""
    run_dir = Path(run_dir)
    config = TrainConfig.load(run_dir).replace(parallel="ddp")
    trainer, parts, _ = build_trainer(config, None, progress=False)
    _, weights = fp32_weights(run_dir, trainer, allow_foreign=False)
    reference, _, _ = build_trainer(config.replace(policy="fp32"), None, progress=False)  # FP32 parameters
    fp32_model, device = reference.model, reference.device
    if cuda_graphs:
        require_cuda(device, "cuda_graphs")
    fp32_model.load_state_dict(weights)
    split, data = parts.held_out()
    modes = _modes(fp32_model, trainer.mp.policy, device, cuda_graphs)
    unit = "sequence" if _token_rows(next(iter(data))[0]) else "sample"
    seq = _timing_seq(modes["plain fp32"], data, seq, device) if unit == "sequence" else None
    results = {}
    for name, mode in modes.items():
        if name.endswith(GRAPHED):  # the same weights and kernels as its eager twin, evaluated just before
            twin = results[name.removesuffix(GRAPHED)]
            results[name] = ServeResult(name, twin.size_bytes, twin.evaluation, split, unit=unit, seq=seq)
            continue
        progress(f"evaluating {name}")
        evaluation = evaluate(mode.model, data, parts.loss_fn, parts.metric, mode.region, device)
        results[name] = ServeResult(name, _stored_bytes(mode.model), evaluation, split, unit=unit, seq=seq)
    for batch in batches:
        inputs = timing_batch(data, batch, seq).to(device)
        progress(f"timing batch {batch}")
        if batch == 1:
            for name, times in _timed(modes, inputs, device, latency_samples).items():
                results[name].latency_p50_ms = 1e3 * statistics.median(times)
                results[name].latency_p95_ms = 1e3 * _percentile(times, 0.95)
        else:
            for name, times in _timed(modes, inputs, device, repeats).items():
                results[name].throughput[batch] = batch / statistics.median(times)
    return list(results.values())


def as_records(results: list[ServeResult]) -> list[dict[str, Any]]:
    """JSON-able records (batch sizes as strings)."""
    return [{**asdict(r), "throughput": {str(b): v for b, v in r.throughput.items()}} for r in results]
