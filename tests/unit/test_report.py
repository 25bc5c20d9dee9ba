import math
from pathlib import Path

import pytest

from mixprec.app.report import markdown_table, plot_compare, plot_run, write_compare_report, write_run_report

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
SKIPPED = [7, 8, 30]


def synthetic_history(skipped=SKIPPED, nan_at=20, metric="accuracy"):
    """50 train records (one per step), 3 skipped steps that halve the scale, a NaN loss, 5 evals."""
    history, scale = [], 1024.0
    for step in range(1, 51):
        skipped_at = [step] if step in skipped else []
        scale = scale / 2 if skipped_at else scale
        loss = math.nan if step == nan_at else 3.0 * math.exp(-step / 20)
        history.append(
            {
                "kind": "train",
                "step": step,
                "epoch": step // 25,
                "loss": loss,
                "scale": scale,
                "skipped_steps": sum(s <= step for s in skipped),
                "skipped_at": skipped_at,
                "samples_per_s": 1000.0,
                "ms_per_step": 12.5,
                "lr": 1e-3,
                "time": step * 0.0125,
            }
        )
        if step % 10 == 0:
            record = {"kind": "eval", "step": step, "loss": 3.2 * math.exp(-step / 20)}
            if metric:
                record[metric] = 0.5 + step / 120
            history.append(record)
    return history


def assert_png(path: Path):
    assert path.is_file()
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE
    assert len(data) > 5_000


def test_plot_run_writes_three_pngs(tmp_path):
    written = plot_run(synthetic_history(), tmp_path / "plots", "tiny run", "accuracy")
    assert [p.name for p in written] == ["loss.png", "metric.png", "scale.png"]
    for path in written:
        assert_png(path)


def test_plot_run_without_metric_writes_no_metric_png(tmp_path):
    written = plot_run(synthetic_history(), tmp_path, "tiny run", None)
    assert [p.name for p in written] == ["loss.png", "scale.png"]
    assert not (tmp_path / "metric.png").exists()


def test_plot_run_skips_metric_the_evals_do_not_have(tmp_path):
    written = plot_run(synthetic_history(metric=None), tmp_path, "tiny run", "accuracy")
    assert [p.name for p in written] == ["loss.png", "scale.png"]


def test_plot_run_survives_inf_and_negative_losses(tmp_path):
    history = synthetic_history()
    history[3]["loss"] = math.inf
    history[5]["loss"] = -1.0  # not all positive: linear y axis
    written = plot_run(history, tmp_path, "odd losses", "accuracy")
    assert [p.name for p in written] == ["loss.png", "metric.png", "scale.png"]  # none silently dropped
    for path in written:
        assert_png(path)


def test_plot_compare_two_policies(tmp_path):
    histories = {"fp16": synthetic_history(), "bf16": synthetic_history(skipped=[], nan_at=None)}
    written = plot_compare(histories, tmp_path, "fp16 vs bf16", "accuracy")
    assert [p.name for p in written] == ["compare_loss.png", "compare_metric.png", "compare_scale.png"]
    for path in written:
        assert_png(path)


def test_bad_input_names_the_argument(tmp_path):
    with pytest.raises(ValueError, match="histories"):
        plot_compare({}, tmp_path, "nothing", None)
    with pytest.raises(ValueError, match=r"history\[1\]"):
        plot_run([synthetic_history()[0], {"loss": 1.0}], tmp_path, "broken", None)
    with pytest.raises(ValueError, match=r"rows\[0\]"):
        markdown_table(["a", "b"], [["1"]])


def test_markdown_table_format():
    table = markdown_table(["policy", "loss"], [["fp16", "0.25"], ["a|b", "1"]])
    assert table == "| policy | loss |\n| --- | --- |\n| fp16 | 0.25 |\n| a\\|b | 1 |"


def assert_links_resolve(report: Path, plots: list[Path]):
    text = report.read_text()
    for plot in plots:
        link = f"![{plot.stem}]({plot.relative_to(report.parent).as_posix()})"
        assert link in text
        assert (report.parent / plot.relative_to(report.parent)).is_file()


def test_run_report(tmp_path):
    plots = plot_run(synthetic_history(), tmp_path / "plots", "tiny run", "accuracy")
    report = write_run_report(
        tmp_path / "report.md",
        title="Tiny run",
        config={"task": "mnist", "steps": 50},
        machine={"device": "cpu", "torch": "2.13"},
        policy="fp16-mixed",
        policy_reason="fastest on this GPU with stable loss",
        results={"final loss": 0.123456789, "accuracy": 0.98765, "skipped steps": 3},
        plots=plots,
    )
    text = report.read_text()
    assert text.startswith("# Tiny run\n")
    for heading in ["## Configuration", "## Machine", "## Policy", "## Results", "## Plots"]:
        assert heading in text
    assert "`fp16-mixed`" in text and "fastest on this GPU" in text
    assert "| task | mnist |" in text and "| device | cpu |" in text
    assert "| final loss | 0.1235 |" in text and "| skipped steps | 3 |" in text
    assert "![loss](plots/loss.png)" in text
    assert_links_resolve(report, plots)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary left behind


def test_compare_report(tmp_path):
    histories = {"fp16": synthetic_history(), "bf16": synthetic_history(skipped=[])}
    plots = plot_compare(histories, tmp_path, "compare", "accuracy")
    report = write_compare_report(
        tmp_path / "compare.md",
        title="fp16 vs bf16",
        config={"task": "mnist"},
        machine={"device": "cpu"},
        headers=["policy", "final loss", "skipped"],
        rows=[["fp16", "0.12", "3"], ["bf16", "0.13", "0"]],
        notes=["bf16 needs no loss scaling", "fp16 skipped 3 steps"],
        plots=plots,
    )
    text = report.read_text()
    for heading in ["# fp16 vs bf16", "## Configuration", "## Machine", "## Results", "## Plots"]:
        assert heading in text
    assert "| policy | final loss | skipped |" in text
    assert "| fp16 | 0.12 | 3 |" in text and "| bf16 | 0.13 | 0 |" in text
    assert "- bf16 needs no loss scaling" in text and "- fp16 skipped 3 steps" in text
    assert text.index("## Results") < text.index("- fp16 skipped") < text.index("## Plots")
    assert_links_resolve(report, plots)
