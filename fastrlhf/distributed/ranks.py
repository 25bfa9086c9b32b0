"""This process's place in the run: its rank, the world size, its local rank (leaves of the import graph:
importing this module loads nothing of fastrlhf).

Before the process group exists the launcher's environment (RANK, WORLD_SIZE, LOCAL_RANK) answers.
"""

from __future__ import annotations

import os
import socket

__all__ = ["DEFAULT_TIMEOUT_S", "free_port", "is_main", "local_rank", "rank", "world_size"]

# Long enough for real runs; tests set FASTRLHF_DIST_TIMEOUT to turn a rank mismatch into a quick error.
DEFAULT_TIMEOUT_S = 1800

def free_port() -> int:
    """A TCP port on 127.0.0.1 nobody listens on now (for MASTER_PORT / the launcher's --master_port)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _dist():
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def rank() -> int:
    dist = _dist()
    return dist.get_rank() if dist else int(os.environ.get("RANK", 0))


def world_size() -> int:
    dist = _dist()
    return dist.get_world_size() if dist else int(os.environ.get("WORLD_SIZE", 1))


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", 0))


def is_main() -> bool:
    return rank() == 0
