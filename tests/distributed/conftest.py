import socket
import time

import pytest
import torch.multiprocessing as mp

WORLD = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def run_gloo_workers():
    """``run(worker, out, seconds)``: ``worker(rank, port, out)`` in 2 spawned processes on a free
    loopback port, killed and failed if they are not done within ``seconds``."""

    def run(worker, out, seconds: float) -> None:
        args = (_free_port(), str(out))
        context = mp.start_processes(worker, args=args, nprocs=WORLD, join=False, start_method="spawn")
        deadline = time.monotonic() + seconds
        while not context.join(timeout=5):
            if time.monotonic() > deadline:
                for process in context.processes:
                    process.kill()
                pytest.fail(f"the {WORLD} gloo workers did not finish within {seconds} s")

    return run
