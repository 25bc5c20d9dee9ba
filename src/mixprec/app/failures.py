"""How a run fails other than by a wrong argument: the command's exit status tells the two apart (1, not 2).

Torch-free, so that the command can tell them apart without loading torch for its usage errors.
"""

from __future__ import annotations

__all__ = ["BadBatchError"]


class BadBatchError(ValueError):
    """A batch with NaN or inf in its inputs or loss, under ``BatchChecks(on_bad_batch="stop")``: the run stopped
    on its data, not on an argument (a ValueError, as it was before it had its own class)."""
