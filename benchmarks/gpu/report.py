"""The results folder: ``gpu_check.json`` (every part run on this device, newest run of each) and
``summary.md`` (the same as tables), rewritten after each part so that runs in several commands
(``--parts tests`` then ``--parts gpt`` ...) add up to one record."""

from __future__ import annotations

import json
import os
from pathlib import Path

__all__ = ["load", "save", "summary"]

# per part: (record key, column header); a record without the key shows "-"
COLUMNS = {
    "tests": [("tests", "cases"), ("passed", "passed"), ("failures", "failed"), ("errors", "errors"),
              ("skipped", "skipped"), ("exit_code", "pytest exit")],
    "syncs": [("model", "model"), ("policy", "policy"), ("optimizer", "optimizer"), ("syncs_per_step", "syncs/step"),
              ("goal", "goal"),
              ("meets_goal", "meets goal"),
              ("profiled_blocking_calls_per_step", "profiler: blocking calls/step"),
              ("skipped_steps", "skipped steps"), ("sites", "where")],
    "gpt": [("mode", "mode"), ("median_ms", "ms/step"), ("spread_ms", "spread"), ("tokens_per_s", "tokens/s"),
            ("mfu", "MFU"), ("mfu_with_attention", "MFU w/ attention"), ("vs_torch_fp32", "vs torch fp32"),
            ("vs_twin", "vs torch loop"), ("vs_o2_bf16", "vs o2_bf16"), ("peak_memory_mb", "peak MB"),
            ("first_call_s", "first call s"), ("host_ms_per_step", "host ms/step"),
            ("kernels_per_step", "kernels/step"), ("compute_plan", "compute")],
    "fp8": [("case", "case"), ("pair", "operands"), ("shape", "MxKxN"), ("kernel_ran", "kernel ran"),
            ("kernel_equals_emulation", "kernel == emulation"), ("kernel_error_over_bound", "kernel error / bound"),
            ("emulation_error_over_bound", "emulation error / bound"),
            ("mixprec_kernel_path_equals_kernel", "mixprec path == kernel"),
            ("fast_accum_error_over_bound", "fast accum error / bound"),
            ("n", "n"), ("dtype", "dtype"), ("tflops", "TFLOP/s"), ("vs_bf16", "vs bf16")],
    "bert": [("phase", "phase"), ("batch", "batch"), ("mode", "precision"), ("median_ms", "ms"),
             ("samples_per_s", "samples/s"), ("speedup_vs_fp32", "vs fp32"), ("vs_torch_loop", "vs torch loop"),
             ("peak_memory_mb", "peak MB"), ("host_ms_per_step", "host ms/step"),
             ("kernels_per_step", "kernels/step")],
}  # fmt: skip
COLUMNS["gpt2"] = COLUMNS["fp8gpt"] = COLUMNS["gpt"]
COLUMNS["tuned"] = [("mode", "policy tried"), ("median_ms", "ms/step"), ("spread_ms", "spread"),
                    ("predicted", "predicted speed-up (layers)"), ("measured", "measured speed-up"),
                    ("note", "tune's note")]  # fmt: skip


def load(path: Path) -> dict:
    """The folder's earlier results, or an empty record (an unreadable file is replaced, and says so)."""
    if not path.exists():
        return {"parts": {}}
    try:
        found = json.loads(path.read_text())
        return found if isinstance(found.get("parts"), dict) else {"parts": {}}
    except (json.JSONDecodeError, AttributeError) as error:
        print(f"[gpu_check] {path} was unreadable ({error}); starting it afresh", flush=True)
        return {"parts": {}}


def save(folder: Path, results: dict) -> None:
    """Both files, each written whole to a temporary name and renamed: a command stopped in the middle
    leaves the previous version, never half a file."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in (("gpu_check.json", json.dumps(results, indent=2, default=str) + "\n"),
                       ("summary.md", summary(results))):  # fmt: skip
        partial = folder / f".{name}.partial"
        partial.write_text(text)
        os.replace(partial, folder / name)


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "**no**"
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, list):
        return "<br>".join(map(str, value)) or "-"
    return str(value).replace("|", "/")


def _table(records: list[dict], columns: list[tuple[str, str]]) -> list[str]:
    used = [(key, head) for key, head in columns if any(key in r for r in records)]
    if not records or not used:
        return []
    lines = ["| " + " | ".join(head for _, head in used) + " |", "|" + " --- |" * len(used)]
    lines += ["| " + " | ".join(_cell(r.get(key)) for key, _ in used) + " |" for r in records]
    return [*lines, ""]


def _part(name: str, part: dict) -> list[str]:
    lines = [f"## {name}: {part['status']} ({part['seconds']:.1f} s, torch {part.get('torch', '?')})", ""]
    if part.get("reason"):
        lines += [f"Reason: {part['reason']}", ""]
    if part.get("error"):
        error = part["error"]
        lines += [f"Error: `{error['type']}: {error['message'][:500]}` at {' <- '.join(reversed(error['where']))}", ""]
    hidden = {"output_tail", "prepared"} if part["records"] else {"output_tail"}  # prepared: in the records too
    meta = {k: v for k, v in part.get("meta", {}).items() if k not in hidden}
    lines += [f"- {key}: {value}" for key, value in meta.items()] + ([""] if meta else [])
    good = [r for r in part["records"] if "error" not in r]
    lines += _table(good, COLUMNS.get(name, []))
    for record in (r for r in good if r.get("top_kernels")):
        kernels = "; ".join(f"{k['kernel'][:60]} {k['ms']} ms x{k['launches']}" for k in record["top_kernels"][:4])
        lines.append(f"- {record['mode']}, most GPU time: {kernels}")
    for record in (r for r in good if r.get("beyond_twin")):
        extra = "; ".join(
            f"{k['kernel'][:60]} {k['extra_ms']:+} ms {k['extra_launches']:+}x" for k in record["beyond_twin"][:5]
        )
        lines.append(f"- {record['mode']}, beyond its hand-written twin: {extra}")
    for record in good:
        if record.get("failing") or record.get("skip_reasons"):
            lines += [f"- {line}" for line in record.get("failing", [])]
            lines += [f"- skipped x{n}: {reason}" for reason, n in record.get("skip_reasons", {}).items()] + [""]
    for record in (r for r in part["records"] if "error" in r):
        label = ", ".join(f"{k}={v}" for k, v in record.items() if k != "error")
        error = record["error"]
        lines.append(f"- FAILED {label}: `{error['type']}: {error['message'][:300]}` at {error['where'][-1:]}")
    lines += [f"- not run: {n['case']}: {n['reason']}" for n in part.get("not_run", [])]
    return [*lines, ""]


def summary(results: dict) -> str:
    machine = results.get("machine", {})
    lines = [f"# GPU check: {results.get('device', '?')}", ""]
    versions = f"torch {machine.get('torch')}, CUDA {machine.get('cuda_runtime')}, Python {machine.get('python')}"
    lines += [
        f"{versions}, mixprec {machine.get('mixprec')}; written by `bash scripts/gpu_check.sh` (docs/gpu.md).",
        "",
    ]
    if results.get("dry_run"):
        lines += ["Dry run: tiny sizes on a CPU. Its figures show that the code runs, not how fast anything is.", ""]
    lines += ["| part | status | seconds | ran at | reason |", "| --- | --- | --- | --- | --- |"]
    for name, part in results["parts"].items():
        lines.append(f"| {name} | {part['status']} | {part['seconds']:.1f} | {part.get('ran_at', '-')} | "
                     f"{_cell(part.get('reason'))} |")  # fmt: skip
    lines.append("")
    for name, part in results["parts"].items():
        lines += _part(name, part)
    return "\n".join(lines)
