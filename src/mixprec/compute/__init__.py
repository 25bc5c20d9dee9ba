"""How 16-bit arithmetic is computed on the machine at hand: device facts, PyTorch's native kernels or
their exact emulation in FP32, GEMM attention, and the timed probe that picks among them per op family.

Nothing here knows about policies; :mod:`mixprec.policy` (``auto``) and :mod:`mixprec.regions` build on it.
"""

from mixprec.compute.compiled_casts import dropped_roundings_note, inductor_keeps_casts
from mixprec.compute.device import DeviceCaps, cpu_isa, device_caps, device_type_of
from mixprec.compute.emulation import EmulatedAutocast
from mixprec.compute.kernels import KERNEL_SETTINGS, KernelPlan, kernel_plan
from mixprec.compute.nest import map_floating, map_tensors
from mixprec.compute.timing import interleaved_medians, pass_timer, repeats_for, warm_up

__all__ = [
    "KERNEL_SETTINGS",
    "DeviceCaps",
    "EmulatedAutocast",
    "KernelPlan",
    "cpu_isa",
    "device_caps",
    "device_type_of",
    "dropped_roundings_note",
    "inductor_keeps_casts",
    "interleaved_medians",
    "kernel_plan",
    "map_floating",
    "map_tensors",
    "pass_timer",
    "repeats_for",
    "warm_up",
]
