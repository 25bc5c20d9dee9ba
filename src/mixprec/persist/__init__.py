"""Training state on disk: nested state as safetensors plus a JSON skeleton (nothing pickled, so loading
executes no code), one file written atomically and read back verified against its SHA-256.

Used by mixprec's own checkpoints (:mod:`mixprec.app.checkpoint`) and by the integrations' state files.
"""

from mixprec.persist.serialize import flatten, unflatten
from mixprec.persist.state_file import (
    CheckpointError,
    encode_checkpoint,
    fsync_directory,
    read_checkpoint_file,
    write_atomically,
)

__all__ = [
    "CheckpointError",
    "encode_checkpoint",
    "flatten",
    "fsync_directory",
    "read_checkpoint_file",
    "unflatten",
    "write_atomically",
]
