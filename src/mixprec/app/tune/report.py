"""What a tune found, for people: the front as a plot, and the report in Markdown."""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["plot_front", "report_text"]


def plot_front(result: dict[str, Any], path: Path) -> Path:
    """Predicted speed-up against measured loss change of every candidate; the Pareto front joined, the chosen
    policy ringed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6, 4))
    points = [(c["prediction"]["speedup"], 100 * c["loss_change"], c["accepted"]) for c in result["candidates"]]
    for accepted, colour, label in ((True, "tab:green", "kept"), (False, "tab:red", "refused")):
        chosen = [(s, d) for s, d, a in points if a == accepted and d == d and abs(d) != float("inf")]
        if chosen:
            axes.scatter(*zip(*chosen, strict=True), color=colour, label=label, zorder=3)
    for c in result["candidates"]:
        if c["note"].startswith("uniform") and abs(c["loss_change"]) != float("inf"):
            axes.annotate(c["note"], (c["prediction"]["speedup"], 100 * c["loss_change"]), fontsize=8,
                          textcoords="offset points", xytext=(4, 4))  # fmt: skip
    front = [(c["prediction"]["speedup"], 100 * c["loss_change"]) for c in result["pareto"]]
    if front:
        axes.plot(*zip(*front, strict=True), color="grey", linestyle="--", label="Pareto front")
    best = result["chosen"]["prediction"]["speedup"]
    axes.axvline(best, color="tab:blue", linewidth=0.8, label=f"chosen: {best:.3f}x")
    axes.axhline(100 * result["tolerance"], color="black", linewidth=0.6, label="tolerance")
    scope = result["chosen"]["prediction"]["scope"]
    axes.set_xlabel(f"predicted speed-up against {result['base']} ({scope})")
    axes.set_ylabel("validation loss change (%)")
    axes.set_title(f"mixprec tune {result['task']} on {result['device_profile']['device'] or 'this device'}")
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def report_text(result: dict[str, Any]) -> str:
    """The tune in Markdown: the layers, the candidates, the chosen policy and its verification."""
    lines = [
        f"# mixprec tune {result['task']}",
        "",
        f"Base policy {result['base']}, tolerance {100 * result['tolerance']:.2f}% of its validation loss; "
        f"cost model: {result['device_profile']['source']} ({result['device_profile']['device']}).",
        *([f"Base chosen by --base auto: {result['bases']['why']}."] if "bases" in result else []),
        "",
        *_layer_table(result),
        "",
        *_candidate_table(result),
        "",
        *_chosen_lines(result),
    ]
    if result["fp8_not_tried"]:
        lines += ["", "FP8 not tried:"]
        lines += [f"- {name}: {why}" for name, why in result["fp8_not_tried"].items()]
    for note in result["chosen"]["prediction"]["notes"]:
        lines += ["", f"Note: {note}."]
    check = result["verification"].get("cost_model")
    if check is not None:
        pairs = ", ".join(
            f"{name} {check['predicted_ms'][name]:.2f} / {check['measured_ms'][name]:.2f} ms"
            for name in check["predicted_ms"]
        )
        agrees = "agrees with" if check["ranking_agrees"] else "differs from"
        ratios = ", ".join(
            f"{name} {check['speedup_vs_base_predicted'][name]:.3f}x / {check['speedup_vs_base_measured'][name]:.3f}x"
            for name in check.get("speedup_vs_base_measured", {})
            if name != "base" and name in check["speedup_vs_base_predicted"]
        )
        lines += [
            "",
            f"Cost model, predicted / measured step: {pairs}; its ranking ({' < '.join(check['ranking_predicted'])}) "
            f"{agrees} the measured one ({' < '.join(check['ranking_measured'])}).",
        ]
        if ratios:
            lines.append(f"Speed-up against the base, predicted / measured: {ratios}.")
    return "\n".join(lines) + "\n"


def _layer_table(result: dict[str, Any]) -> list[str]:
    lines = [
        "| layer | shape (GEMM: m x k x n) | ms fp32 / 16-bit / fp8 (/ bf16) | FP8 error | allowed | chosen |",
        "|---|---|---|---|---|---|",
    ]
    for layer in result["layers"]:
        ms = layer["ms"]
        fp8 = f"{ms['fp8']:.3f}" if "fp8" in ms else "-"
        fp8 += f" / {ms['bf16']:.3f}" if "bf16" in ms else ""  # a layer of an fp16 base past its range
        why = "; ".join(f"not {f}: {r}" for f, r in layer["reasons"].items())
        allowed = ", ".join(layer["formats"]) + (f" ({why})" if why else "")
        picked = result["chosen"]["assignment"].get(layer["name"], "16")
        lines.append(
            f"| {layer['name']} | {layer['key']} | "
            f"{ms['fp32']:.3f} / {ms['16']:.3f} / {fp8} | {100 * layer['fp8_error']:.2f}% | {allowed} | {picked} |"
        )
    return lines


def _candidate_table(result: dict[str, Any]) -> list[str]:
    lines = ["| candidate | predicted speed-up | activation memory | loss change | kept |", "|---|---|---|---|---|"]
    for c in result["candidates"]:
        p = c["prediction"]
        lines.append(
            f"| {c['note']} | {p['speedup']:.3f}x | {p['activation_ratio']:.2f}x | {100 * c['loss_change']:+.3f}% "
            f"| {'yes' if c['accepted'] else 'no'} |"
        )
    return lines


def _chosen_lines(result: dict[str, Any]) -> list[str]:
    chosen, verification = result["chosen"], result["verification"]
    verdict = verification["verdict"]
    means = ", ".join(f"{name} {verification[name]['mean']:.4f}" for name in ("chosen", "base", "fp32"))
    return [
        f"Chosen: `{chosen['policy']}`, predicted {chosen['prediction']['speedup']:.3f}x "
        f"{result['base']} ({chosen['prediction']['scope']}), activation memory "
        f"{chosen['prediction']['activation_ratio']:.2f}x.",
        "",
        f"Verification over {len(verification['base']['losses'])} seeds: mean validation loss {means}; change "
        f"{100 * verdict['loss_change']:+.3f}% against the {verdict['reference']} (tolerance "
        f"{100 * result['tolerance']:.2f}%), the base's own seed spread {verdict['base_seed_spread']:.4f}.",
    ]
