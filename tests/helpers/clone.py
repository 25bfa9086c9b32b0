"""A copy of the checkout as a clone of it holds: what a user has before running anything."""

import os
import shutil
import subprocess
import sys

from helpers.paths import ROOT


def bare_clone(dest) -> str:
    """The checkout's files that git tracks or would track (tracked and untracked-but-not-ignored, with their
    working-tree content) copied under ``dest``: no ``runs/``, ``models/``, build outputs or caches. Its
    ``.venv`` is a link to the running interpreter's environment, so the README's ``.venv/bin/...`` commands
    work there; run them with ``PYTHONPATH`` set to the copy (:func:`clone_env`) to import its code."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, check=True).stdout.decode()
    for rel in filter(None, listed.split("\0")):
        src = os.path.join(ROOT, rel)
        if os.path.isfile(src) and not os.path.islink(src):  # not a file deleted in the working tree
            os.makedirs(os.path.join(dest, os.path.dirname(rel)), exist_ok=True)
            shutil.copy2(src, os.path.join(dest, rel))
    os.symlink(sys.prefix, os.path.join(dest, ".venv"))
    return str(dest)


def clone_env(clone: str, **extra) -> dict:
    """The environment for commands run in ``clone``: its code first on the path, no progress bars."""
    from helpers.rl_runs import LAUNCH_ENV  # an earlier test's rendezvous port, still bound in this process

    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV}
    return {**env, "PYTHONPATH": str(clone), "FASTRLHF_NO_PROGRESS": "1", "HF_HUB_OFFLINE": "1", **extra}
