"""Histogram plots: log2 magnitudes per phase against each format's representable range (PNG)."""

from __future__ import annotations

from pathlib import Path

from mixprec.doctor import PHASES, DoctorReport
from mixprec.numerics import get_format

__all__ = ["plot_histograms"]

_COLORS = {"fp16": "tab:red", "bf16": "tab:blue", "fp8_e4m3": "tab:green", "fp8_e5m2": "tab:purple"}


def plot_histograms(report: DoctorReport, path: str | Path) -> Path:
    """One panel per phase: the share of values per binade (all modules), with each format's smallest
    subnormal, smallest normal and largest finite value marked. Returns the written path."""
    import math

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    phases = [p for p in PHASES if report.totals(p) is not None]
    figure, axes = plt.subplots(len(phases) or 1, 1, figsize=(10, 2.8 * max(len(phases), 1)), squeeze=False)
    titles = {"forward": "activations", "backward": "activation gradients", "weight_grad": "weight gradients"}
    for axis, phase in zip(axes[:, 0], phases, strict=False):
        totals = report.totals(phase)
        binades = totals.histogram.binades()
        total = max(totals.histogram.total, 1)
        axis.bar([e for e, _ in binades], [100 * c / total for _, c in binades], width=0.9, color="0.4")
        for i, name in enumerate(report.formats):
            fmt = get_format(name)
            color = _COLORS.get(name, f"C{i}")
            low, normal, high = (math.log2(v) for v in (fmt.min_subnormal, fmt.min_normal, fmt.max))
            axis.axvspan(low, high, color=color, alpha=0.06)
            axis.axvline(low, color=color, linestyle=":", linewidth=1)
            axis.axvline(normal, color=color, linestyle="--", linewidth=1)
            axis.axvline(high, color=color, linestyle="-", linewidth=1, label=f"{name}: 2^{low:.0f} .. 2^{high:.1f}")
        if binades:
            lo = min(e for e, _ in binades)
            hi = max(e for e, _ in binades)
            axis.set_xlim(min(lo, -30) - 2, max(hi, 18) + 2)
        axis.set_title(
            f"{titles[phase]}: {totals.values:,} values, {100 * totals.zeros / max(totals.values, 1):.1f}% zeros"
        )
        axis.set_xlabel("log2 |value|")
        axis.set_ylabel("% of non-zero values")
        axis.legend(fontsize=7, loc="upper left")
    figure.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path
