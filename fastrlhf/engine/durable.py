"""Writes that a power cut cannot leave half done: files and folders fsynced before the rename that publishes them.
Checkpoints (``checkpoint``), the run's text files and the Hugging Face export (``fastrlhf.modeling.loading``) use
them; imports nothing of fastrlhf, so any module may."""

from __future__ import annotations

import os

__all__ = ["fsync_path", "fsync_tree", "write_text_atomic"]


def fsync_path(path: str, directory: bool = False) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if directory else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: str) -> None:
    """Every file and folder under ``root`` on disk (before the rename that publishes ``root``)."""
    for dirpath, _dirnames, filenames in os.walk(root):
        for name in filenames:
            fsync_path(os.path.join(dirpath, name))
        fsync_path(dirpath, directory=True)


def write_text_atomic(path: str, text: str) -> None:
    """``text`` to ``path`` whole or not at all (a kill mid-write leaves the old file)."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
