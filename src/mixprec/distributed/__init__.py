"""torch.distributed under a precision policy: ranks that agree, FSDP2 and DDP set up per policy.

``ranks`` imports nothing from mixprec, so the layers below (``master``) can use it; the rest is
loaded on first use, since it builds on ``policy``.
"""

import importlib

from mixprec.distributed.ranks import World, local, world

_LATER = {
    "fully_shard": "fsdp",
    "fsdp_policy": "fsdp",
    "is_sharded": "fsdp",
    "sharded_with": "fsdp",
    "wrap_ddp": "ddp",
    "fp32_allreduce_hook": "ddp",
}

__all__ = ["World", "local", "world", *_LATER]


def __getattr__(name: str):
    if name in _LATER:
        return getattr(importlib.import_module(f"mixprec.distributed.{_LATER[name]}"), name)
    raise AttributeError(f"module 'mixprec.distributed' has no attribute {name!r}")
