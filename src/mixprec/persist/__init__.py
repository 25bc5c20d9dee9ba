"""Training state on disk: nested state as safetensors plus a JSON skeleton (nothing pickled, so loading
executes no code), one file written atomically and read back verified against its SHA-256.

What mixprec wrote is told by a marker it owns (:mod:`~mixprec.persist.ownership`): it writes over nothing else.

Used by mixprec's own checkpoints (:mod:`mixprec.app.checkpoint`) and by the integrations' state files.
"""

from mixprec.persist.ownership import (
    COMPARISON,
    DOCTOR_REPORT,
    EXPORT,
    RUN,
    TUNE,
    WRITTEN_BY,
    check_folder,
    check_overwrite,
    claim_folder,
    folder_holds,
    stamped,
)
from mixprec.persist.serialize import flatten, unflatten
from mixprec.persist.state_file import (
    CheckpointError,
    encode_checkpoint,
    fsync_directory,
    read_checkpoint_file,
    write_atomically,
)

__all__ = [
    "COMPARISON",
    "DOCTOR_REPORT",
    "EXPORT",
    "RUN",
    "TUNE",
    "WRITTEN_BY",
    "CheckpointError",
    "check_folder",
    "check_overwrite",
    "claim_folder",
    "encode_checkpoint",
    "flatten",
    "folder_holds",
    "fsync_directory",
    "read_checkpoint_file",
    "stamped",
    "unflatten",
    "write_atomically",
]
