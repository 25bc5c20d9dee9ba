"""Data parallelism under a precision policy: FSDP2 units and their MixedPrecisionPolicy, DDP with FP32
gradient averaging, whole-model state of sharded runs.
"""

from mixprec.parallel.ddp import fp32_allreduce_hook, wrap_ddp
from mixprec.parallel.fsdp import fsdp_policy, fully_shard, is_sharded, sharded_with
from mixprec.parallel.state import gather_state, scatter_state

__all__ = [
    "fp32_allreduce_hook",
    "fsdp_policy",
    "fully_shard",
    "gather_state",
    "is_sharded",
    "scatter_state",
    "sharded_with",
    "wrap_ddp",
]
