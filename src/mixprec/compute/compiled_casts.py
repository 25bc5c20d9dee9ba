"""Whether torch.compile's inductor keeps 16-bit round trips on a device.

Emulated ops compute in FP32 and round their inputs and results to fp16/bf16 and back, all on FP32
tensors. Inductor fuses such a round trip away (``x.to(torch.float16).float()`` becomes ``x``) unless
compiled with ``emulate_precision_casts``, and that option is not honoured everywhere: measured, torch
2.13 keeps the round trips on the CPU with it, torch 2.11 drops them on the CPU with or without it. The
answer is measured, not looked up by version: the round trip itself is compiled once per device.
"""

from __future__ import annotations

import functools

import torch

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


def inductor_keeps_casts(device: str | torch.device) -> bool:
    """True when inductor, with ``emulate_precision_casts``, computes ``x.to(fp16 or bf16).float()`` as eager
    does on ``device`` (a device or device type). Compiles a two-line function once per process and device
    (~1-3 s)."""
    return _probe(str(torch.device(device))) is None


def dropped_roundings_note(emulates: bool, dtype: torch.dtype, device: str | torch.device) -> str | None:
    """The warning for a model compiled by inductor whose region emulates ``dtype`` on ``device`` where the
    round trips would be lost (None where nothing is lost: no emulation, or the casts are kept)."""
    if not emulates or inductor_keeps_casts(device):
        return None
    name = {torch.float16: "fp16", torch.bfloat16: "bf16"}.get(dtype, str(dtype))
    problem = _probe(str(torch.device(device)))
    if problem not in (None, _DROPPED):
        return (
            f"torch.compile: the check that inductor keeps 16-bit round trips on {device} could not compile "
            f"({problem}); the compiled model may compute the policy's emulated {name} ops partly in FP32."
        )
    return (
        f"torch.compile: inductor in torch {torch.__version__} drops 16-bit round trips on {device} even with "
        f"emulate_precision_casts, so the compiled model computes the policy's emulated {name} ops partly in FP32: "
        "closer to FP32 than the run it emulates, and loss-scale overflows may not happen as they would. For exact "
        "emulation, train eager (no compile), or use a torch whose inductor keeps them (2.13 does on the CPU)."
    )
