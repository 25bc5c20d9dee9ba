"""The FP8 recipe of a policy: which formats, how tensors are scaled, which layers stay high precision.

    forward     format of a Linear layer's inputs and weights (fp8_e4m3)
    backward    format of the gradients flowing into it: fp8_e5m2 ("hybrid", more range) or fp8_e4m3
    scaling     "current": each tensor is scaled by its own amax, measured just before the cast;
                "delayed": by the amax history of earlier steps (``history`` entries, reduced by
                ``amax`` = "max" or "recent"), as Transformer Engine does; the first call, with no
                history yet, uses the current amax
    margin      extra powers of two of headroom below the format's largest value
    keep        Linear layers left in the policy's compute dtype: name globs, plus "first" and "last"
                for the first and last Linear layers the model's forward pass calls
    gemm        "auto" (PyTorch's FP8 GEMM on CUDA devices that have it, the emulation elsewhere),
                "scaled_mm" (the kernel wherever PyTorch has one, the CPU included) or "emulated"

Scales are powers of two, so scaling is exact and the emulation equals a scaled cast bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["AMAX_REDUCTIONS", "FP8_FORMATS", "GEMM_CHOICES", "SCALINGS", "Fp8Recipe"]

GEMM_CHOICES = ("auto", "emulated", "scaled_mm")
FP8_FORMATS = ("fp8_e4m3", "fp8_e5m2")
SCALINGS = ("current", "delayed")
AMAX_REDUCTIONS = ("max", "recent")
_SEPARATORS = ",+= "


@dataclass(frozen=True)
class Fp8Recipe:
    forward: str = "fp8_e4m3"
    backward: str = "fp8_e5m2"
    scaling: str = "delayed"
    history: int = 16
    amax: str = "max"
    margin: int = 0
    keep: tuple[str, ...] = ()
    gemm: str = "auto"

    def __post_init__(self) -> None:
        for name in ("forward", "backward"):
            value = getattr(self, name)
            if value not in FP8_FORMATS:
                raise ValueError(f"Fp8Recipe({name}=...): received {value!r}; use one of {', '.join(FP8_FORMATS)}.")
        if self.scaling not in SCALINGS:
            raise ValueError(f"Fp8Recipe(scaling=...): received {self.scaling!r}; use one of {', '.join(SCALINGS)}.")
        if self.amax not in AMAX_REDUCTIONS:
            raise ValueError(f"Fp8Recipe(amax=...): received {self.amax!r}; use one of {', '.join(AMAX_REDUCTIONS)}.")
        if self.gemm not in GEMM_CHOICES:
            raise ValueError(f"Fp8Recipe(gemm=...): received {self.gemm!r}; use one of {', '.join(GEMM_CHOICES)}.")
        if not isinstance(self.history, int) or isinstance(self.history, bool) or self.history < 1:
            raise ValueError(f"Fp8Recipe(history=...): received {self.history!r}; use a positive number of steps.")
        if not isinstance(self.margin, int) or isinstance(self.margin, bool) or self.margin < 0:
            raise ValueError(f"Fp8Recipe(margin=...): received {self.margin!r}; use 0 or more powers of two.")
        if isinstance(self.keep, str) or not all(isinstance(k, str) and k.strip() for k in self.keep):
            raise TypeError(f"Fp8Recipe(keep=...) takes a tuple of name globs; received {self.keep!r}.")
        bad = [k for k in self.keep if any(c in k for c in _SEPARATORS)]
        if bad:
            raise ValueError(
                f"Fp8Recipe(keep=...): {bad!r} contain separators of the policy grammar ({_SEPARATORS!r})."
            )
        object.__setattr__(self, "keep", tuple(dict.fromkeys(k.strip() for k in self.keep)))

    @property
    def format_name(self) -> str:
        """ "hybrid" (e4m3 forward, e5m2 gradients) or "e4m3" (both), as the policy grammar spells it."""
        if self.forward == "fp8_e4m3" and self.backward == "fp8_e5m2":
            return "hybrid"
        if self.forward == self.backward:
            return self.forward.removeprefix("fp8_")
        return f"{self.forward.removeprefix('fp8_')}/{self.backward.removeprefix('fp8_')}"
