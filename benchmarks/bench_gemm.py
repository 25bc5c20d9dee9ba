"""The 'gemm' benchmark suite (see mixprec.app.bench.suites); same as `mixprec bench --suite gemm`.

    python benchmarks/bench_gemm.py [--models mlp,cnn,gpt] [--policies ...] [--repeats 7] [--quick]

Results go to benchmarks/results/bench_gemm.json with the machine and the command.
"""

import sys

from mixprec.app.cli.main import main

sys.exit(main(["bench", "--suite", "gemm", *sys.argv[1:]]))
