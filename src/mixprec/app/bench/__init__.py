"""Benchmarks: speed, memory, accuracy and GEMM throughput per policy, measured side by side."""
