"""The 'memory' benchmark suite (see mixprec.app.bench.suites); same as `mixprec bench --suite memory`.

    python benchmarks/bench_memory.py [--models mlp,cnn,gpt] [--policies ...] [--repeats 7] [--quick]

Results go to benchmarks/results/bench_memory.json with the machine and the command.
"""

import sys

from mixprec.app.cli.main import main

sys.exit(main(["bench", "--suite", "memory", *sys.argv[1:]]))
