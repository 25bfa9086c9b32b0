"""Running a command (a launcher and its ranks, a CLI) as its own process group from a test.

On timeout the whole group is killed and the test fails with the output so far: a hung launcher
must never outlive its test.
"""

import os
import signal
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# What the launchers set for a rank (torchrun/deepspeed, srun, mpirun): a test that plays a launch starts without them.
LAUNCH_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SLURM_STEP_NUM_TASKS",
                    "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")


def clear_launch_env(monkeypatch) -> None:
    """This process as one no launcher started; each variable restored (or removed) after the test, whatever
    ``init_distributed`` sets meanwhile."""
    for name in LAUNCH_VARIABLES:
        monkeypatch.setenv(name, "")
        monkeypatch.delenv(name)


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


def start_group(argv, log_path, env=None, cwd=ROOT) -> subprocess.Popen:
    """``argv`` started in a new session, stdout + stderr to the file ``log_path``; pair with
    :func:`wait_groups` (or :func:`kill_group`) so that it never outlives its test."""
    with open(log_path, "w") as log:
        return subprocess.Popen(argv, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL ``proc``'s whole process group (its launcher's children too), even after ``proc`` exited."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def wait_groups(procs: list, timeout: float, logs=()) -> list[int]:
    """Exit codes of ``procs`` once all have ended. Past ``timeout`` seconds (for all together) every
    group is killed and the test fails with the end of each log. Groups are killed in any case: a
    launcher's children must not outlive it."""
    import time

    deadline = time.monotonic() + timeout
    try:
        for proc in procs:
            proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
    except subprocess.TimeoutExpired:
        tails = "\n".join(f"--- {path}:\n{open(path).read()[-3000:]}" for path in logs)
        pytest.fail(f"still running after {timeout} s, killed:\n{tails}")
    finally:
        for proc in procs:
            kill_group(proc)
    return [proc.returncode for proc in procs]


def _run_then_leave(rank, target, port, out):
    """``target``, then leave without C++ static destructors, as a launched fastrlhf rank does
    (``fastrlhf.cli.exit_with``): there torch's c10d stores abort a gloo rank now and then ("terminate called
    without an active exception", SIGABRT) after its work is done and its results are in ``out``."""
    import sys

    target(rank, port, out)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn_ranks(target, nprocs: int = 2) -> dict:
    """Run ``target(rank, port, out)`` in ``nprocs`` spawned processes (a gloo group on a free local ``port``,
    which ``target`` joins and leaves) and return what they put in the shared dict ``out``. A rank that raises
    fails the test with its traceback."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with mp.Manager() as manager:
        out = manager.dict()
        mp.start_processes(_run_then_leave, args=(target, port, out), nprocs=nprocs, start_method="spawn",
                           join=True)
        return dict(out)
