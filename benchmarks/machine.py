"""The machine a benchmark ran on, recorded next to its results."""

import os
import platform
import sys

import torch

import mixprec


def machine() -> dict:
    return {
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "bf16_note": mixprec.device_caps("cpu").bf16_note,
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "mixprec": mixprec.__version__,
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
    }
