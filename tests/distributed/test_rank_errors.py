"""Errors raised once the process group is up: said by the rank that raised them, or once when every rank did.

The command line used to say them on rank 0 only, so an error that one other rank raised alone (its own data or
file, a check of its own GPU) was said nowhere: that rank left with exit 2 and no word, and rank 0, waiting for
it in a collective, said only that it lost contact (on NCCL it may wait for FASTRLHF_DIST_TIMEOUT). Now such an
error is said by each rank that raised it, naming the rank (``[rank 1] config error: ...``), and one that every
rank raised alike, marked so where the ranks agree on it (``fastrlhf.distributed.comm.agreed``), once by rank 0.
"""

import os
import sys
import time

import pytest
from helpers.launch import clear_launch_env, start_group, wait_groups
from helpers.model_folders import fake_train_yaml
from helpers.paths import ROOT

from fastrlhf import cli
from fastrlhf.config import ConfigError
from fastrlhf.distributed import comm, free_port

CHILD = os.path.join(ROOT, "tests", "helpers", "ranks_child.py")
TIMEOUT_S = 60


@pytest.fixture
def train_yaml(tmp_path):
    return fake_train_yaml(tmp_path)


def run_two_ranks(tmp_path, config: str, failing: str, kind: str):
    """Ranks 0 and 1 of a gloo run through the command line (``helpers/ranks_child.py``); returns (exit codes,
    each rank's error lines, seconds)."""
    port = str(free_port())
    procs, logs = [], []
    for r in range(2):
        env = {
            **os.environ,
            "RANK": str(r),
            "LOCAL_RANK": str(r),
            "WORLD_SIZE": "2",
            "LOCAL_SIZE": "2",
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
            "FASTRLHF_DIST_TIMEOUT": str(TIMEOUT_S),
            "OMP_NUM_THREADS": "1",
            "FASTRLHF_NO_PROGRESS": "1",
            "PYTHONPATH": ROOT,
        }
        logs.append(tmp_path / f"rank{r}.log")
        procs.append(start_group([sys.executable, CHILD, config, failing, kind], logs[-1], env=env))
    started = time.monotonic()
    codes = wait_groups(procs, TIMEOUT_S + 120, logs)
    seconds = time.monotonic() - started
    errors = [[line for line in log.read_text().splitlines() if "error: " in line] for log in logs]
    return codes, errors, seconds


@pytest.mark.timeout(300)
def test_an_error_of_rank_1_alone_is_said_by_rank_1_naming_it(tmp_path, train_yaml):
    codes, errors, seconds = run_two_ranks(tmp_path, train_yaml, "1", "config")
    assert codes[1] == 2, errors
    assert errors[1] == ["[rank 1] config error: data.prompts: only rank 1 cannot read it"], errors
    # Rank 0 waited for rank 1 in a collective: rank 1's exit closed the connection, and it stopped at once.
    assert codes[0] == 1 and seconds < TIMEOUT_S, (codes, seconds, errors)
    assert len(errors[0]) == 1 and errors[0][0].startswith("distributed error: lost contact with another rank"), errors
    assert "a rank stopped on an error of its own" in errors[0][0]


@pytest.mark.timeout(300)
def test_each_line_of_a_data_error_of_one_rank_names_it(tmp_path, train_yaml):
    codes, errors, _ = run_two_ranks(tmp_path, train_yaml, "1", "data")
    assert codes[1] == 2, errors
    assert errors[1] == [
        "[rank 1] data error: rank1.jsonl:3: empty prompt",
        "[rank 1] data error: rank1.jsonl:7: empty prompt",
        "[rank 1] data error: (2 bad lines in all)",
    ], errors


@pytest.mark.timeout(300)
def test_an_error_every_rank_agreed_on_is_said_once(tmp_path, train_yaml):
    codes, errors, _ = run_two_ranks(tmp_path, train_yaml, "0,1", "agreed")
    assert codes == [2, 2], errors
    assert errors == [["config error: trainer.lr: the same on every rank"], []], errors


def _raise(exc):
    def dispatch(command, config, resume):
        raise exc

    return dispatch


def launched_as(monkeypatch, rank: str, world: str) -> None:
    """This process as rank ``rank`` of ``world`` whose process group has started (whatever group an earlier
    in-process test left: one of one rank)."""
    from fastrlhf.distributed import ranks

    monkeypatch.setenv("RANK", rank)
    monkeypatch.setenv("WORLD_SIZE", world)
    monkeypatch.setattr(ranks, "rank", lambda: int(rank))
    monkeypatch.setattr(ranks, "world_size", lambda: int(world))
    monkeypatch.setattr(cli, "_group_started", lambda: True)


@pytest.mark.parametrize("rank", ["0", "1"])
def test_an_agreed_error_is_said_once_by_rank_0(train_yaml, monkeypatch, capsys, rank):
    launched_as(monkeypatch, rank, "2")
    monkeypatch.setattr(cli, "_dispatch", _raise(comm.agreed(ConfigError("trainer.lr", "too high"))))
    assert cli.main(["train", "--config", train_yaml]) == cli.EXIT_BAD_INPUT
    said = capsys.readouterr().err.splitlines()
    assert said == (["config error: trainer.lr: too high"] if rank == "0" else []), said


@pytest.mark.parametrize("rank", ["0", "1"])
def test_an_error_not_agreed_is_said_by_its_rank_with_its_number(train_yaml, monkeypatch, capsys, rank):
    launched_as(monkeypatch, rank, "2")
    monkeypatch.setattr(cli, "_dispatch", _raise(ConfigError("rollout.gpu_memory_utilization", "only 3.0 GiB free")))
    assert cli.main(["train", "--config", train_yaml]) == cli.EXIT_BAD_INPUT
    said = capsys.readouterr().err.splitlines()
    assert said == [f"[rank {rank}] config error: rollout.gpu_memory_utilization: only 3.0 GiB free"], said


def test_one_rank_alone_says_its_error_without_a_number(train_yaml, monkeypatch, capsys):
    launched_as(monkeypatch, "0", "1")
    monkeypatch.setattr(cli, "_dispatch", _raise(ConfigError("model.attention", "flex needs a GPU")))
    assert cli.main(["train", "--config", train_yaml]) == cli.EXIT_BAD_INPUT
    assert capsys.readouterr().err.splitlines() == ["config error: model.attention: flex needs a GPU"]


def test_agreed_marks_the_error_it_returns():
    error = ConfigError("x", "y")
    assert not comm.is_agreed(error) and comm.agreed(error) is error and comm.is_agreed(error)


# ---- a launcher that sets no RANK --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["SLURM_STEP_NUM_TASKS", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE"])
def test_processes_started_by_srun_or_mpirun_without_rank_do_not_each_run_the_job_alone(monkeypatch, name):
    """``srun -n 2 python -m fastrlhf ...`` sets SLURM's variables, not RANK: each process filled in rank 0 of 1
    and ran the whole job, both on GPU 0 and into one output_dir. It stops with one line, exit 2."""
    import torch.distributed as dist

    from fastrlhf.distributed import launch, multinode

    clear_launch_env(monkeypatch)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)

    def joined(**kwargs):
        raise AssertionError(f"joined a group as rank {os.environ['RANK']} of {os.environ['WORLD_SIZE']}")

    monkeypatch.setattr(multinode, "start_gate", joined)
    monkeypatch.setenv(name, "2")
    said = rf"^distributed error: .* started 2 processes \({name}=2\) but set no RANK"
    with pytest.raises(multinode.NodeError, match=said) as error:
        launch.init_distributed()
    assert error.value.exit_code == 2
    assert "RANK" not in os.environ and "MASTER_PORT" not in os.environ
    monkeypatch.setenv(name, "1")  # one process (e.g. `srun -n 1 deepspeed ...` or a batch script): a one-rank run
    assert launch._unset_rank_problem() is None


def test_a_node_that_cannot_reach_node_0_says_so_itself(train_yaml, monkeypatch, capsys):
    """The first rank of node 1 that cannot reach the rendezvous (node 0 never started, or is unreachable) said
    nothing: the line was for rank 0 alone, the rank it could not reach. Node 1 then left with exit 1, wordless."""
    import torch.distributed

    from fastrlhf import distributed as D

    port = str(free_port())  # nobody listens there
    for name, value in {
        "RANK": "1",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "2",
        "LOCAL_SIZE": "1",
        "CROSS_SIZE": "2",
        "CROSS_RANK": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": port,
        "FASTRLHF_DIST_TIMEOUT": "1",
    }.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)  # an earlier test's group: not ours
    monkeypatch.setattr(cli, "_dispatch", lambda command, config, resume: D.init_distributed())
    assert cli.main(["train", "--config", train_yaml]) == cli.EXIT_FAILED
    said = capsys.readouterr().err.splitlines()
    assert len(said) == 1 and said[0].startswith("distributed error: rank 1 on node 1 (host "), said
    assert f"could not reach the rendezvous at 127.0.0.1:{port} within 1 s" in said[0], said


def test_a_one_rank_run_takes_a_port_of_its_own_not_an_inherited_master_port(monkeypatch):
    """A bare ``python -m fastrlhf`` (no launcher: no RANK) kept a MASTER_PORT it inherited (a shell's export, a
    parent run's environment): a second one-rank run on the node then failed to bind it, DistNetworkError
    EADDRINUSE, measured with two runs sharing MASTER_PORT=29517."""
    import socket

    import torch.distributed as dist

    from fastrlhf.distributed import launch, multinode

    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_STEP_NUM_TASKS", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE"):
        monkeypatch.setenv(var, "")
        monkeypatch.delenv(var)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    seen = {}

    def gate(**kwargs):  # the first step that uses the rendezvous: stop there
        seen.update(os.environ)
        raise multinode.NodeError("stop")

    monkeypatch.setattr(multinode, "start_gate", gate)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        monkeypatch.setenv("MASTER_PORT", str(taken.getsockname()[1]))  # another run's
        with pytest.raises(multinode.NodeError, match="stop"):
            launch.init_distributed(timeout_s=5)
        assert seen["RANK"] == "0" and seen["WORLD_SIZE"] == "1"
        assert seen["MASTER_PORT"] != str(taken.getsockname()[1])
