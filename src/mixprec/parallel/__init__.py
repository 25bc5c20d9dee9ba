"""Data parallelism under a precision policy: FSDP2 units and their MixedPrecisionPolicy, DDP with FP32
gradient averaging, the state of sharded runs, whole or per rank.
"""

from mixprec.parallel.ddp import fp32_allreduce_hook, wrap_ddp
from mixprec.parallel.fsdp import fsdp_policy, fully_shard, is_sharded, sharded_with
from mixprec.parallel.state import gather_state, scatter_state, sharded_state, tied_names, with_tied_names

__all__ = [
    "fp32_allreduce_hook",
    "fsdp_policy",
    "fully_shard",
    "gather_state",
    "is_sharded",
    "scatter_state",
    "sharded_state",
    "sharded_with",
    "tied_names",
    "with_tied_names",
    "wrap_ddp",
]
