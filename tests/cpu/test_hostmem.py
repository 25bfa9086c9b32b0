"""``fastrlhf.cpu.hostmem``: glibc's mmap threshold fixed for CPU training processes (each check in a
fresh interpreter: the setting is process-wide)."""

import json
import subprocess
import sys

import pytest

from fastrlhf.cpu.hostmem import MMAP_THRESHOLD_BYTES, configure_cpu_heap, mmap_threshold_set_by_user

# Allocates and frees 8 MiB twice with malloc, reports how many of the two glibc served by mmap
# (mallinfo2's hblkhd) and whether the process's resident size went back down after each free.
PROBE = r"""
import ctypes, json, sys
from fastrlhf.cpu.hostmem import configure_cpu_heap
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


# Frees 160 MiB of 1 MiB blocks (heap blocks under the 4 MiB threshold), keeping the last block so that
# glibc's automatic trim of the heap's top cannot give them back; reports the resident MiB that
# trim_heap gave back.
TRIM_PROBE = r"""
import ctypes, json
from fastrlhf.cpu.hostmem import configure_cpu_heap, trim_heap
configure_cpu_heap()
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20
blocks = [libc.malloc(1 << 20) for _ in range(161)]
for b in blocks:
    libc.memset(b, 1, 1 << 20)
for b in blocks[:-1]:
    libc.free(b)
before = rss()
trimmed = trim_heap()
print(json.dumps({"trimmed": trimmed, "given_back_mib": before - rss()}))
"""


@needs_glibc
def test_trim_heap_gives_the_pages_of_freed_heap_blocks_back():
    out = subprocess.run([sys.executable, "-c", TRIM_PROBE], capture_output=True, text=True, check=True, timeout=60)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["trimmed"] is True
    assert result["given_back_mib"] > 140, result


@needs_glibc
@pytest.mark.parametrize("frozen_embeddings", [False, True], ids=["trained", "frozen"])
def test_the_heap_is_trimmed_once_per_backward_after_every_layer(monkeypatch, frozen_embeddings):
    import torch

    import fastrlhf.cpu.hostmem as hostmem
    from fastrlhf.modeling.tiny import make_tiny_llama

    model = make_tiny_llama(vocab_size=64, hidden_size=32, num_heads=1).train()
    if frozen_embeddings:  # as under LoRA: nothing flows back into the embeddings, nothing to wait for
        model.get_input_embeddings().requires_grad_(False)
    seen = []

    def trim():  # at the trim, every layer's gradient is there and the embedding's is not yet
        grads = {n: p.grad is not None for n, p in model.named_parameters() if p.requires_grad}
        seen.append((grads.pop("model.embed_tokens.weight", False), all(grads.values())))
        return True

    monkeypatch.setattr(hostmem, "trim_heap", trim)
    assert hostmem.trim_heap_after_backward(model)
    ids = torch.randint(0, 64, (2, 7))
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids).loss.backward()
    assert seen == ([] if frozen_embeddings else [(False, True)] * 2)
