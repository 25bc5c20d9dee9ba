"""Functions that torch calls back from eager code, kept from being compiled as frames of their own.

While a compiled model runs, the code dynamo does not trace (a frame it skips, a call it cannot trace) runs under
its frame hook, which compiles each Python function called from there as a frame of its own: a TorchFunctionMode's
``__torch_function__`` for each op, a saved-tensor hook for each tensor saved for backward. A region's are then
compiled anew per op and per tensor's metadata until dynamo's recompile limit (8 per function; then its
warning): seconds of compiling graphs of one op, measured in a Hugging Face GPT-2 under emulated fp16 with
``torch_compile`` and gradient checkpointing (8 recompiles of the emulation's saved-tensor hook). Marked here,
such a call runs eagerly, as the code that called it does. Where dynamo traces a model it still inlines them:
the mark is on frames that run, not on calls it traces (torch.compile's tests of every policy, test_compile.py).

Uses dynamo's per-code frame strategy (``torch._dynamo.eval_frame.set_code_exec_strategy``, private: where a
torch version lacks it, nothing is marked and only compile time is lost). Applied at a region's first eager entry
after dynamo is imported (importing it costs 1.4 s of a start: a process that never compiles never pays).
"""

from __future__ import annotations

import sys
from collections.abc import Callable

__all__ = ["keep_out_of_compiled_frames", "run_eagerly_when_called_back"]

_CALLED_BACK: list[Callable] = []
_marked = [False]


def run_eagerly_when_called_back(function: Callable) -> Callable:
    """Decorator: ``function`` (called back by torch from eager code) is never compiled as a frame of its own."""
    _CALLED_BACK.append(function)
    return function


def keep_out_of_compiled_frames() -> None:
    """Mark the registered functions, once dynamo is imported (a dictionary lookup until then)."""
    if _marked[0] or "torch._dynamo" not in sys.modules:
        return
    _marked[0] = True
    try:  # private: another torch version may name or shape it otherwise
        from torch._dynamo.eval_frame import set_code_exec_strategy
        from torch._dynamo.types import FrameAction, FrameExecStrategy

        # SKIP for the frame and what it calls: the op it runs is the eager code's own
        skip = FrameExecStrategy(FrameAction.SKIP, FrameAction.SKIP)
        for function in _CALLED_BACK:
            set_code_exec_strategy(function.__code__, skip)
    except (ImportError, AttributeError, TypeError):
        return
