"""The 'accuracy' benchmark suite (see mixprec.app.bench.suites); same as `mixprec bench --suite accuracy`.

    python benchmarks/bench_accuracy.py [--models mlp,cnn,gpt] [--policies ...] [--repeats 7] [--quick]

Results go to benchmarks/results/bench_accuracy.json with the machine and the command.
"""

import sys

from mixprec.app.cli.main import main

sys.exit(main(["bench", "--suite", "accuracy", *sys.argv[1:]]))
