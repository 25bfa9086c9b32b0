"""Running a command (a launcher and its ranks, a CLI) as its own process group from a test.

On timeout the whole group is killed and the test fails with the output so far: a hung launcher
must never outlive its test.
"""

import os
import signal
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_group(argv, timeout: float, env=None, cwd=ROOT) -> tuple[int, str]:
    """``(exit code, stdout + stderr)`` of ``argv`` run in a new session (its own process group)."""
    proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{' '.join(map(str, argv[:4]))} timed out after {timeout} s:\n{out[-4000:]}")
    return proc.returncode, out
