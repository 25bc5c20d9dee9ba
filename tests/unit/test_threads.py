"""Regions on two threads at once: what one thread's region does stays on that thread (an inference server's
worker threads, each serving a model under its policy)."""

from __future__ import annotations

import threading

import torch
from torch import nn

import mixprec

EMULATED_FP16 = "base=mixed_fp16,kernels=emulated"  # the fp16 emulation on any CPU


def test_an_fp32_module_on_one_thread_leaves_another_threads_emulation_on():
    torch.manual_seed(0)
    wide = nn.Sequential(nn.Linear(512, 512), nn.Linear(512, 512))  # its FP32 module suspends the emulation
    small = nn.Linear(64, 64)
    x_wide, x_small = torch.randn(256, 512), torch.randn(8, 64)
    with torch.no_grad(), mixprec.autocast(EMULATED_FP16, small):
        expected = small(x_small)  # in fp16's numerics, alone
    with torch.no_grad():
        assert not torch.equal(expected, small(x_small))  # FP32 computes otherwise
    stop, differing, calls = threading.Event(), [], []

    def fp32_module_loop() -> None:
        with torch.no_grad(), mixprec.autocast(f"{EMULATED_FP16},names=1", wide):
            while not stop.is_set():
                wide(x_wide)

    def emulated_loop() -> None:
        with torch.no_grad(), mixprec.autocast(EMULATED_FP16, small):
            for _ in range(300):
                out = small(x_small)
                calls.append(1)
                if not torch.equal(out, expected):
                    differing.append(out)
        stop.set()

    threads = [threading.Thread(target=fp32_module_loop), threading.Thread(target=emulated_loop)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert len(calls) == 300 and not differing, f"{len(differing)} of {len(calls)} calls computed otherwise"
