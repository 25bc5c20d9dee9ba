"""torch.distributed primitives with no policy in them: the world, the found-inf agreement, a DTensor's shard.

FSDP2 and DDP set up per policy, and whole-model checkpoints of sharded runs, are in :mod:`mixprec.parallel`.
"""

from mixprec.distributed.ranks import World, agree_max, barrier, copy_from_main, local, reduce_across_ranks, world

__all__ = ["World", "agree_max", "barrier", "copy_from_main", "local", "reduce_across_ranks", "world"]
