"""Resume audit: the learning rate a resumed run trains at, the checkpoint folder's crash windows and pruning,
and resume's one-line refusals of a checkpoint the run cannot continue from."""

import dataclasses
import os

import pytest
import torch

from fastrlhf import distributed as D
from fastrlhf.config import DeepSpeedConfig
from fastrlhf.engine.checkpoint import load_latest, save_checkpoint
from fastrlhf.engine.deepspeed import build_train_engine
from fastrlhf.engine.guards import StepGuard
from tests.helpers.loggers import NullLogger


def _engine(stage: int, lr: float, warmup: int = 4):
    torch.manual_seed(0)
    guard = StepGuard(3)
    engine = build_train_engine(
        torch.nn.Linear(4, 3), DeepSpeedConfig(zero_stage=stage), lr=lr, warmup_steps=warmup, guard=guard
    )
    return engine, guard


def _train(engine, guard, steps: int) -> None:
    for _ in range(steps):
        loss = (engine(torch.randn(2, 4)) ** 2).sum()
        guard.note_loss(loss)
        engine.backward(loss)
        engine.step()
        guard.end_step()


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_run_resumed_with_another_lr_trains_at_it_from_its_first_step(tmp_path, stage):
    """After too many skipped steps the run says "lower trainer.lr ... rerun with --resume": the resumed run's
    first optimizer step must use the new rate at the checkpoint's position in the warm-up, not the old rate."""
    D.init_distributed(timeout_s=60)
    engine, guard = _engine(stage, lr=1e-2)
    _train(engine, guard, 2)  # warm-up factors 1/4, 2/4 used; the next step trains at 3/4
    save_checkpoint(str(tmp_path), 2, {"actor": engine})
    assert engine.get_lr()[0] == pytest.approx(0.75e-2)

    resumed, _ = _engine(stage, lr=1e-4)
    load_latest(str(tmp_path), {"actor": resumed})
    rates = [g["lr"] for g in resumed.optimizer.param_groups] + [resumed.get_lr()[0]]
    assert rates == pytest.approx([0.75e-4] * len(rates)), rates
    assert resumed.lr_scheduler.last_epoch == engine.lr_scheduler.last_epoch == 2


def _config(lora_r=0, zero_stage=2, **over):
    from helpers.rl_case import GRPO, make_config

    config = make_config(GRPO, seed=3)
    return dataclasses.replace(
        config,
        model=dataclasses.replace(config.model, lora_r=lora_r),
        deepspeed=dataclasses.replace(config.deepspeed, zero_stage=zero_stage),
        **over,
    )


@pytest.mark.parametrize(
    "change, named",
    [
        ({"seed": 4}, "seed = 3, this run has 4"),
        ({"algorithm": "ppo"}, "algorithm = 'grpo', this run has 'ppo'"),
        ({"lora_r": 8}, "model.lora_r = 0, this run has 8"),
        ({"zero_stage": 3}, "deepspeed.zero_stage = 2, this run has 3"),
    ],
)
def test_resume_refuses_a_checkpoint_of_another_config_in_one_line_naming_the_setting(tmp_path, change, named):
    """Before: a changed LoRA rank, ZeRO-3 layout or algorithm crashed inside DeepSpeed's load (a 30-line traceback,
    or a bare AssertionError); a changed seed resumed silently, prompts in the old seed's order."""
    from fastrlhf.engine.checkpoint import CheckpointError, run_identity

    model = torch.nn.Linear(2, 2)
    save_checkpoint(str(tmp_path), 2, {"model": model}, identity=run_identity(_config()))
    with pytest.raises(CheckpointError) as err:
        load_latest(str(tmp_path), {"model": model}, identity=run_identity(_config(**change)))
    assert named in str(err.value) and "\n" not in str(err.value)
    # What may change on a resume does: more steps, another learning rate, ZeRO-1 for ZeRO-2.
    same = run_identity(_config(zero_stage=1, trainer=dataclasses.replace(_config().trainer, max_steps=99, lr=1e-3)))
    assert load_latest(str(tmp_path), {"model": model}, identity=same)["step"] == 2
    # A checkpoint written before checkpoints held the settings still resumes.
    save_checkpoint(str(tmp_path), 3, {"model": model})
    assert load_latest(str(tmp_path), {"model": model}, identity=run_identity(_config(seed=4)))["step"] == 3


def test_resume_on_other_data_is_a_checkpoint_error_not_a_traceback(tmp_path):
    from fastrlhf.data import EpochSampler
    from fastrlhf.engine.checkpoint import CheckpointError

    save_checkpoint(str(tmp_path), 2, {"sampler": EpochSampler(8)})
    with pytest.raises(
        CheckpointError,
        match=r"step-2: sampler: the checkpoint's sampler covered 8 examples but the "
        r"data now has 6; resume with the same data",
    ):
        load_latest(str(tmp_path), {"sampler": EpochSampler(6)})


def test_a_kill_while_a_step_is_saved_again_leaves_that_step_resumable(tmp_path, monkeypatch):
    """A resumed run re-saves a step that exists (the final one, after a kill during the export): the old copy went
    (a slow delete of GBs of optimizer state) before the new one was renamed in; a kill then left no checkpoint."""
    import shutil

    import fastrlhf.engine.checkpoint as checkpoint

    model = torch.nn.Linear(2, 2)
    out = str(tmp_path)
    save_checkpoint(out, 4, {"model": model}, keep_last=1)
    real_rmtree = shutil.rmtree

    def killed_in_delete(path, *args, **kwargs):
        if os.path.basename(path) == ".old-step-4" and os.path.exists(path):
            raise KeyboardInterrupt  # the kill, part way through deleting the old copy
        return real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(checkpoint.shutil, "rmtree", killed_in_delete)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(out, 4, {"model": model}, keep_last=1)
    monkeypatch.setattr(checkpoint.shutil, "rmtree", real_rmtree)
    assert load_latest(out, {"model": model})["step"] == 4


def test_a_kill_while_an_old_checkpoint_is_pruned_leaves_no_partial_step_folder(tmp_path, monkeypatch):
    """Pruning deletes GBs: a kill part way must not leave a half-deleted ``step-N``. Here the step-8 of a run this
    one resumed behind (its pointer said step-4) is pruned by the step-6 save; half deleted under its own name, a
    later resume without the pointer would take it for the newest checkpoint."""
    import shutil

    import fastrlhf.engine.checkpoint as checkpoint

    model = torch.nn.Linear(2, 2)
    out = str(tmp_path)
    for step in (4, 8):
        save_checkpoint(out, step, {"model": model})
    root = checkpoint.checkpoint_root(out)
    with open(os.path.join(root, "latest"), "w") as f:
        f.write("step-4\n")
    real_rmtree = shutil.rmtree

    def killed_in_delete(path, *args, **kwargs):
        if os.path.isdir(path) and os.listdir(path):  # the step folder being pruned: its first file, then the kill
            os.remove(os.path.join(path, sorted(os.listdir(path))[0]))
            raise KeyboardInterrupt
        return real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(checkpoint.shutil, "rmtree", killed_in_delete)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(out, 6, {"model": model}, keep_last=2)
    monkeypatch.setattr(checkpoint.shutil, "rmtree", real_rmtree)
    assert sorted(n for n in os.listdir(root) if n.startswith("step-")) == ["step-4", "step-6"]
    os.remove(os.path.join(root, "latest"))
    assert load_latest(out, {"model": model})["step"] == 6


def test_keeping_the_last_k_never_deletes_the_checkpoint_just_written(tmp_path):
    """A pointer that lagged its rename (a kill between them) resumes at step 4 with a step-6 folder beside it: the
    step-5 save with keep_checkpoints 1 deleted step-5 itself and kept step-6, from the abandoned run."""
    from fastrlhf.engine.checkpoint import checkpoint_root, latest_checkpoint

    model = torch.nn.Linear(2, 2)
    out = str(tmp_path)
    for step in (4, 6):
        save_checkpoint(out, step, {"model": model})
    root = checkpoint_root(out)
    with open(os.path.join(root, "latest"), "w") as f:
        f.write("step-4\n")
    save_checkpoint(out, 5, {"model": model}, keep_last=1)
    assert latest_checkpoint(out) == os.path.join(root, "step-5")
    assert sorted(os.listdir(root)) == ["latest", "step-5"]
    for step in (6, 7, 8):
        save_checkpoint(out, step, {"model": model}, keep_last=2)
    assert sorted(os.listdir(root)) == ["latest", "step-7", "step-8"]


def test_resuming_a_finished_run_exports_without_writing_its_checkpoint_again(tmp_path, monkeypatch):
    """A run killed in its export (after its final checkpoint) and resumed has no step left: it rewrote that whole
    checkpoint (minutes for a 1.5B model's optimizer state) for state it had just loaded from it."""
    import fastrlhf.engine.loop as loop
    import fastrlhf.modeling

    config = _config(output_dir=str(tmp_path))
    saved, exported = [], []
    monkeypatch.setattr(loop, "save_checkpoint", lambda *args, **kwargs: saved.append(args[1]))
    monkeypatch.setattr(fastrlhf.modeling, "export_hf", lambda *args, **kwargs: exported.append(args[1]))
    t = config.trainer
    loop.run_steps(
        config,
        lambda step: pytest.fail("no step is left to run"),
        start_step=t.max_steps,
        stateful={},
        logger=NullLogger(),
        guard=StepGuard(3),
        skip_reason="",
        export_engine=None,
    )
    assert saved == [] and exported == [os.path.join(str(tmp_path), "final")]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_killed_ppo_lora_run_with_warmup_and_a_skipped_step_resumes_as_the_uninterrupted_one(tmp_path):
    """PPO (critic), LoRA at ZeRO-0, an lr warm-up held by a skipped step (NaN rewards in step 2), the adaptive KL:
    killed in step 3 after the step-2 checkpoint, the resumed run logs and ends as the uninterrupted run."""
    import subprocess

    import yaml
    from helpers.rl_runs import (
        TRAIN,
        assert_resumed_like_straight,
        grpo_config,
        launch_env,
        make_tiny,
        metrics_by_step,
    )

    tiny = make_tiny(tmp_path)
    trainer = {"warmup_steps": 4, "kl_target": 0.01, "kl_horizon": 10}

    def config(out):
        path = grpo_config(
            tiny,
            out,
            reward="kill_reward:reward",
            trainer=trainer,
            model={"path": str(tiny / "model"), "lora_r": 4},
            deepspeed={"zero_stage": 0},
        )
        with open(path) as f:
            run = yaml.safe_load(f)
        run.update(algorithm="ppo", critic={})
        with open(path, "w") as f:
            yaml.safe_dump(run, f)
        return path

    straight, killed = tmp_path / "straight", tmp_path / "killed"
    env = launch_env(FASTRLHF_TEST_NAN_CALLS="5-8")  # step 2's four rewards
    for out, extra, code in (
        (straight, {}, 0),
        (killed, {"FASTRLHF_TEST_KILL_ONCE": str(killed / "checkpoints" / "latest")}, -9),
    ):
        result = subprocess.run(
            [*TRAIN, config(out)], env={**env, **extra}, capture_output=True, text=True, timeout=240
        )
        assert result.returncode == code, result.stderr[-3000:]
    assert (killed / "checkpoints" / "latest").read_text().strip() == "step-2"
    env.pop("FASTRLHF_TEST_NAN_CALLS")
    result = subprocess.run([*TRAIN, config(killed), "--resume"], env=env, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    assert_resumed_like_straight(
        straight,
        killed,
        (
            "reward_mean",
            "policy_loss",
            "value_loss",
            "kl",
            "kl_coef",
            "lr",
            "grad_norm",
            "critic_grad_norm",
            "skipped_steps",
        ),
    )
    records = metrics_by_step(straight)
    assert [records[s]["skipped"] for s in (1, 2, 3, 4)] == [0.0, 1.0, 0.0, 0.0]
    assert [records[s]["lr"] for s in (1, 2, 3, 4)] == pytest.approx([7.5e-3, 7.5e-3, 1e-2, 1e-2])  # held at step 2


def test_a_problem_one_rank_finds_in_its_checkpoint_file_is_raised_on_every_rank(tmp_path, monkeypatch):
    """Rank 3's missing or torn file raised on rank 3 alone: its one line went nowhere (the command line prints on
    rank 0), and rank 0 waited in DeepSpeed's collective load until the timeout. The ranks now agree first."""
    from fastrlhf.distributed import comm
    from fastrlhf.engine.checkpoint import CheckpointError

    model = torch.nn.Linear(2, 2)
    save_checkpoint(str(tmp_path), 2, {"model": model})
    seen = []

    def gathered(data):  # as rank 0 of 4, whose rank 3 found its file missing
        seen.append(data)
        return [data, b"", b"", b"step-2 has no state for rank 3: resume with the world size it was saved with"]

    monkeypatch.setattr(comm, "gather_bytes", gathered)
    with pytest.raises(CheckpointError, match="^step-2 has no state for rank 3"):
        load_latest(str(tmp_path), {"model": model})
    assert seen == [b""]  # rank 0's own file was fine
    (tmp_path / "checkpoints" / "step-2" / "rank-0.pt").write_bytes(b"torn")
    monkeypatch.setattr(comm, "gather_bytes", lambda data: [data])
    with pytest.raises(CheckpointError, match=r"rank-0.pt cannot be read \(UnpicklingError"):
        load_latest(str(tmp_path), {"model": model})

