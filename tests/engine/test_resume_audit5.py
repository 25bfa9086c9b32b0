"""Fifth resume audit: a PPO critic checkpoint saved before its untied lm_head was frozen resumes (the trainer builds
the critic as it was saved), the tiny chat model's folder replaced without a window where neither copy exists, the
folders killed saves and deletes leave are swept, and what a resumed run's metrics (jsonl, W&B) keep."""

import os

import pytest
import torch

from fastrlhf import distributed as D
from fastrlhf.config import DeepSpeedConfig, ModelConfig
from fastrlhf.engine.checkpoint import load_latest, save_checkpoint
from fastrlhf.engine.deepspeed import build_train_engine
from fastrlhf.modeling.loading import base_model, load_value_model
from fastrlhf.modeling.tiny import save_tiny_llama


def _critic(folder: str, lm_head_trains: bool = False):
    torch.manual_seed(0)
    critic = load_value_model(ModelConfig(path=folder, dtype="float32"))
    if lm_head_trains:  # as the critic was before its untied lm_head was frozen
        base_model(critic.lm).get_output_embeddings().requires_grad_(True)
    return critic


def _engine(critic, stage: int):
    return build_train_engine(critic, DeepSpeedConfig(zero_stage=stage, bf16=False), lr=1e-2)


def _saved_critic(tmp_path, stage: int, lm_head_trains: bool, tie: bool = False):
    D.init_distributed(timeout_s=60)
    folder = str(tmp_path / "model")
    save_tiny_llama(folder, tie_word_embeddings=tie, num_layers=1)
    old = _engine(_critic(folder, lm_head_trains), stage)
    old.backward(old(torch.randint(0, 200, (2, 8))).pow(2).sum())
    old.step()
    out = str(tmp_path / "run")
    save_checkpoint(out, 1, {"critic": old})
    return folder, out, old


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_a_critic_saved_training_its_untied_lm_head_resumes(tmp_path, stage):
    """Before: refused (engine 'critic' was saved when it trained lm.lm_head.weight ... start again with
    --overwrite); the run's steps were lost. Now the resumed critic trains the head again and loads every state."""
    from fastrlhf.rl.trainer import critic_as_saved

    folder, out, old = _saved_critic(tmp_path, stage, lm_head_trains=True)
    critic = _critic(folder)
    head = base_model(critic.lm).get_output_embeddings()
    assert not head.weight.requires_grad  # as load_value_model freezes it
    assert critic_as_saved(critic, out, lora=False) is True
    assert head.weight.requires_grad
    engine = _engine(critic, stage)
    assert load_latest(out, {"critic": engine})["step"] == 1
    if stage < 3:  # the trained value head came back, not the fresh one
        torch.testing.assert_close(engine.module.v_head.weight, old.module.v_head.weight)
    x = torch.randint(0, 200, (2, 8))
    engine.backward(engine(x).pow(2).sum())
    engine.step()  # the optimizer state loaded is the engine's own: the next update runs


@pytest.mark.parametrize("stage", [0, 2])
def test_a_critic_saved_with_its_lm_head_frozen_keeps_it_frozen(tmp_path, stage):
    from fastrlhf.rl.trainer import critic_as_saved

    folder, out, _ = _saved_critic(tmp_path, stage, lm_head_trains=False)
    critic = _critic(folder)
    assert critic_as_saved(critic, out, lora=False) is False
    assert not base_model(critic.lm).get_output_embeddings().weight.requires_grad
    assert load_latest(out, {"critic": _engine(critic, stage)})["step"] == 1
    # No checkpoint at all (--resume on a fresh folder): frozen too.
    assert critic_as_saved(_critic(folder), str(tmp_path / "none"), lora=False) is False


def test_a_tied_critic_head_is_the_embedding_and_is_left_as_it_is(tmp_path):
    from fastrlhf.rl.trainer import critic_as_saved

    folder, out, _ = _saved_critic(tmp_path, 2, lm_head_trains=False, tie=True)
    critic = _critic(folder)
    assert critic_as_saved(critic, out, lora=False) is False
    assert base_model(critic.lm).get_input_embeddings().weight.requires_grad
    assert load_latest(out, {"critic": _engine(critic, 2)})["step"] == 1


@pytest.mark.parametrize("resume", [True, False])
def test_the_trainer_builds_a_resumed_critic_as_it_was_saved(tmp_path, resume):
    """build_rl_step(resume=True), as run() calls it on --resume: the critic's engine trains the head before it is
    built, so the checkpoint loads; without --resume the head stays frozen."""
    import dataclasses

    from helpers.rl_case import PPO, make_config

    from fastrlhf.engine.guards import StepGuard
    from fastrlhf.rl.trainer import build_rl_step

    folder, out, old = _saved_critic(tmp_path, 2, lm_head_trains=True)
    config = make_config(PPO, engine="hf")
    config = dataclasses.replace(
        config,
        output_dir=out,
        model=ModelConfig(path=folder, dtype="float32"),
        deepspeed=DeepSpeedConfig(zero_stage=2, bf16=False),
    )
    _, stateful = build_rl_step(config, StepGuard(3), resume=resume)
    critic = stateful["critic"]
    assert base_model(critic.module.lm).get_output_embeddings().weight.requires_grad is resume
    if resume:
        assert load_latest(out, {"critic": critic})["step"] == 1
        torch.testing.assert_close(critic.module.v_head.weight, old.module.v_head.weight)


def _tiny_chat_files(folder) -> set[str]:
    return set(os.listdir(folder)) if os.path.isdir(folder) else set()


def test_a_kill_while_the_tiny_chat_model_is_replaced_leaves_a_whole_model(tmp_path, monkeypatch):
    """Before: the old folder was deleted (slow: the embedding alone is 78 MB) before the new one was renamed in; a
    kill during that delete left a folder without its weights, and nothing else."""
    import shutil

    import fastrlhf.modeling.tiny_chat as tiny_chat

    out = str(tmp_path / "chat")
    tiny_chat.save_tiny_chat(out, vocab_rows=1100)
    whole = _tiny_chat_files(out)
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= whole
    real_rmtree = shutil.rmtree

    def killed_in_delete(path, *args, **kwargs):
        if os.path.basename(os.fspath(path)) in ("chat", "chat.old") and os.path.isdir(path):
            os.remove(os.path.join(path, "model.safetensors"))  # part of the delete done, then the kill
            raise KeyboardInterrupt
        return real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(tiny_chat.shutil, "rmtree", killed_in_delete)
    with pytest.raises(KeyboardInterrupt):
        tiny_chat.save_tiny_chat(out, seed=1, vocab_rows=1100)
    assert _tiny_chat_files(out) == whole
    monkeypatch.setattr(tiny_chat.shutil, "rmtree", real_rmtree)


def test_a_kill_between_the_renames_is_put_right_by_the_next_save(tmp_path, monkeypatch):
    import fastrlhf.modeling.tiny_chat as tiny_chat

    out = str(tmp_path / "chat")
    tiny_chat.save_tiny_chat(out, vocab_rows=1100)
    whole = _tiny_chat_files(out)
    real_rename = os.rename

    def killed_before_the_new_one_is_in(src, dst):
        if os.fspath(src).endswith(".tmp"):
            raise KeyboardInterrupt
        return real_rename(src, dst)

    monkeypatch.setattr(tiny_chat.os, "rename", killed_before_the_new_one_is_in)
    with pytest.raises(KeyboardInterrupt):
        tiny_chat.save_tiny_chat(out, seed=1, vocab_rows=1100)
    assert _tiny_chat_files(f"{out}.old") == whole  # the previous model, whole, beside its name
    monkeypatch.setattr(tiny_chat.os, "rename", real_rename)
    tiny_chat.save_tiny_chat(out, seed=1, vocab_rows=1100)
    assert _tiny_chat_files(out) == whole and sorted(os.listdir(tmp_path)) == ["chat"]


def test_the_tiny_chat_model_is_the_same_bytes_whatever_the_global_seed(tmp_path):
    """Its weights come from ``seed`` alone (the tokenizer's training is deterministic): the docs' runs reproduce."""
    import hashlib

    from fastrlhf.modeling.tiny_chat import save_tiny_chat

    def digest(folder):
        h = hashlib.sha256()
        for name in sorted(os.listdir(folder)):
            h.update(name.encode() + open(os.path.join(folder, name), "rb").read())
        return h.hexdigest()

    torch.manual_seed(1)
    save_tiny_chat(tmp_path / "a", vocab_rows=1100)
    torch.manual_seed(2)
    torch.randn(3)
    save_tiny_chat(tmp_path / "b", vocab_rows=1100)
    assert digest(tmp_path / "a") == digest(tmp_path / "b")


@pytest.fixture
def wandb_run_at(monkeypatch):
    """A stand-in ``wandb`` whose resumed run's step counter is ``at[0]`` (what W&B sets: its last step + 1)."""
    import sys
    import types

    at = [0]

    class Run:
        id = "run-1"

        @property
        def step(self):
            return at[0]

        def log(self, metrics, step):
            pass

        def finish(self):
            pass

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=lambda **kwargs: Run()))
    return at


def test_a_resume_behind_the_wandb_run_says_once_which_steps_wandb_drops(tmp_path, wandb_run_at, capsys):
    """Killed at step 7 after its step-3 checkpoint: W&B already holds steps 0-7 and drops the resumed run's
    steps 4-7 (a bare warning per step); before, nothing said why or where they are."""
    from fastrlhf.engine.metrics import MetricsLogger

    MetricsLogger(str(tmp_path), total_steps=9, enabled=True, wandb="online").close()
    wandb_run_at[0] = 8
    capsys.readouterr()
    MetricsLogger(str(tmp_path), total_steps=9, start_step=3, enabled=True, wandb="online", resume=True).close()
    said = capsys.readouterr().err.splitlines()
    assert [line for line in said if "W&B" in line] == [
        "note: W&B run run-1 already holds steps up to 7, past the checkpoint of step 3: W&B keeps the killed run's "
        "values there and drops this run's steps 4-7 (its steps only increase); metrics.jsonl and TensorBoard have "
        "this run's"
    ]
    wandb_run_at[0] = 4  # killed right after the checkpoint: nothing is dropped, nothing said
    MetricsLogger(str(tmp_path), total_steps=9, start_step=3, enabled=True, wandb="online", resume=True).close()
    assert "W&B" not in capsys.readouterr().err


def test_a_resumed_run_s_metrics_jsonl_has_each_step_once(tmp_path):
    """Checked, no defect: the steps after the checkpoint are cut before the resumed run logs them again."""
    from fastrlhf.engine.metrics import MetricsLogger, read_metrics

    logger = MetricsLogger(str(tmp_path), total_steps=6, enabled=True)
    for step in range(6):
        logger.log(step, {"loss": float(step)})
    logger.close()
    resumed = MetricsLogger(str(tmp_path), total_steps=6, start_step=3, enabled=True, resume=True)
    for step in (4, 5):
        resumed.log(step, {"loss": 10.0 + step})
    resumed.close()
    records = read_metrics(str(tmp_path / "metrics.jsonl"))
    assert [(r["step"], r["loss"]) for r in records] == [(0, 0.0), (1, 1.0), (2, 2.0), (3, 3.0), (4, 14.0), (5, 15.0)]


def test_a_kill_while_an_old_checkpoint_is_deleted_leaves_no_folder_behind_for_good(tmp_path, monkeypatch):
    """Before: the half-deleted ``.old-step-1`` (renamed out of the step names so that no resume takes it) stayed
    for the rest of the run, and after it: only a later save of step 1 itself removed it. Same for a save's
    ``.tmp-step-N`` whose step was not saved again."""
    import shutil

    import fastrlhf.engine.checkpoint as checkpoint

    D.init_distributed(timeout_s=60)
    model = torch.nn.Linear(2, 2)
    out = str(tmp_path)
    root = checkpoint.checkpoint_root(out)
    save_checkpoint(out, 1, {"m": model}, keep_last=1)
    real_rmtree = shutil.rmtree

    def killed_in_prune(path, *args, **kwargs):
        if os.path.basename(path) == ".old-step-1" and os.path.exists(path):
            raise KeyboardInterrupt
        return real_rmtree(path, *args, **kwargs)

    monkeypatch.setattr(checkpoint.shutil, "rmtree", killed_in_prune)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(out, 2, {"m": model}, keep_last=1)
    monkeypatch.setattr(checkpoint.shutil, "rmtree", real_rmtree)
    os.makedirs(os.path.join(root, ".tmp-step-7"))  # a save of step 7 killed; the resumed run saves every 5
    assert sorted(os.listdir(root)) == [".old-step-1", ".tmp-step-7", "latest", "step-2"]
    assert load_latest(out, {"m": model})["step"] == 2
    save_checkpoint(out, 5, {"m": model}, keep_last=1)
    assert sorted(os.listdir(root)) == ["latest", "step-5"]
