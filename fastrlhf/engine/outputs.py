"""What a run leaves in its ``output_dir``, and the rule that no run silently overwrites another.

Every command writes the same files there (rank 0, see ``fastrlhf.distributed.multinode``):
``config.yaml``, ``metrics.jsonl``, ``checkpoints/``, ``final/``, and with the options that make them
``eval/``, ``tensorboard/`` and ``wandb/``. A folder that holds any of them is *used*: a new run there
(no ``--resume``) would truncate the metrics, replace ``config.yaml`` and ``final/``, and leave the old
checkpoints beside the new ones with ``latest`` repointed. So the command line refuses it in one line
(exit 2, before any model loads) unless ``--overwrite`` is given, which removes those files first (and
nothing else: other files the user keeps there stay). A missing or empty folder, or one with only
other files, is not used.

Only rank 0 removes anything, and only once every rank has passed every check (a run that fails
its checks deletes nothing): after the start gate, before the process group starts
(``fastrlhf.distributed.launch.before_group``). Every other rank waits for it in the rendezvous, and no
rank writes into ``output_dir`` before the group is up, so nothing a rank writes can be removed and no
rank sees a half-removed folder. Importing this module loads no torch.
"""

from __future__ import annotations

import os
import shutil

from fastrlhf.config.errors import ConfigError

__all__ = ["RUN_FILES", "run_files", "check_output_dir", "clear_run_files"]

# What a run writes in output_dir (folders without their slash); any of them makes the folder used.
RUN_FILES = ("config.yaml", "metrics.jsonl", "checkpoints", "final", "eval", "tensorboard", "wandb")
# Removed by --overwrite too, though they alone do not make a folder used: what a kill may leave.
_LEFTOVERS = ("config.yaml.tmp", "metrics.jsonl.tmp")


def run_files(output_dir: str) -> list[str]:
    """The entries of :data:`RUN_FILES` that ``output_dir`` holds (folders with a trailing slash)."""
    if not os.path.isdir(output_dir):
        return []
    found = []
    for name in RUN_FILES:
        path = os.path.join(output_dir, name)
        if os.path.lexists(path):
            found.append(name + "/" if os.path.isdir(path) else name)
    return found


def check_output_dir(output_dir: str, resume: bool, overwrite: bool) -> None:
    """Raise a one-line :class:`ConfigError` when a new run (not ``resume``, not ``overwrite``) would
    write into a used ``output_dir``, or when ``output_dir`` is a file."""
    if os.path.exists(output_dir) and not os.path.isdir(output_dir):
        raise ConfigError("output_dir", f"{output_dir} is a file; expected a folder (new or of this run)")
    if resume or overwrite:
        return
    found = run_files(output_dir)
    if found:
        raise ConfigError("output_dir", f"{output_dir} holds an earlier run ({', '.join(found)}): add --resume "
                                        "to continue it, --overwrite to delete it and start again, or choose "
                                        "another output_dir")


def clear_run_files(output_dir: str) -> list[str]:
    """Remove what a run wrote in ``output_dir`` (:data:`RUN_FILES` and a kill's leftovers), nothing else;
    returns what was removed. Call on rank 0 only, before the process group starts."""
    removed = run_files(output_dir)
    for name in (*RUN_FILES, *_LEFTOVERS):
        path = os.path.join(output_dir, name)
        try:
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
            elif os.path.lexists(path):
                os.remove(path)
        except OSError as exc:
            raise ConfigError("output_dir", f"--overwrite could not remove {path}: "
                                            f"{exc.strerror or exc}") from None
    return removed
