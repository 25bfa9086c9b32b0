"""``fastrlhf.demo.stages.run_stage``: a stage interrupted by an error in the parent (a test's timeout, Ctrl-C)
leaves none of its processes running."""

import os
import sys
import time

import pytest

from fastrlhf.demo import stages

# The stage: a process that starts a grandchild (as the deepspeed launcher starts its ranks), writes both
# pids, and waits.
STAGE = ("import os, subprocess, sys, time; "
         "g = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
         "open(sys.argv[1], 'w').write(f'{os.getpid()} {g.pid}'); time.sleep(600)")


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("error", [KeyboardInterrupt, pytest.fail.Exception])  # Ctrl-C; pytest-timeout's
def test_an_interrupted_stage_leaves_no_process_running(tmp_path, monkeypatch, error):
    pids_file = tmp_path / "pids"

    def follow_until_started(metrics_path):
        if pids_file.exists() and pids_file.read_text():
            raise error("interrupted")
        return {}

    monkeypatch.setattr(stages, "last_metrics", follow_until_started)
    with pytest.raises(error):
        stages.run_stage("stage", [sys.executable, "-c", STAGE, str(pids_file)], str(tmp_path / "stage.log"),
                         str(tmp_path / "metrics.jsonl"), 1, False, dict(os.environ))
    pids = [int(p) for p in pids_file.read_text().split()]
    deadline = time.monotonic() + 30  # the grandchild's SIGTERM is delivered, not waited for
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(alive(p) for p in pids), pids
