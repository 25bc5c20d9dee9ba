"""What every part shares: the run's settings, a part's result, failures as data, device facts."""

from __future__ import annotations

import gc
import math
import re
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

__all__ = [
    "Part",
    "Settings",
    "Stopped",
    "bf16_peak_flops",
    "describe",
    "device_slug",
    "free_memory",
    "log",
    "sync",
]


class Stopped(BaseException):
    """The command was told to stop (SIGTERM: the GPU machine's time limit, say). A BaseException, so that
    a part's own per-case handling does not take it for a failed case and go on."""


@dataclass(frozen=True)
class Settings:
    """One invocation: the device the parts run on, whether at tiny CPU sizes, where results go."""

    device: torch.device
    dry_run: bool
    out_dir: Path
    repo: Path
    compile_budget_s: float = 100.0  # the bert, gpt and gpt2 parts each stop compiling more modes past this
    tests_timeout_s: float = 480.0
    deadline: float | None = None  # time.monotonic() by which the command must be done (None: no limit)

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def seconds_left(self) -> float:
        return math.inf if self.deadline is None else self.deadline - time.monotonic()


@dataclass
class Part:
    """A part's outcome: ``ok``, ``failed`` (it raised, or a case did) or ``skipped`` (with the reason).

    ``records`` are its measurements, one dict per case; a case that raised carries ``error`` instead of
    figures. ``not_run`` lists cases left out on purpose, each with the reason.
    """

    name: str
    status: str = "ok"
    reason: str | None = None
    error: dict | None = None
    seconds: float = 0.0
    meta: dict = field(default_factory=dict)
    records: list[dict] = field(default_factory=list)
    not_run: list[dict] = field(default_factory=list)
    # called after each case and each left-out case, to save what the part has so far (a command killed
    # in the middle of a part still leaves its finished cases on disk)
    on_progress: Callable[[Part], None] | None = field(default=None, repr=False, compare=False)

    def skip(self, reason: str) -> None:
        self.status, self.reason = "skipped", reason

    def progress(self) -> None:
        if self.on_progress is not None:
            self.on_progress(self)

    def leave_out(self, case: str, reason: str) -> None:
        self.not_run.append({"case": case, "reason": reason})
        log(f"  {case}: not run ({reason})")
        self.progress()

    def attempt(self, label: dict, action: Callable[[], object]) -> object | None:
        """``action()``, or None after recording its error against ``label`` (a failing case is a finding)."""
        try:
            return action()
        except Exception as error:
            self.records.append({**label, "error": describe(error)})
            log(f"  {_label(label)}: FAILED {type(error).__name__}: {str(error)[:300]}")
            free_memory()
            self.progress()
            return None

    def case(self, label: dict, measure: Callable[[], dict]) -> dict | None:
        """Run one case; its figures (or its error) become a record. Returns the figures, or None."""
        start = time.perf_counter()
        figures = self.attempt(label, measure)
        if figures is not None:
            self.records.append({**label, **figures})
            log(f"  {_label(label)}: done in {time.perf_counter() - start:.1f} s")
            self.progress()
        return figures

    def settle(self) -> None:
        """A part whose cases raised has failed, though it ran to the end."""
        failed = [r for r in self.records if "error" in r]
        if failed and self.status == "ok":
            self.status = "failed"
            self.reason = f"{len(failed)} of {len(self.records)} cases failed"

    def to_json(self) -> dict:
        return {
            "part": self.name,
            "status": self.status,
            "reason": self.reason,
            "error": self.error,
            "seconds": round(self.seconds, 2),
            "meta": self.meta,
            "records": self.records,
            "not_run": self.not_run,
        }


def _label(label: dict) -> str:
    return " ".join(f"{value}" for value in label.values())


def describe(error: BaseException) -> dict:
    """An exception as data: type, message and the innermost frames (where to start fixing)."""
    frames = traceback.extract_tb(error.__traceback__)[-4:]
    return {
        "type": type(error).__name__,
        "message": str(error)[:2000],
        "where": [f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in frames],
    }


def log(message: str) -> None:
    print(f"[gpu_check] {message}", flush=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # host sync: timings and memory figures need the queued work done


def free_memory() -> None:
    """Give the device's cached blocks back once a case's tensors are gone (cycles too: models hold some)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def device_slug(settings: Settings) -> str:
    """The results folder's name: the device's name in lower case and dashes; ``cpu-dry-run`` on the dry run."""
    if settings.dry_run:
        return "cpu-dry-run"
    name = torch.cuda.get_device_name(settings.device)
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


# Dense (no sparsity) bf16 tensor-core peaks from NVIDIA's data sheets, FLOP/s. First match wins, so the
# specific names come before the general ones; a device not listed gets no MFU (and says so).
_BF16_PEAKS = (
    ("GH200", 989e12),
    ("H200", 989e12),
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989e12),  # SXM5 ("NVIDIA H100 80GB HBM3")
    ("A100", 312e12),
)


def bf16_peak_flops(device_name: str) -> tuple[float | None, str]:
    """The dense bf16 peak of a device by name, and where it came from (or why there is none)."""
    for key, peak in _BF16_PEAKS:
        if key.lower() in device_name.lower():
            return peak, f"{device_name!r} matched {key!r}: dense bf16 peak {peak / 1e12:.0f} TFLOP/s"
    known = ", ".join(key for key, _ in _BF16_PEAKS)
    return None, f"no dense bf16 peak known for {device_name!r} (known: {known}); MFU omitted"
