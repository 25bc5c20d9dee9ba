"""Print the README's benchmark tables (Markdown) from benchmarks/results/bench_*.json."""

import json
from pathlib import Path

RESULTS = Path(__file__).parent / "results"


def load(suite: str) -> dict | None:
    path = RESULTS / f"bench_{suite}.json"
    return json.loads(path.read_text()) if path.is_file() else None


def table(headers: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def main() -> None:
    step = load("step")
    if step:
        print(
            f"Step time (forward + backward + AdamW), median of interleaved repeats; {step['machine']['cpu']}, "
            f"torch {step['machine']['torch']}, {step['machine']['torch_threads']} threads:\n"
        )
        rows = [
            [r["model"], r["mode"], f"{r['median_ms']:.1f}", ratio(r["vs_fp32"]), ratio(r["overhead_vs_torch"])]
            for r in step["records"]
        ]
        print(table(["model", "mode", "ms/step", "time vs fp32", "vs same torch loop"], rows), "\n")
    memory = load("memory")
    if memory:
        rows = [
            [
                r["model"],
                r["policy"],
                f"{r['state_bytes_per_param']:.1f}",
                ratio(r["activations_vs_fp32"]),
                "-" if r["peak_rss_bytes"] is None else f"{r['peak_rss_bytes'] / 2**20:.0f} MB",
                ratio(r["rss_vs_fp32"]),
            ]
            for r in memory["records"]
        ]
        print(
            table(["model", "policy", "model state B/param", "saved activations vs fp32", "peak RSS", "vs fp32"], rows),
            "\n",
        )
    accuracy = load("accuracy")
    if accuracy:
        rows = [
            [
                r["task"],
                r["policy"],
                f"{r['mean']:.4f}",
                f"{r['spread']:.4f}",
                str(r["seeds"]),
                f"{r.get('vs_fp32', 0.0):+.4f}",
            ]
            for r in accuracy["records"]["summary"]
        ]
        print(table(["task", "policy", "mean (accuracy / val loss)", "seed spread", "seeds", "vs fp32"], rows), "\n")
    gemm = load("gemm")
    if gemm:
        rows = [
            [str(r["n"]), r["dtype"], f"{r['gflops']:.0f}", ratio(r["vs_fp32"]), f"{100 * r['of_best_measured']:.0f}%"]
            for r in gemm["records"]
        ]
        print(table(["n", "dtype", "GFLOP/s", "vs fp32", "of best measured"], rows))


if __name__ == "__main__":
    main()
