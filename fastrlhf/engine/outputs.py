"""What a run leaves in its ``output_dir``, and the rule that no run silently overwrites another.

Every command writes the same files there (rank 0, see ``fastrlhf.distributed.multinode``):
``config.yaml``, ``metrics.jsonl``, ``checkpoints/``, ``final/``, and with the options that make them
``eval/``, ``tensorboard/``, ``wandb/`` and ``profile/`` (``trainer.profile_step``, written by every rank).
A folder that holds any of them is *used*: a new run there (no ``--resume``) would truncate the metrics,
replace ``config.yaml`` and ``final/``, and leave the old checkpoints beside the new ones with ``latest``
repointed. So the command line refuses it in one line (exit 2, before any model loads) unless ``--overwrite``
is given, which replaces those files (and nothing else: other files the user keeps there stay). A missing or
empty folder, or one with only other files, is not used.

``--overwrite`` loses nothing until the new run is under way (:class:`Overwrite`): rank 0 moves the
earlier run into ``output_dir/.fastrlhf-overwritten/`` (a rename in the same folder: instant, no copy)
once every rank has passed every check (a run that fails its checks moves nothing), after the start
gate and before the process group starts (``fastrlhf.distributed.launch.before_group``). Every other
rank waits for it in the rendezvous, and no rank writes into ``output_dir`` before the group is up, so
nothing a rank writes is moved and no rank sees a half-moved folder. The earlier run is deleted once
the new one has logged a step or saved a checkpoint (its models loaded and it trained; deleting then,
not at the end, keeps the disk the two runs need near one run's), and moved back if the command ends
before that (a late config error, a crash in the first step, Ctrl-C). Importing this module loads no
torch.
"""

from __future__ import annotations

import os
import re
import shutil
import threading
from collections.abc import Callable

from fastrlhf.config.errors import ConfigError

__all__ = ["RUN_FILES", "ASIDE", "run_files", "check_output_dir", "check_writable", "under_way", "Overwrite"]

# What a run writes in output_dir (folders without their slash); any of them makes the folder used.
RUN_FILES = ("config.yaml", "metrics.jsonl", "checkpoints", "final", "eval", "tensorboard", "wandb", "profile")
# Replaced by --overwrite too, though they alone do not make a folder used: what a kill may leave
# (the export's folders: fastrlhf.modeling.loading.export_hf).
_LEFTOVERS = ("config.yaml.tmp", "metrics.jsonl.tmp", "final.tmp", "final.old")
# Where --overwrite keeps the earlier run until the new one is under way. Left only by a run killed
# before then (SIGKILL, a power cut): it then makes the folder used, so that it is not forgotten there.
ASIDE = ".fastrlhf-overwritten"
_STEP_DIR = re.compile(r"^step-\d+$")  # a complete checkpoint (fastrlhf.engine.checkpoint, which imports torch)


def run_files(output_dir: str) -> list[str]:
    """The entries of :data:`RUN_FILES` (and :data:`ASIDE`) that ``output_dir`` holds (folders with a trailing
    slash)."""
    if not os.path.isdir(output_dir):
        return []
    found = []
    for name in (*RUN_FILES, ASIDE):
        path = os.path.join(output_dir, name)
        if os.path.lexists(path):
            found.append(name + "/" if os.path.isdir(path) else name)
    return found


def check_writable(output_dir: str) -> None:
    """Raise a one-line :class:`ConfigError` when ``output_dir`` is no folder a run can create or write in:
    empty, a file, under a file, or in a folder this user cannot write. Creates nothing."""
    if not output_dir:
        raise ConfigError("output_dir", "is empty; expected the path of a folder (new or of this run)")
    if os.path.exists(output_dir) and not os.path.isdir(output_dir):
        raise ConfigError("output_dir", f"{output_dir} is a file; expected a folder (new or of this run)")
    existing = os.path.abspath(output_dir)
    while not os.path.lexists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise ConfigError("output_dir", f"cannot create {output_dir}: {existing} is not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        what = "write in" if existing == os.path.abspath(output_dir) else f"create {output_dir}: no write access to"
        raise ConfigError("output_dir", f"cannot {what} {existing} (permission denied or a read-only file system)")


def check_output_dir(output_dir: str, resume: bool, overwrite: bool) -> None:
    """Raise a one-line :class:`ConfigError` when ``output_dir`` cannot be written (:func:`check_writable`), or
    when a new run (not ``resume``, not ``overwrite``) would write into a used one."""
    check_writable(output_dir)
    if resume or overwrite:
        return
    found = run_files(output_dir)
    if found:
        raise ConfigError("output_dir", f"{output_dir} holds an earlier run ({', '.join(found)}): add --resume "
                                        "to continue it, --overwrite to delete it and start again, or choose "
                                        "another output_dir")


def under_way(output_dir: str) -> bool:
    """Whether the run in ``output_dir`` got past its start: it logged a step (the models loaded and trained,
    or validated before training) or saved a checkpoint or its export."""
    try:
        if os.path.getsize(os.path.join(output_dir, "metrics.jsonl")) > 0:
            return True
    except OSError:
        pass
    if os.path.isdir(os.path.join(output_dir, "final")):
        return True
    try:
        return any(_STEP_DIR.match(name) for name in os.listdir(os.path.join(output_dir, "checkpoints")))
    except OSError:
        return False


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.remove(path)


def _present(output_dir: str) -> list[str]:
    return [name for name in (*RUN_FILES, *_LEFTOVERS) if os.path.lexists(os.path.join(output_dir, name))]


class Overwrite:
    """``--overwrite`` on rank 0 (see the module's docstring): :meth:`start` moves the earlier run aside, a
    thread deletes it once this run is :func:`under_way`, :meth:`finish` settles it when the command ends."""

    poll_s = 2.0  # how often the thread looks (a few stats), until it has deleted the earlier run

    def __init__(self, output_dir: str, say: Callable[[str], None]):
        self.output_dir = output_dir
        self.aside = os.path.join(output_dir, ASIDE)
        self.say = say
        self.moved: list[str] = []  # run_files' names of the earlier run
        self._lock = threading.Lock()
        self._settled = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Move the earlier run into :data:`ASIDE` and start watching. Raises a one-line ConfigError (having
        moved back what it moved) where a rename fails."""
        if os.path.isdir(self.aside):  # left by an --overwrite run that was killed
            if under_way(self.output_dir):  # that run got going: what it set aside is older, and replaced
                try:
                    shutil.rmtree(self.aside)
                except OSError as exc:
                    raise ConfigError("output_dir", f"--overwrite could not delete {self.aside}, left by an "
                                                    f"earlier --overwrite: {exc.strerror or exc}") from None
            else:  # it never did: the folder's run is still the one set aside
                self.moved = run_files(self.aside)
                self._move(_present(self.output_dir), None)
        if not self.moved:
            self.moved = [name for name in run_files(self.output_dir) if name != ASIDE + "/"]  # an empty one
            if not self.moved:
                return
            self._move(_present(self.output_dir), self.aside)
        self._thread = threading.Thread(target=self._watch, name="fastrlhf-overwrite", daemon=True)
        self._thread.start()

    def _move(self, names: list[str], into: str | None) -> None:
        """``names`` of output_dir moved into ``into`` (None: deleted), or none of them."""
        done = []
        path = self.output_dir
        try:
            if into is not None:
                os.makedirs(into, exist_ok=True)
            for name in names:
                path = os.path.join(self.output_dir, name)
                if into is None:
                    _remove(path)
                else:
                    os.rename(path, os.path.join(into, name))
                done.append(name)
        except OSError as exc:
            for name in done if into is not None else ():
                os.rename(os.path.join(into, name), os.path.join(self.output_dir, name))
            what = "move" if into is not None else "remove"
            raise ConfigError("output_dir", f"--overwrite could not {what} {path}: {exc.strerror or exc}") from None

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            if under_way(self.output_dir):
                self._discard()
                return

    def _discard(self) -> None:
        with self._lock:
            if self._settled:
                return
            self._settled = True
        try:
            shutil.rmtree(self.aside)
        except OSError as exc:  # the new run goes on; what is left is in plain sight
            self.say(f"warning: --overwrite: could not delete the earlier run in {self.aside} ({exc}); delete it "
                     "by hand")
            return
        self.say(f"note: --overwrite: removed the earlier run in {self.output_dir} ({', '.join(self.moved)})")

    def finish(self, succeeded: bool) -> list[str]:
        """At the command's end: delete the earlier run if this one succeeded or got under way, else move it
        back in place of what this run wrote. Returns what was moved back ([] if nothing)."""
        if self._thread is None:
            return []
        self._stop.set()
        self._thread.join()
        if succeeded or under_way(self.output_dir):
            self._discard()
            return []
        with self._lock:
            if self._settled:
                return []
            self._settled = True
        self._move(_present(self.output_dir), None)  # this run's files: it never got going
        for name in os.listdir(self.aside):
            os.rename(os.path.join(self.aside, name), os.path.join(self.output_dir, name))
        os.rmdir(self.aside)
        return self.moved
