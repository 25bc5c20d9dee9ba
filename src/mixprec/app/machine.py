"""What a result was measured on, for run summaries, reports and benchmarks."""

from __future__ import annotations

import os
import platform
import sys

import torch

from mixprec import __version__
from mixprec.compute import cpu_isa, device_caps

__all__ = ["machine_info"]


def machine_info() -> dict[str, object]:
    """What a result was measured on: CPU, threads, accelerator, versions (for reports and benchmarks)."""
    cpu = device_caps("cpu")
    return {
        "cpu": cpu.description,
        "isa": cpu_isa(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "bf16": cpu.bf16_note,
        "fp16": cpu.fp16_note,
        "cuda": device_caps("cuda").description if torch.cuda.is_available() else None,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "mixprec": __version__,
        "command": " ".join([os.path.basename(sys.argv[0]), *sys.argv[1:]]),
    }
