"""``fastrlhf.hostmem``: glibc's mmap threshold fixed for CPU training processes (each check in a
fresh interpreter: the setting is process-wide)."""

import json
import subprocess
import sys

import pytest

from fastrlhf.hostmem import MMAP_THRESHOLD_BYTES, configure_cpu_heap, mmap_threshold_set_by_user

# Allocates and frees 8 MiB twice with malloc, reports how many of the two glibc served by mmap
# (mallinfo2's hblkhd) and whether the process's resident size went back down after each free.
PROBE = r"""
import ctypes, json, sys
from fastrlhf.hostmem import configure_cpu_heap
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]

class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                "fsmblks", "uordblks", "fordblks", "keepcost")]

libc.mallinfo2.restype = Info
configured = configure_cpu_heap() if sys.argv[1] == "configure" else None
mmapped = 0
for _ in range(2):
    before = libc.mallinfo2().hblkhd
    p = libc.malloc(8 << 20)
    libc.memset(p, 1, 8 << 20)
    mmapped += libc.mallinfo2().hblkhd - before >= 8 << 20
    libc.free(p)
print(json.dumps({"configured": configured, "mmapped": mmapped}))
"""


def _probe(mode, **env):
    import os

    environ = {k: v for k, v in os.environ.items() if k not in ("MALLOC_MMAP_THRESHOLD_", "GLIBC_TUNABLES")}
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True,
                         env={**environ, **env}, timeout=60)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _glibc() -> bool:
    import ctypes

    try:
        ctypes.CDLL(None).gnu_get_libc_version  # noqa: B018
    except AttributeError:
        return False
    return sys.platform.startswith("linux")


needs_glibc = pytest.mark.skipif(not _glibc(), reason="glibc's malloc only")


@needs_glibc
def test_default_glibc_moves_large_blocks_onto_the_heap_after_the_first_free():
    # The dynamic threshold: the first 8 MiB block is mmapped, its free raises the threshold to 8 MiB,
    # so the second lands on the heap (and stays resident after its free).
    assert _probe("default") == {"configured": None, "mmapped": 1}


@needs_glibc
def test_configured_process_mmaps_every_large_block():
    assert MMAP_THRESHOLD_BYTES == 4 << 20
    assert _probe("configure") == {"configured": True, "mmapped": 2}


@needs_glibc
def test_a_threshold_the_user_set_is_left_alone():
    assert _probe("configure", MALLOC_MMAP_THRESHOLD_="67108864") == {"configured": False, "mmapped": 0}
    assert _probe("configure", GLIBC_TUNABLES="glibc.malloc.mmap_threshold=67108864") == \
        {"configured": False, "mmapped": 0}


def test_user_setting_detection_and_bad_threshold():
    assert not mmap_threshold_set_by_user({})
    assert not mmap_threshold_set_by_user({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"})
    assert mmap_threshold_set_by_user({"MALLOC_MMAP_THRESHOLD_": "1"})
    assert mmap_threshold_set_by_user({"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=1"})
    assert configure_cpu_heap(environ={"MALLOC_MMAP_THRESHOLD_": "1"}) is False
    with pytest.raises(ValueError, match="positive int"):
        configure_cpu_heap(0)
