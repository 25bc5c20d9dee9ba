"""Whether torch.compile's inductor keeps 16-bit round trips on a device.

Emulated ops compute in FP32 and round their inputs and results to fp16/bf16 and back, all on FP32
tensors. Inductor fuses such a round trip away (``x.to(torch.float16).float()`` becomes ``x``) unless
compiled with ``emulate_precision_casts``, and that option is not honoured everywhere: measured, torch
2.13 keeps the round trips on the CPU with it, torch 2.11 drops them on the CPU with or without it. The
answer is measured, not looked up by version: the round trip itself is compiled once per device.

The emulation is a torch-function mode, which the compiler traces op by op; one call escapes it: torch
2.13's dynamo puts a ``torch.nn.CrossEntropyLoss()`` made inside the compiled code (as transformers'
models make their loss) straight into the graph, so under an emulated region that loss is computed in
16 bits where eager (and GPU autocast) compute it in FP32. That too is measured: a loss made that way
is compiled once per device and compared with eager.
"""

from __future__ import annotations

import functools

import torch

from mixprec.numerics import get_format

__all__ = ["dropped_roundings_note", "inductor_keeps_casts"]

_FORMATS = (torch.float16, torch.bfloat16)


def _round_trips(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return tuple(x.to(dtype).float() for dtype in _FORMATS)


_DROPPED = "dropped"


@functools.cache
def _probe(device: str) -> str | None:
    """None when inductor keeps the round trips on ``device``; else ``_DROPPED`` or why compiling failed."""
    x = torch.tensor([1 + 2**-9, 1 + 2**-12, 3.14159, -2.71828e-3], device=device)  # none exact in 16 bits
    compiled = torch.compile(_round_trips, options={"emulate_precision_casts": True}, fullgraph=True, dynamic=False)
    try:
        got = compiled(x)
    except Exception as exc:  # no C++ compiler, no Triton: the compiler itself cannot run here
        return f"compiling failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]
    return None if all(torch.equal(a, b) for a, b in zip(got, _round_trips(x), strict=True)) else _DROPPED


def _inline_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.nn.CrossEntropyLoss()(logits.to(torch.float16), target)  # made in the code, as transformers does


@functools.cache
def _inline_loss_escapes(device: str) -> bool:
    """True when the compiled ``_inline_loss`` under an emulated fp16 region differs from eager's FP32 loss."""
    from mixprec.compute.emulation import EmulatedAutocast

    logits = torch.tensor([[0.1234, -1.5678, 2.3456], [3.3333, 0.0071, -0.5001]], device=device)
    target = torch.tensor([2, 0], device=device)
    compiled = torch.compile(_inline_loss, options={"emulate_precision_casts": True}, fullgraph=True, dynamic=False)
    with EmulatedAutocast(torch.float16, device_type=torch.device(device).type):
        eager = _inline_loss(logits, target)
        try:
            got = compiled(logits, target)
        except Exception:  # the compiler cannot run here: _probe's note says so
            return False
    return not torch.allclose(got.float(), eager.float(), rtol=1e-6, atol=0)  # fp16 rounding: ~1e-4 apart


def inductor_keeps_casts(device: str | torch.device) -> bool:
    """True when inductor, with ``emulate_precision_casts``, computes ``x.to(fp16 or bf16).float()`` as eager
    does on ``device`` (a device or device type). Compiles a two-line function once per process and device
    (~1-3 s)."""
    return _probe(str(torch.device(device))) is None


def dropped_roundings_note(
    emulates: bool, dtype: torch.dtype, device: str | torch.device, loss_in_model: bool = True
) -> str | None:
    """The warning for a model compiled by inductor whose region emulates ``dtype`` on ``device``: round trips
    dropped, a loss made in the compiled forward computed in 16 bits (only where the model may compute its
    loss: ``loss_in_model``); None where the compiled model computes what eager does: no emulation, or
    neither measured here."""
    if not emulates:
        return None
    name = get_format(dtype).name
    device = str(torch.device(device))
    notes = []
    if not inductor_keeps_casts(device):
        if (problem := _probe(device)) not in (None, _DROPPED):
            return (
                f"torch.compile: the check that inductor keeps 16-bit round trips on {device} could not compile "
                f"({problem}); the compiled model may compute the policy's emulated {name} ops partly in FP32."
            )
        notes.append(
            f"torch.compile: inductor in torch {torch.__version__} drops 16-bit round trips on {device} even with "
            f"emulate_precision_casts, so the compiled model computes the policy's emulated {name} ops partly in "
            "FP32: closer to FP32 than the run it emulates, and loss-scale overflows may not happen as they would. "
            "For exact emulation, train eager (no compile), or use a torch whose inductor keeps them (2.13 does "
            "on the CPU)."
        )
    if loss_in_model and _inline_loss_escapes(device):
        notes.append(
            "A torch.nn.CrossEntropyLoss() made inside the compiled forward (transformers' BERT-style "
            "classification heads make one; its causal LMs call torch.nn.functional.cross_entropy, which is not "
            f"affected) is computed by torch.compile in torch {torch.__version__} in the input's 16-bit dtype, "
            "where eager and GPU autocast compute it in FP32, if the model makes one: the loss and its gradient "
            "are rounded to 16 bits (a first step may overflow and be skipped). Compute the loss outside the "
            "compiled model, or with torch.nn.functional.cross_entropy or a loss module made in __init__ (both kept "
            "in FP32), or train eager."
        )
    return " ".join(notes) or None
