"""What a device can compute in 16 bits, and how fast: the facts behind every automatic choice.

Each answer carries a human-readable reason ("bf16: CPU has AVX512-BF16"), so a choice made from it
can be explained to the user.
"""

from __future__ import annotations

import functools
import platform
from dataclasses import dataclass

import torch

__all__ = ["DeviceCaps", "cpu_isa", "cpu_model", "device_caps", "device_type_of"]


@dataclass(frozen=True)
class DeviceCaps:
    """16-bit capabilities of one device type.

    ``supports_*``: autocast can compute in that dtype at all. ``fast_*``: the hardware has units
    for it, so it should beat FP32. ``tf32``: FP32 matmuls can run on TF32 units.
    """

    device_type: str
    description: str
    supports_fp16: bool
    supports_bf16: bool
    fast_fp16: bool
    fast_bf16: bool
    tf32: bool
    fp16_note: str
    bf16_note: str
    tf32_note: str


def device_type_of(device: str | torch.device | None) -> str:
    """'cpu', 'cuda', ... from a device spec; None means CUDA when present, else CPU."""
    if device is None:
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        return torch.device(device).type
    except (RuntimeError, TypeError) as exc:
        raise ValueError(
            f"device={device!r} (of type {type(device).__name__}) is not a device; use e.g. 'cpu', 'cuda' or 'cuda:1'."
        ) from exc


def device_caps(device: str | torch.device | None) -> DeviceCaps:
    """The capabilities of the current process's device of ``device``'s type (the first device of that type):
    ``"cpu"``, ``"cuda"``, ``"cuda:1"`` or a torch.device (its type is what counts), None for the default."""
    return _device_caps(device_type_of(device))


@functools.cache
def _device_caps(device_type: str) -> DeviceCaps:
    if device_type == "cpu":
        return _cpu_caps()
    if device_type == "cuda":
        return _cuda_caps()
    available = torch.amp.autocast_mode.is_autocast_available(device_type)
    note = f"{device_type}: capabilities not probed by mixprec; autocast {'available' if available else 'unavailable'}"
    return DeviceCaps(device_type, device_type, available, available, False, False, False, note, note, note)


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cpu_model() -> str:
    """The CPU's model name ("AMD EPYC 9R14", "Intel(R) Xeon(R) Platinum 8488C"), else the architecture."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


_ISA_SHOWN = {"avx2": "AVX2", "avx512f": "AVX512", "avx512_bf16": "AVX512-BF16", "avx512_fp16": "AVX512-FP16",
              "amx_bf16": "AMX-BF16", "amx_fp16": "AMX-FP16"}  # fmt: skip


def cpu_isa() -> str:
    """The vector and matrix extensions that matter for 16-bit speed, as listed by the CPU ("-" if none)."""
    flags = _cpu_flags()
    return " ".join(shown for flag, shown in _ISA_SHOWN.items() if flag in flags) or "-"


def _cpu_caps() -> DeviceCaps:
    flags = _cpu_flags()
    fast_bf16 = bool(flags & {"avx512_bf16", "amx_bf16"})
    fast_fp16 = bool(flags & {"avx512_fp16", "amx_fp16"})
    name = cpu_model()
    bf16_note = (
        "bf16: CPU has " + ("AMX-BF16" if "amx_bf16" in flags else "AVX512-BF16")
        if fast_bf16
        else "bf16: CPU has no AVX512-BF16/AMX-BF16 units, so bf16 is emulated and rarely faster than FP32"
    )
    fp16_note = (
        "fp16: CPU has " + ("AMX-FP16" if "amx_fp16" in flags else "AVX512-FP16")
        if fast_fp16
        else "fp16: CPU has no AVX512-FP16/AMX-FP16 units; fp16 runs in reference kernels"
    )
    return DeviceCaps(
        device_type="cpu",
        description=f"CPU ({name})",
        supports_fp16=True,
        supports_bf16=True,
        fast_fp16=fast_fp16,
        fast_bf16=fast_bf16,
        tf32=False,
        fp16_note=fp16_note,
        bf16_note=bf16_note,
        tf32_note="tf32: CPUs have no TF32 units; FP32 matmuls stay plain FP32",
    )


def _cuda_caps() -> DeviceCaps:
    if not torch.cuda.is_available():
        note = "cuda: no CUDA device is visible to this process"
        return DeviceCaps("cuda", "no CUDA device", False, False, False, False, False, note, note, note)
    major, minor = torch.cuda.get_device_capability()
    name = f"{torch.cuda.get_device_name()} (sm_{major}{minor})"
    bf16 = torch.cuda.is_bf16_supported()
    return DeviceCaps(
        device_type="cuda",
        description=name,
        supports_fp16=True,
        supports_bf16=bf16,
        fast_fp16=major >= 7,
        fast_bf16=major >= 8,
        tf32=major >= 8,
        fp16_note=f"fp16: {name} " + ("has fp16 tensor cores" if major >= 7 else "has no tensor cores"),
        bf16_note=f"bf16: {name} " + ("has bf16 tensor cores" if major >= 8 else "has no bf16 tensor cores"),
        tf32_note=f"tf32: {name} " + ("has TF32 tensor cores" if major >= 8 else "has no TF32 units"),
    )
