"""The GPU check: every claim mixprec makes for GPUs, proved or disproved by one command.

    bash scripts/gpu_check.sh [--dry-run] [--out DIR] [--parts tests,syncs,gpt,fp8,bert]

Parts (each catches its own failure, records it, and the next part runs):
    tests   the test suite's CUDA cases (pytest -k cuda): pass/fail/skip counts
    syncs   host syncs per steady-state MixedPrecision step, per policy and optimizer
    gpt     a GPT-2-sized model's step time, tokens/s, MFU and peak memory per policy, beside
            hand-written torch.autocast (+ GradScaler) loops, eager and torch.compile'd
    fp8     torch._scaled_mm against mixprec's exact emulation; FP8 GEMM TFLOP/s against bf16
    bert    BERT-base training samples/s and inference sequences/s per precision, batch 1, 8, 64

``--dry-run`` runs every part on the CPU at tiny sizes (CI runs it, so the command cannot rot).
Results: ``gpu_check.json`` and ``summary.md`` under ``benchmarks/results/gpu/<device>/``
(docs/gpu.md). Only torch, transformers and mixprec are used: the GPU machine installs nothing.
"""
