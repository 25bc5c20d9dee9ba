"""Print the README's benchmark tables (Markdown) from benchmarks/results/bench_*.json."""

import json
from pathlib import Path

from mixprec.app.cli.bench_cmd import accuracy_rows, gemm_rows, memory_rows, step_rows
from mixprec.app.report import markdown_table

RESULTS = Path(__file__).parent / "results"


def load(suite: str) -> dict | None:
    path = RESULTS / f"bench_{suite}.json"
    return json.loads(path.read_text()) if path.is_file() else None


def main() -> None:
    step = load("step")
    if step:
        machine = step["machine"]
        print(
            f"Step time (forward + backward + AdamW), median of interleaved repeats, wall and CPU time; "
            f"{machine['cpu']} ({machine.get('isa', 'ISA not recorded')}), torch {machine['torch']}, "
            f"{machine['torch_threads']} threads:\n"
        )
        print(markdown_table(*step_rows(step["records"])), "\n")
    memory = load("memory")
    if memory:
        print("Model state, saved activations (one forward) and peak RSS (a fresh process, two steps):\n")
        print(markdown_table(*memory_rows(memory["records"])), "\n")
    accuracy = load("accuracy")
    if accuracy:
        print("Accuracy: digits test accuracy over seeds; charlm validation loss:\n")
        print(markdown_table(*accuracy_rows(accuracy["records"]["summary"])), "\n")
    gemm = load("gemm")
    if gemm:
        print("GEMM throughput (n x n x n):\n")
        print(markdown_table(*gemm_rows(gemm["records"])))


if __name__ == "__main__":
    main()
