"""The 'step' benchmark suite (see mixprec.app.bench.suites); same as `mixprec bench --suite step`.

    python benchmarks/bench_step.py [--models mlp,cnn,gpt] [--policies ...] [--repeats 7] [--quick]

Results go to benchmarks/results/bench_step.json with the machine and the command.
"""

import sys

from mixprec.app.cli.main import main

sys.exit(main(["bench", "--suite", "step", *sys.argv[1:]]))
