"""Which checkpoint errors the command line says once and which each rank says (``fastrlhf.cli._rank_error``):
a problem the ranks agreed on through a collective is raised alike everywhere and said once, by rank 0; one a
rank found alone (its own state refused by ``load_state_dict``) is said by that rank, naming it."""

import pytest

from fastrlhf.distributed import comm
from fastrlhf.engine import checkpoint, loop
from fastrlhf.engine.checkpoint import CheckpointError


def test_a_missing_rank_file_is_agreed_by_every_rank(tmp_path):
    with pytest.raises(CheckpointError, match="has no state for rank 0") as info:
        checkpoint._rank_state(str(tmp_path), None)
    assert comm.is_agreed(info.value)


def test_ranks_that_see_different_latest_checkpoints_agree_on_it(tmp_path, monkeypatch):
    monkeypatch.setattr(comm, "gather_bytes", lambda mine: [mine, b"/elsewhere/checkpoints/step-3"])
    with pytest.raises(CheckpointError, match="the ranks see different latest checkpoints") as info:
        loop._agree_on_checkpoint(str(tmp_path))
    assert comm.is_agreed(info.value)


def test_a_checkpoint_error_of_one_rank_is_said_by_it_and_an_agreed_one_once(monkeypatch, capsys):
    from fastrlhf import cli
    from fastrlhf.distributed import ranks

    monkeypatch.setattr(ranks, "world_size", lambda: 2)
    monkeypatch.setattr(ranks, "rank", lambda: 1)
    monkeypatch.setattr(cli, "_is_main_process", lambda: False)
    cli._rank_error("checkpoint error: x", CheckpointError("x"))
    cli._rank_error("checkpoint error: y", comm.agreed(CheckpointError("y")))
    assert capsys.readouterr().err == "[rank 1] checkpoint error: x\n"
