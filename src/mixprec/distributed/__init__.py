"""torch.distributed under a precision policy: ranks that agree, FSDP2 and DDP set up per policy."""

from mixprec.distributed.ddp import fp32_allreduce_hook, wrap_ddp
from mixprec.distributed.fsdp import fsdp_policy, fully_shard, is_sharded, sharded_with
from mixprec.distributed.ranks import World, local, world

__all__ = [
    "World",
    "fp32_allreduce_hook",
    "fsdp_policy",
    "fully_shard",
    "is_sharded",
    "local",
    "sharded_with",
    "world",
    "wrap_ddp",
]
