"""Which kernel runs each op family of a 16-bit region on a CPU: chosen by timing, never by ISA flags.

A CPU flag says what the hardware has, not how fast PyTorch's kernels for it are: a Xeon with
AVX512-FP16 runs fp16 matmuls no faster than FP32 and fp16 convolution backward ~100x slower, while a
Zen 4 without it runs every fp16 op in slow reference kernels. So, the first time a 16-bit compute
dtype is resolved on a CPU, a short probe (1.1 s for fp16, 0.5 s for bf16 on the 2-core development
CPU) times forward + backward of each op family under every candidate and keeps the fastest:

    for family in (matmul, conv, attention):
        for candidate in (native, emulated[, gemm for bf16 attention][, fp32 for matmul: the reference]):
            warm up once; time fwd+bwd up to 3 times, interleaved; drop a candidate 3x slower than the best
        choice[family] = the candidate with the smallest time

``native`` is ``torch.autocast``'s own 16-bit kernel; ``emulated`` computes in FP32 on inputs rounded
to the 16-bit format and rounds the output (:mod:`mixprec.compute.emulation`): the same numerics as a
tensor core up to the order of FP32 additions; ``gemm`` is attention from bf16 GEMMs
(:mod:`mixprec.compute.attention`). Forward alone would choose wrong: fp16 convolution forward is fast
where its backward is not.

Choices are cached per machine in ``$MIXPREC_CACHE_DIR`` (default ``~/.cache/mixprec``), keyed by CPU
model, torch version, thread count and dtype, so a new torch re-measures. A cached probe taken while the
machine was busy (its FP32 matmul more than 5x slower than one timed when the cache is read) is measured
again: contention slows each candidate differently and would fix a wrong choice. Overrides, strongest first:
the policy key ``kernels=native|emulated``, then ``MIXPREC_FP16_CPU`` / ``MIXPREC_BF16_CPU``
(``native`` or ``emulate``). Each choice carries its figures, shown by ``mixprec policy``.

Example:
    >>> plan = kernel_plan(torch.float16, kernels="emulated")
    >>> plan.kernel("conv"), plan.source
    ('emulated', 'policy kernels=emulated')
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from mixprec.compute.attention import GemmAttention
from mixprec.compute.cache import default_cache_dir, read_cache, store
from mixprec.compute.device import cpu_model
from mixprec.compute.emulation import FAMILY_OPS, EmulatedAutocast
from mixprec.numerics import get_format

__all__ = ["CACHE_VERSION", "FAMILIES", "FAMILY_OPS", "KERNEL_SETTINGS", "KernelPlan", "kernel_plan", "machine_key"]

FAMILIES = tuple(FAMILY_OPS)  # matmul, conv, attention: the families of the emulation's GEMM ops (emulation.py)
# Norms, softmax and losses are not probed: both native autocast and the emulation compute them in FP32.
KERNEL_SETTINGS = ("auto", "native", "emulated")  # the policy key ``kernels=``
_ENV_VALUES = {"native": "native", "emulate": "emulated", "emulated": "emulated", "auto": "auto"}
_HALF_DTYPES = (torch.float16, torch.bfloat16)
CACHE_VERSION = 2  # the layout of kernels.json; another version is measured again
_SLOWER_TO_DROP = 3.0  # a candidate this many times slower than the best after one run is not re-timed
_BUSY = 5.0  # a cached FP32 matmul this many times slower than now: the probe ran on a busy machine

Timer = Callable[[str, str], float]  # (family, candidate) -> milliseconds for one forward + backward


@dataclass(frozen=True)
class KernelPlan:
    """The kernel chosen for each op family of one 16-bit dtype, with the figures behind it."""

    dtype: torch.dtype
    choices: dict[str, str]
    timings_ms: dict[str, dict[str, float]] = field(default_factory=dict)  # family -> candidate -> ms
    source: str = "measured"  # measured | cached | an override

    def kernel(self, family: str) -> str:
        return self.choices[family]

    @property
    def emulated_ops(self) -> frozenset[str]:
        """The op names the emulation must take over (the families whose choice is ``emulated``)."""
        emulated = [family for family, kernel in self.choices.items() if kernel == "emulated"]
        return frozenset(op for family in emulated for op in FAMILY_OPS[family])

    @property
    def mode(self) -> str:
        """``native``, ``emulated`` (every family) or ``hybrid`` (some of each)."""
        kinds = {"emulated" if k == "emulated" else "native" for k in self.choices.values()}
        return kinds.pop() if len(kinds) == 1 else "hybrid"

    def matmul_speedup(self) -> float | None:
        """FP32 matmul time over the chosen 16-bit kernel's (forward + backward), when measured: how much
        faster this dtype runs GEMMs here (what ``auto`` decides by)."""
        figures = self.timings_ms.get("matmul", {})
        chosen = figures.get(self.choices["matmul"])
        return figures["fp32"] / chosen if chosen and "fp32" in figures else None

    def describe(self) -> str:
        """One line: each family's kernel and, when measured, the milliseconds of every candidate."""
        parts = []
        for family in FAMILIES:
            figures = self.timings_ms.get(family, {})
            shown = ", ".join(f"{c} {ms:.2f} ms" for c, ms in figures.items())
            parts.append(f"{family} {self.choices[family]}" + (f" ({shown})" if shown else ""))
        return f"{get_format(self.dtype).name} kernels [{self.source}]: " + "; ".join(parts)


def kernel_plan(
    dtype: torch.dtype,
    *,
    kernels: str = "auto",
    timer: Timer | None = None,
    cache_dir: str | os.PathLike | None = None,
) -> KernelPlan:
    """The CPU kernel of each op family for ``dtype`` (fp16 or bf16): measured once, cached, overridable.

    Args:
        dtype: ``torch.float16`` or ``torch.bfloat16``.
        kernels: ``auto`` (measure, or read the cache), ``native`` or ``emulated`` (every family).
        timer: the timing source, ``(family, candidate) -> ms``; default: the real probe. Tests pass a fake.
        cache_dir: where the per-machine cache lives; default ``$MIXPREC_CACHE_DIR`` or ``~/.cache/mixprec``.

    Raises:
        ValueError: ``kernels`` or the ``MIXPREC_*_CPU`` variable is not one of the valid settings.
    """
    if dtype not in _HALF_DTYPES:
        raise ValueError(f"kernel_plan(dtype=...): received {dtype}; use torch.float16 or torch.bfloat16.")
    if kernels not in KERNEL_SETTINGS:
        raise ValueError(f"kernel_plan(kernels=...): received {kernels!r}; use one of {', '.join(KERNEL_SETTINGS)}.")
    if kernels != "auto":
        return _everywhere(dtype, kernels, f"policy kernels={kernels}")
    variable = f"MIXPREC_{get_format(dtype).name.upper()}_CPU"
    setting = os.environ.get(variable, "auto").strip().lower() or "auto"
    if setting not in _ENV_VALUES:
        raise ValueError(f"{variable}={os.environ[variable]!r} is not a kernel setting; use native, emulate or auto.")
    if _ENV_VALUES[setting] != "auto":
        return _everywhere(dtype, _ENV_VALUES[setting], f"{variable}={setting}")
    if timer is None:
        return _measured_here(dtype, str(cache_dir or default_cache_dir()))
    if cache_dir is None:  # an injected timing source is cached only where the caller says
        return _measure(dtype, timer)
    return _cached_or_measured(dtype, Path(cache_dir), timer)


def _everywhere(dtype: torch.dtype, kernel: str, source: str) -> KernelPlan:
    return KernelPlan(dtype, {family: kernel for family in FAMILIES}, {}, source)


def _candidates(dtype: torch.dtype, family: str) -> tuple[str, ...]:
    if family == "attention" and dtype == torch.bfloat16:
        return ("native", "emulated", "gemm")
    return ("native", "emulated")


def _timed(family: str) -> tuple[str, ...]:
    """Also timed, never chosen: plain FP32 matmuls, the reference ``auto`` compares 16-bit speed with."""
    return ("fp32",) if family == "matmul" else ()


def _measure(dtype: torch.dtype, timer: Timer) -> KernelPlan:
    choices: dict[str, str] = {}
    timings: dict[str, dict[str, float]] = {}
    for family in FAMILIES:
        candidates = _candidates(dtype, family)
        timed = candidates + _timed(family)
        for candidate in timed:  # warm-up: first calls build kernels and caches
            timer(family, candidate)
        best = {c: timer(family, c) for c in timed}
        for _ in range(2):
            fastest = min(best.values())
            for candidate in [c for c in timed if best[c] <= _SLOWER_TO_DROP * fastest]:
                best[candidate] = min(best[candidate], timer(family, candidate))
        choices[family] = min(candidates, key=lambda c: best[c])
        timings[family] = {c: round(best[c], 3) for c in timed}
    return KernelPlan(dtype, choices, timings, "measured")


# -- the per-machine cache ---------------------------------------------------------------------------


def machine_key(dtype: torch.dtype) -> str:
    """What a measurement is valid for: CPU model, torch version, threads, dtype."""
    return f"{cpu_model()} | torch {torch.__version__} | {torch.get_num_threads()} threads | {get_format(dtype).name}"


@functools.cache
def _measured_here(dtype: torch.dtype, cache_dir: str) -> KernelPlan:
    """Once per process and cache folder: regions resolve their plan at every entry."""
    return _cached_or_measured(dtype, Path(cache_dir), _probe_timer(dtype))


def _cached_or_measured(dtype: torch.dtype, cache_dir: Path, timer: Timer) -> KernelPlan:
    path = cache_dir / "kernels.json"
    key = machine_key(dtype)
    entry = read_cache(path, CACHE_VERSION).get(key)
    if _valid_entry(entry) and not _taken_while_busy(entry, timer):
        return KernelPlan(dtype, dict(entry["choices"]), dict(entry.get("timings_ms", {})), f"cached in {path}")
    plan = _measure(dtype, timer)
    store(path, CACHE_VERSION, key, {"choices": plan.choices, "timings_ms": plan.timings_ms})
    return plan


def _taken_while_busy(entry: dict, timer: Timer) -> bool:
    """True when the entry's FP32 matmul took over ``_BUSY`` times as long as one timed now (a few ms): the
    whole probe was then slowed, unevenly. A busy machine now only makes the check pass."""
    cached = entry.get("timings_ms", {}).get("matmul", {}).get("fp32")
    if not isinstance(cached, (int, float)):
        return False
    timer("matmul", "fp32")  # warm-up, as the probe does
    return cached > _BUSY * timer("matmul", "fp32")


def _valid_entry(entry: object) -> bool:
    """An entry as :func:`_write_cache` writes it, to its last figure: anything else (hand-edited, another
    version's) is measured again, never read half-way."""
    if not isinstance(entry, dict) or not isinstance(entry.get("choices"), dict):
        return False
    choices, timings = entry["choices"], entry.get("timings_ms", {})
    if set(choices) != set(FAMILIES) or not all(choices[f] in ("native", "emulated", "gemm") for f in FAMILIES):
        return False
    return isinstance(timings, dict) and all(
        isinstance(figures, dict) and all(_milliseconds(ms) for ms in figures.values()) for figures in timings.values()
    )


def _milliseconds(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


# -- the real probe ----------------------------------------------------------------------------------


def _probe_timer(dtype: torch.dtype) -> Timer:
    """Times one forward + backward of a small, typical op of each family under each candidate."""
    work: dict[str, Callable[[], torch.Tensor]] = {}

    def build() -> None:  # on first use only: a cache hit times (and allocates for) the FP32 matmul alone
        generator = torch.Generator().manual_seed(0)

        def leaf(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=generator).requires_grad_()

        x, w = leaf(256, 512), leaf(512, 512)
        image, kernel = leaf(16, 32, 16, 16), leaf(32, 32, 3, 3)
        q, k, v = (leaf(8, 6, 256, 64) for _ in range(3))  # a small GPT's layer: where GEMM attention pays off
        work["matmul"] = lambda: F.linear(x, w)
        work["conv"] = lambda: F.conv2d(image, kernel, padding=1)
        work["attention"] = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def run(family: str, candidate: str) -> float:
        # The first region of a dtype may be entered under no_grad or inference mode (an evaluation loop): the
        # leaves and the backward need autograd too, not only the timed forward.
        with torch.inference_mode(False), torch.enable_grad():
            if not work:
                build()
            start = time.perf_counter()
            with _region(dtype, candidate):
                out = work[family]()
            out.float().sum().backward()
        return (time.perf_counter() - start) * 1e3

    return run


@contextlib.contextmanager
def _region(dtype: torch.dtype, candidate: str):
    # Whatever region the caller is in (inference mode, no_grad, an outer autocast), time the op as training runs it.
    with torch.inference_mode(False), torch.enable_grad(), torch.autocast("cpu", enabled=False):
        if candidate == "fp32":
            yield
        elif candidate == "emulated":
            with EmulatedAutocast(dtype):
                yield
        elif candidate == "gemm":
            with torch.autocast("cpu", dtype=dtype), GemmAttention():
                yield
        else:
            with torch.autocast("cpu", dtype=dtype):
                yield
