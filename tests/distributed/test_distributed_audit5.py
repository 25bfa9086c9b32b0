"""Distributed audit 5: the launch environment, the guard's agreement across ranks, and what a run writes."""

import os

import pytest
from helpers.launch import clear_launch_env

from fastrlhf import cli
from fastrlhf.distributed import free_port


def launched_without(monkeypatch, missing: str, rank: str = "1") -> None:
    """This process as rank ``rank`` of 2 of a launch that set every rendezvous variable but ``missing``."""
    import torch.distributed as dist

    clear_launch_env(monkeypatch)
    env = {
        "RANK": rank,
        "WORLD_SIZE": "2",
        "LOCAL_RANK": rank,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "FASTRLHF_DIST_TIMEOUT": "1",
    }
    for name, value in env.items():
        if name != missing:
            monkeypatch.setenv(name, value)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)  # an earlier test's group: not this launch's


@pytest.mark.parametrize("missing", ["LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE"])
def test_a_launch_that_leaves_out_a_rendezvous_variable_stops_with_one_line_naming_it(monkeypatch, missing):
    """RANK set, one of the others not (a SLURM script that exports RANK, WORLD_SIZE and MASTER_* but no LOCAL_RANK):
    DeepSpeed's init_distributed then took the launch for an MPI one. Without mpi4py that raised "No module named
    'mpi4py'"; with it (a singleton MPI world outside mpirun) rank 0 joined as "rank 0 of 1" and ran the job alone
    while rank 1 died with EADDRINUSE on port 29500. Without MASTER_ADDR or MASTER_PORT: KeyError from the start
    gate. Now: one line naming the variable, exit 2, before the start gate."""
    from fastrlhf.distributed import launch, multinode

    launched_without(monkeypatch, missing)

    def gate(**kwargs):
        raise AssertionError(f"reached the start gate without {missing}")

    monkeypatch.setattr(multinode, "start_gate", gate)
    with pytest.raises(
        multinode.NodeError, match=rf"^distributed error: RANK is set \(1\) but {missing} is not: "
    ) as error:
        launch.init_distributed()
    assert error.value.exit_code == 2 and error.value.local
    assert "`deepspeed` or `torchrun`" in str(error.value)


def test_a_launch_without_local_rank_is_one_line_from_the_command_line(monkeypatch, capsys, tmp_path):
    """Through the command line: one line and exit 2 (the real start gate would have waited for rank 0 for
    FASTRLHF_DIST_TIMEOUT, then DeepSpeed looked for mpi4py)."""
    from helpers.model_folders import fake_model_folder

    from fastrlhf import distributed as D

    fake_model_folder(tmp_path / "model")
    (tmp_path / "prompts.jsonl").write_text('{"prompt_ids": [3, 4]}\n')
    (tmp_path / "run.yaml").write_text(
        f"algorithm: grpo\noutput_dir: {tmp_path / 'out'}\nmodel: {{path: {tmp_path / 'model'}}}\n"
        f"reward: {{function: length}}\ndata: {{prompts: {tmp_path / 'prompts.jsonl'}}}\nrollout: {{n: 4}}\n"
        "trainer: {max_steps: 2, prompts_per_step: 4, minibatch_size: 8}\n"
    )
    launched_without(monkeypatch, "LOCAL_RANK")
    monkeypatch.setattr(cli, "_dispatch", lambda command, config, resume: D.init_distributed())
    assert cli.main(["train", "--config", str(tmp_path / "run.yaml")]) == cli.EXIT_BAD_INPUT
    said = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(said) == 1 and said[0].startswith("distributed error: RANK is set (1) but LOCAL_RANK is not"), said


def test_a_complete_launch_environment_has_no_problem(monkeypatch):
    from fastrlhf.distributed import launch

    launched_without(monkeypatch, "")
    assert launch._missing_launch_problem() is None
    monkeypatch.setenv("LOCAL_RANK", "")  # set but empty: torch and DeepSpeed cannot use it either
    assert "LOCAL_RANK is not" in launch._missing_launch_problem()
    assert os.environ["RANK"] == "1"


# ---- a NaN on one rank, reduced by max or min ---------------------------------------------------------------------


def test_a_nan_on_one_rank_is_the_max_and_the_min_on_every_rank():
    """gloo's MAX kept a NaN of rank 0 but dropped one of rank 1 (measured: 0.1 on both ranks), and NCCL's MAX is
    fmax, which drops it wherever another rank has a number: a rank's NaN (its engine's logprobs, a metric) vanished
    from the maximum the guard and the step's metrics read. Now NaN on every rank, as torch.max gives it, and the
    other values, infinities and the other ops as before."""
    from helpers.distributed5_ranks import nan_extremes
    from helpers.launch import spawn_ranks

    out = spawn_ranks(nan_extremes)
    for rank in (0, 1):
        assert out[f"max{rank}"] == ["nan", 0.5, -1.0, float("inf"), 2.0], out
        assert out[f"min{rank}"] == ["nan", 0.25, float("-inf"), 3.0, 2.0], out
        assert out[f"floats{rank}"] == ["nan", 0.5], out
        assert out[f"sum{rank}"] == [0.75, float("-inf")], out
        assert out[f"ints{rank}"] == [1, 7], out
        assert out[f"guard{rank}"] == (True, ["nan"]), out  # the inputs were finite: the step goes on


# ---- --overwrite and the profiles of trainer.profile_step -----------------------------------------------------------


def _earlier_run_with_profiles(folder) -> None:
    (folder / "profile").mkdir(parents=True)
    (folder / "metrics.jsonl").write_text('{"step": 1}\n')
    for step in (1, 5):
        (folder / "profile" / f"step-{step}-rank-0.json").write_text("earlier")


def _profiles(folder) -> dict:
    return {p.name: p.read_text() for p in sorted((folder / "profile").iterdir())}


@pytest.mark.parametrize("succeeded", [True, False])
def test_overwrite_sets_the_earlier_runs_profiles_aside_with_the_rest_of_it(tmp_path, succeeded):
    """``trainer.profile_step`` writes ``profile/step-N-rank-R.json`` (every rank). ``--overwrite`` left the earlier
    run's there: beside the new run's (measured: step-5 "earlier" next to step-1 "new"), and where the new run ended
    before it was under way, the restored earlier run held the new run's step-1 profile in place of its own."""
    from fastrlhf.config import ConfigError
    from fastrlhf.engine.outputs import Overwrite, check_output_dir, run_files

    _earlier_run_with_profiles(tmp_path)
    overwrite = Overwrite(str(tmp_path), lambda line: None)
    overwrite.poll_s = 3600.0  # settled by finish() alone
    overwrite.start()
    assert not (tmp_path / "profile").exists()
    (tmp_path / "profile").mkdir()
    (tmp_path / "profile" / "step-1-rank-0.json").write_text("new")  # the new run profiles its step 1
    overwrite.finish(succeeded)
    expected = (
        {"step-1-rank-0.json": "new"}
        if succeeded
        else {"step-1-rank-0.json": "earlier", "step-5-rank-0.json": "earlier"}
    )
    assert _profiles(tmp_path) == expected
    assert "profile/" in run_files(str(tmp_path))
    with pytest.raises(ConfigError, match=r"holds an earlier run \(.*profile/\)"):  # a run without --overwrite
        check_output_dir(str(tmp_path), resume=False, overwrite=False)
