"""The process group and its collectives.

- ``ranks``: rank, world size, local rank (before and after the group exists);
- ``launch``: joining the group once, with a timeout, under any launcher;
- ``comm``: every reduction fastrlhf makes itself, placed for NCCL as for gloo;
- ``multinode``: the start gate and shared-folder check of a run on several nodes.

Imports torch (``torch.distributed``) and nothing of fastrlhf outside this package; DeepSpeed only
when the group is joined. ``from fastrlhf import distributed as D`` gives the rank helpers and
``D.init_distributed``.
"""

from fastrlhf.distributed.launch import DEFAULT_TIMEOUT_S, init_distributed
from fastrlhf.distributed.ranks import free_port, is_main, local_rank, rank, world_size

__all__ = ["DEFAULT_TIMEOUT_S", "free_port", "init_distributed", "is_main", "local_rank",
           "rank", "world_size"]
