"""Plots and short Markdown reports for training runs, read from the records of ``metrics.jsonl``.

A history is the list of records the trainer writes: ``{"kind": "train", "step", "loss", "scale",
"skipped_steps", "skipped_at", ...}`` every few steps and ``{"kind": "eval", "step", "loss", <metric>}``
after each evaluation. ``plot_run`` draws one run (loss, eval metric, loss scale with the skipped steps
marked); ``plot_compare`` overlays several runs, one line per precision policy. ``write_run_report`` and
``write_compare_report`` put configuration, machine, results and those plots into one Markdown file.

Figures are drawn on ``matplotlib.figure.Figure`` with an Agg canvas, never through pyplot, so no
global backend or figure state is touched and this works headless and inside other programs.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

__all__ = ["markdown_table", "plot_compare", "plot_run", "write_compare_report", "write_run_report"]

FIGSIZE = (7.0, 4.0)
DPI = 110


def _check_history(history: Sequence[Mapping[str, Any]], name: str) -> None:
    for index, record in enumerate(history):
        if not isinstance(record, Mapping) or "kind" not in record or "step" not in record:
            raise ValueError(f"{name}[{index}]: expected a metrics record with 'kind' and 'step', got {record!r:.100}")


def _records(history: Sequence[Mapping[str, Any]], kind: str) -> list[Mapping[str, Any]]:
    return [record for record in history if record["kind"] == kind]


def _series(records: Sequence[Mapping[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """Steps and values of ``key``; inf is dropped (it would wreck the axis limits), NaN stays as a gap."""
    steps, values = [], []
    for record in records:
        value = record.get(key)
        if value is None or math.isinf(value):
            continue
        steps.append(record["step"])
        values.append(float(value))
    return steps, values


def _skipped_points(train: Sequence[Mapping[str, Any]]) -> tuple[list[int], list[float]]:
    """Each skipped step, placed at the loss scale of the record that reported it."""
    steps, scales = [], []
    for record in train:
        for step in record.get("skipped_at", []):
            steps.append(step)
            scales.append(float(record["scale"]))
    return steps, scales


def _skipped_count(train: Sequence[Mapping[str, Any]]) -> int:
    # The cumulative counter also covers skips from before a resume, which skipped_at cannot show.
    if train and "skipped_steps" in train[-1]:
        return int(train[-1]["skipped_steps"])
    return len(_skipped_points(train)[0])


def _new_axes(title: str, ylabel: str) -> tuple[Figure, Axes]:
    figure = Figure(figsize=FIGSIZE, dpi=DPI)
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    axes.set(title=title, xlabel="step", ylabel=ylabel)
    axes.grid(True, alpha=0.3)
    return figure, axes


def _save(figure: Figure, axes: Axes, path: Path) -> Path:
    if axes.get_legend_handles_labels()[0]:
        axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=DPI)
    return path


def _log_y_if_positive(axes: Axes, values: Sequence[float], base: float = 10) -> None:
    finite = [value for value in values if math.isfinite(value)]
    if finite and min(finite) > 0:
        axes.set_yscale("log", base=base)


def _draw_loss(axes: Axes, history: Sequence[Mapping[str, Any]], prefix: str = "") -> list[float]:
    train_steps, train_loss = _series(_records(history, "train"), "loss")
    eval_steps, eval_loss = _series(_records(history, "eval"), "loss")
    (line,) = axes.plot(train_steps, train_loss, linewidth=1.2, label=f"{prefix}train loss")
    if eval_steps:
        axes.plot(eval_steps, eval_loss, "o", color=line.get_color(), label=f"{prefix}eval loss")
    return train_loss + eval_loss


def _draw_metric(axes: Axes, history: Sequence[Mapping[str, Any]], metric: str, label: str | None = None) -> None:
    steps, values = _series(_records(history, "eval"), metric)
    axes.plot(steps, values, "o-", linewidth=1.2, label=label)


def _draw_scale(axes: Axes, history: Sequence[Mapping[str, Any]], label: str, marker_color: str | None) -> list[float]:
    """Loss scale as a step plot, an 'x' at each skipped step (in the line's colour unless given)."""
    train = _records(history, "train")
    steps, scales = _series(train, "scale")
    (line,) = axes.step(steps, scales, where="post", linewidth=1.2, label=label)
    skipped_steps, skipped_scales = _skipped_points(train)
    if skipped_steps:
        color = marker_color or line.get_color()
        marker_label = "skipped step" if marker_color else "_nolegend_"
        axes.plot(skipped_steps, skipped_scales, "x", color=color, markersize=8, mew=2, label=marker_label)
    return scales


def _has_metric(histories: Sequence[Sequence[Mapping[str, Any]]], metric: str | None) -> bool:
    return metric is not None and any(metric in r for history in histories for r in _records(history, "eval"))


def plot_run(history: list[dict], out_dir: Path, title: str, metric: str | None) -> list[Path]:
    """Write ``loss.png``, ``metric.png`` (if the eval records have ``metric``) and ``scale.png``."""
    _check_history(history, "history")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []

    figure, axes = _new_axes(f"{title}: loss", "loss")
    _log_y_if_positive(axes, _draw_loss(axes, history))
    written.append(_save(figure, axes, out_dir / "loss.png"))

    if _has_metric([history], metric):
        figure, axes = _new_axes(f"{title}: eval {metric}", metric)
        _draw_metric(axes, history, metric)
        written.append(_save(figure, axes, out_dir / "metric.png"))

    skipped = _skipped_count(_records(history, "train"))
    figure, axes = _new_axes(f"{title}: loss scale ({skipped} skipped steps)", "loss scale")
    _log_y_if_positive(axes, _draw_scale(axes, history, "loss scale", marker_color="red"), base=2)
    written.append(_save(figure, axes, out_dir / "scale.png"))
    return written


def plot_compare(histories: dict[str, list[dict]], out_dir: Path, title: str, metric: str | None) -> list[Path]:
    """Overlay several runs, one line per policy label: ``compare_loss/metric/scale.png``."""
    if not histories:
        raise ValueError("histories: expected at least one run to compare, got an empty dict")
    for label, history in histories.items():
        _check_history(history, f"histories[{label!r}]")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []

    figure, axes = _new_axes(f"{title}: loss", "loss")
    losses = [loss for label, history in histories.items() for loss in _draw_loss(axes, history, f"{label} ")]
    _log_y_if_positive(axes, losses)
    written.append(_save(figure, axes, out_dir / "compare_loss.png"))

    if _has_metric(list(histories.values()), metric):
        figure, axes = _new_axes(f"{title}: eval {metric}", metric)
        for label, history in histories.items():
            _draw_metric(axes, history, metric, label)
        written.append(_save(figure, axes, out_dir / "compare_metric.png"))

    figure, axes = _new_axes(f"{title}: loss scale (x = skipped step)", "loss scale")
    scales = []
    for label, history in histories.items():
        skipped = _skipped_count(_records(history, "train"))
        scales += _draw_scale(axes, history, f"{label} ({skipped} skipped)", marker_color=None)
    _log_y_if_positive(axes, scales, base=2)
    written.append(_save(figure, axes, out_dir / "compare_scale.png"))
    return written


def _markdown_cell(value: Any) -> str:
    # A '|' would end the cell and a newline the row.
    return str(value).replace("|", r"\|").replace("\n", " ")


def _markdown_row(cells: Sequence[Any]) -> str:
    return "| " + " | ".join(_markdown_cell(cell) for cell in cells) + " |"


def markdown_table(headers: list[str], rows: list[list[str]]) -> str:
    """A GitHub Markdown table: header row, ``---`` rule, one line per row; '|' in cells escaped."""
    if not headers:
        raise ValueError("headers: expected at least one column name, got an empty list")
    for index, row in enumerate(rows):
        if len(row) != len(headers):
            raise ValueError(f"rows[{index}]: expected {len(headers)} cells (one per header), got {len(row)}: {row!r}")
    rule = "| " + " | ".join("---" for _ in headers) + " |"
    return "\n".join([_markdown_row(headers), rule, *(_markdown_row(row) for row in rows)])


def _format_result(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _key_value_table(values: Mapping[str, Any], format_value: Callable[[Any], str] = str) -> str:
    return markdown_table(["key", "value"], [[str(key), format_value(value)] for key, value in values.items()])


def _image_links(plots: Sequence[Path], folder: Path) -> str:
    """One image per line, linked relative to ``folder`` so the report can be moved with its plots."""
    links = []
    for plot in plots:
        target = Path(os.path.relpath(Path(plot).resolve(), folder.resolve())).as_posix()
        links.append(f"![{Path(plot).stem}](<{target}>)" if " " in target else f"![{Path(plot).stem}]({target})")
    return "\n\n".join(links) if links else "_(no plots)_"


def _section(heading: str, body: str) -> str:
    return f"## {heading}\n\n{body}"


def _write_atomically(path: Path, text: str) -> Path:
    """Write to a hidden file in the same folder, then rename: readers never see half a report."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.parent / f".{path.name}.tmp-{os.getpid()}"
    try:
        temporary.write_text(text, encoding="utf-8")
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)
    return path


def _write_report(
    path: Path, title: str, config: Mapping[str, Any], machine: Mapping[str, Any], middle: list[str], plots: list[Path]
) -> Path:
    """Title, Configuration and Machine first, the report's own sections, Plots last."""
    sections = [
        f"# {title}",
        _section("Configuration", _key_value_table(config)),
        _section("Machine", _key_value_table(machine)),
        *middle,
        _section("Plots", _image_links(plots, path.parent)),
    ]
    return _write_atomically(path, "\n\n".join(sections) + "\n")


def write_run_report(
    path: Path,
    *,
    title: str,
    config: dict,
    machine: dict,
    policy: str,
    policy_reason: str,
    results: dict,
    plots: list[Path],
) -> Path:
    """Markdown report of one run: configuration, machine, chosen policy and why, results, plots."""
    policy_section = _section("Policy", f"`{policy}`: {policy_reason}")
    results_section = _section("Results", _key_value_table(results, _format_result))
    return _write_report(Path(path), title, config, machine, [policy_section, results_section], plots)


def write_compare_report(
    path: Path,
    *,
    title: str,
    config: dict,
    machine: dict,
    headers: list[str],
    rows: list[list[str]],
    notes: list[str],
    plots: list[Path],
) -> Path:
    """Markdown report comparing policies: configuration, machine, results table, notes, plots."""
    results = markdown_table(headers, rows)
    if notes:
        results += "\n\n" + "\n".join(f"- {note}" for note in notes)
    return _write_report(Path(path), title, config, machine, [_section("Results", results)], plots)
