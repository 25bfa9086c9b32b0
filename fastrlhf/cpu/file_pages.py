"""Frozen weights that live in a file mapping leave the process's resident memory between uses.

transformers loads a safetensors checkpoint that needs no dtype conversion as views into a private
mapping of the file, so a frozen model nobody writes to (the RL reference, on a CPU) *is* the file's
pages. Once a forward pass has touched them they count in the process's RSS for the rest of the run,
although they are clean page-cache pages: the kernel may drop and re-read them at any time, and the
ranks of a node map the same ones. ``madvise(MADV_DONTNEED)`` after each use takes them out of the
RSS (workload C: the reference's 193 MiB per rank, during the update, where the peak is); the next
pass maps them back from the page cache with minor faults.

Only provably clean file pages are released: page-aligned ranges inside a mapping of a regular file
that has no private (copy-on-write) page. DONTNEED on anonymous memory, or on a page someone wrote
to, would replace its contents by zeros or by the file's, so anything else is left alone. A private
file mapping already depends on its file not being rewritten in place (the kernel drops clean pages
under memory pressure and reads them again), so this adds no condition of its own.
"""

from __future__ import annotations

import bisect
import os
import stat

import torch

from fastrlhf.cpu.hostmem import MADV_DONTNEED, madvise, whole_pages

__all__ = ["FilePages", "file_page_ranges"]



def _file_mappings() -> list[tuple[int, int, int, str]]:
    """This process's mappings of regular files that still are what was mapped, sorted by address."""
    out = []
    try:
        with open("/proc/self/maps") as f:
            lines = f.readlines()
    except OSError:
        return out
    for line in lines:
        parts = line.split(maxsplit=5)
        if len(parts) < 6 or not parts[5].startswith("/") or parts[5].rstrip().endswith("(deleted)"):
            continue  # anonymous, [heap]/[stack], or a file gone since (conservatively left alone)
        path, inode = parts[5].rstrip("\n"), int(parts[4])
        try:
            st = os.stat(path)
        except OSError:
            continue
        if not stat.S_ISREG(st.st_mode) or st.st_ino != inode:
            continue  # /dev/shm and devices are not regular files; a replaced file is not this mapping's
        start, end = (int(x, 16) for x in parts[0].split("-"))
        out.append((start, end, inode, path))
    out.sort()
    return out


def file_page_ranges(tensors) -> list[tuple[int, int, tuple[int, int, int, str]]]:
    """``(start, end, mapping)``: the whole pages of ``tensors`` that lie in mappings of regular files,
    coalesced per mapping. Tensors elsewhere (anonymous memory, a GPU) are not in the list."""
    maps = _file_mappings()
    starts = [m[0] for m in maps]
    spans = []
    for t in tensors:
        if t.device.type != "cpu" or t.numel() == 0 or not t.is_contiguous():
            continue
        lo = t.data_ptr()
        hi = lo + t.numel() * t.element_size()
        i = bisect.bisect_right(starts, lo) - 1
        if i < 0 or hi > maps[i][1]:
            continue
        a, b = whole_pages(lo, hi - lo)
        if b > a:
            spans.append((a, b, maps[i]))
    spans.sort()
    merged: list[tuple[int, int, tuple]] = []
    for a, b, m in spans:
        if merged and merged[-1][2] == m and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(b, merged[-1][1]), m)
        else:
            merged.append((a, b, m))
    return merged


def _clean_mappings(wanted: set[tuple[int, int]]) -> set[tuple[int, int, int]]:
    """(start, end, inode) of the ``wanted`` mappings that hold no private (copy-on-write) page now."""
    clean, current = set(), None
    try:
        with open("/proc/self/smaps") as f:
            for line in f:
                head = line.split(maxsplit=5)
                if "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):
                    start, end = (int(x, 16) for x in head[0].split("-"))
                    current = (start, end, int(head[4])) if (start, end) in wanted else None
                elif current is not None and head[0] == "Anonymous:":
                    if int(head[1]) == 0:
                        clean.add(current)
                    current = None
    except (OSError, ValueError, IndexError):
        return set()  # cannot tell: release nothing
    return clean


# Smaller references are not released: each release reads /proc/self/smaps, 15-30 ms in a trainer
# process (500-1,000 mappings), which for a 1 MiB reference cost more than the memory was worth
# (workload A: about a tenth of its step).
MIN_RELEASE_BYTES = 32 << 20


class FilePages:
    """The file-backed pages of a frozen module's weights, found once, released after each use
    (when they add up to ``min_bytes``, by default :data:`MIN_RELEASE_BYTES`, or more)."""

    def __init__(self, module: torch.nn.Module, min_bytes: int | None = None):
        tensors = [*module.parameters(), *module.buffers()]
        self.ranges = file_page_ranges(tensors) if madvise() is not None else []
        if self.nbytes < (MIN_RELEASE_BYTES if min_bytes is None else min_bytes):
            self.ranges = []

    @property
    def nbytes(self) -> int:
        return sum(b - a for a, b, _ in self.ranges)

    def release(self) -> int:
        """Drop the pages from this process's resident set; returns the bytes of the ranges released.

        Each mapping is checked again first (one read of /proc/self/smaps): still mapped at the same
        place from the same file, and no page of it written since.
        """
        if not self.ranges:
            return 0
        clean = _clean_mappings({(m[0], m[1]) for _, _, m in self.ranges})
        advise, released = madvise(), 0
        for a, b, m in self.ranges:
            if (m[0], m[1], m[2]) in clean and advise(a, b - a, MADV_DONTNEED) == 0:
                released += b - a
        return released
