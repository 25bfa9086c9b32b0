"""``critic.export: true``: a PPO run exports its trained critic to ``final/critic`` (OpenRLHF's
``--critic.save_value_network``), the folder ``reward.model_kind: value_head`` and ``critic.path`` read. The docs
named "a PPO critic's final/" as such a folder, but no command wrote one: only the actor was exported."""

import subprocess

import torch
import yaml
from helpers.rl_runs import TRAIN, grpo_config, launch_env, make_tiny

from fastrlhf.config import ModelConfig, load_config
from fastrlhf.modeling import load_value_model


def test_a_ppo_run_exports_its_critic_where_a_value_head_reward_reads_it(tmp_path):
    tiny = make_tiny(tmp_path)
    out = tmp_path / "ppo"
    config = grpo_config(tiny, out, algorithm="ppo", critic={"lr": 1e-3, "export": True},
                         trainer={"max_steps": 2, "save_every": 0})
    result = subprocess.run([*TRAIN, config], env=launch_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    critic_dir = out / "final" / "critic"
    assert (critic_dir / "value_head.safetensors").exists() and (critic_dir / "config.json").exists()
    assert (out / "final" / "config.json").exists()  # the actor's export, as before
    # A later run scores with it (the config checks read the folder as a value-head reward model) or starts from it.
    later = grpo_config(tiny, tmp_path / "later", algorithm="ppo", critic={"path": str(critic_dir)})
    raw = yaml.safe_load(open(later))
    raw["reward"] = {"model_path": str(critic_dir), "model_kind": "value_head"}
    open(later, "w").write(yaml.safe_dump(raw))
    loaded = load_config(later, "train", on_gpu=False)
    assert loaded.reward.model_path == loaded.critic.path == str(critic_dir)
    critic = load_value_model(ModelConfig(path=str(tiny / "model")), path=str(critic_dir), trainable=False)
    fresh = load_value_model(ModelConfig(path=str(tiny / "model")), trainable=False)
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        trained, untrained = critic(ids), fresh(ids)
    assert torch.isfinite(trained).all() and not torch.equal(trained, untrained)  # the trained head, not a fresh one
