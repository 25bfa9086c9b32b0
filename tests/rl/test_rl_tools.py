"""`fastrlhf train` with multi-turn tool-use episodes (rollout.tools / rollout.environment): a bad tool is refused
before any model loads, GRPO on 2 ranks under the deepspeed launcher, PPO on vLLM rollouts, and a run killed
mid-step and resumed ends where the uninterrupted one ends."""

import json
import signal
import subprocess
import time

import pytest
import yaml
from helpers.launch import run_group
from helpers.rl_runs import DEEPSPEED, PY, assert_resumed_like_straight, launch_env, metrics_by_step

from fastrlhf.distributed import free_port

pytestmark = pytest.mark.slow

TRAIN = [PY, "-m", "fastrlhf", "train", "--config"]


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    """A tiny Qwen2 chat model (head size 32, chat template with tools) and 8 chat prompts."""
    from fastrlhf.modeling.tiny_chat import build_chat_model, build_chat_tokenizer, save_chat_model

    root = tmp_path_factory.mktemp("tools")
    tokenizer = build_chat_tokenizer()
    model = build_chat_model(tokenizer, seed=0, vocab_rows=640, hidden_size=64, intermediate_size=128,
                             num_attention_heads=2, num_key_value_heads=1, num_hidden_layers=2)
    save_chat_model(root / "model", model, tokenizer)
    with open(root / "prompts.jsonl", "w") as f:
        for i in range(8):
            f.write(json.dumps({"messages": [{"role": "user", "content": f"Count to {i}."}]}) + "\n")
    return root


def tool_config(chat, out_dir, algorithm="grpo", rollout=None, trainer=None, **sections) -> str:
    config = {
        "algorithm": algorithm, "output_dir": str(out_dir), "seed": 3, "imports": ["tool_run"],
        "model": {"path": str(chat / "model")},
        "reward": {"function": "kill_reward:reward"},
        "data": {"prompts": str(chat / "prompts.jsonl"), "max_prompt_len": 400},
        "rollout": {"engine": "hf", "n": 2, "max_new_tokens": 12, "environment": "tool_run:Counter",
                    "tools": ["tool_run:add"], "tool_parser": "every-turn", "max_turns": 3,
                    "stop_token_ids": list(range(4, 640, 3)), **(rollout or {})},
        "trainer": {"max_steps": 4, "prompts_per_step": 2, "minibatch_size": 2, "lr": 1e-2, "kl_coef": 0.05,
                    "save_every": 2, **(trainer or {})},
        "deepspeed": {"zero_stage": 1},
        **sections,
    }
    if algorithm == "ppo":
        config["critic"] = {"path": None}
    path = out_dir.parent / f"{out_dir.name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


def test_a_tool_that_does_not_import_is_refused_in_one_line_before_any_model_loads(chat):
    out = chat / "bad"
    config = tool_config(chat, out, rollout={"tools": ["tool_run:add", "no_such_module:calculator"]})
    started = time.monotonic()
    result = subprocess.run([*TRAIN, config], cwd=chat, env=launch_env(), capture_output=True, text=True, timeout=120)
    took = time.monotonic() - started
    assert result.returncode == 2, result.stderr[-3000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("config error: rollout.tools: cannot import module "
                                                   "'no_such_module' for 'no_such_module:calculator'"), lines
    assert not out.exists(), f"the refused run wrote {out} (in {took:.1f} s)"


def test_an_environment_without_get_reward_is_no_reward_on_its_own(chat):
    out = chat / "no_reward"
    config = tool_config(chat, out, rollout={"environment": "tool_run:Silent"}, reward={})
    result = subprocess.run([*TRAIN, config], cwd=chat, env=launch_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.strip().splitlines() == [
        "config error: reward: set reward.function, reward.functions or reward.model_path, got neither (and "
        "rollout.environment tool_run:Silent has no get_reward())"]


@pytest.mark.timeout(600)
def test_grpo_episodes_on_two_ranks_under_the_deepspeed_launcher(chat):
    out = chat / "two_ranks"
    config = tool_config(chat, out, trainer={"max_steps": 2, "save_every": 0, "prompts_per_step": 2,
                                             "minibatch_size": 4},
                         eval={"data": str(chat / "prompts.jsonl"), "every": 2, "max_reward": 0.1, "temperature": 1.0},
                         deepspeed={"zero_stage": 2})
    rc, log = run_group([DEEPSPEED, "--num_gpus", "2", "--master_port", str(free_port()), "--module", "fastrlhf",
                         "train", "--config", config], env=launch_env(), timeout=540, cwd=str(chat))
    assert rc == 0, log[-4000:]
    metrics = metrics_by_step(out)
    assert sorted(metrics) == [0, 1, 2]
    for step in (1, 2):
        m = metrics[step]
        assert m["skipped"] == 0.0 and m["optimizer_steps"] == 1.0
        assert m["tools/calls"] > 0 and m["tools/turns"] > 1.0 and m["tools/errors"] == 0.0
        assert m["reward/Counter"] > 0  # the environment's get_reward, a reward source of its own
        assert m["logprob_mismatch_mean"] < 1e-3  # the probe on episode tokens, as on single turns
    assert metrics[2]["eval/reward_mean"] > 0
    episodes = [json.loads(line) for line in (out / "eval" / "step-2.jsonl").read_text().splitlines()]
    assert len(episodes) == 8 and all(e["turns"] >= 1 for e in episodes)
    assert any("<tool_response>" in e["completion"] for e in episodes)


@pytest.mark.timeout(400)
def test_ppo_episodes_on_vllm_rollouts(chat):
    pytest.importorskip("vllm")
    out = chat / "ppo_vllm"
    config = tool_config(chat, out, algorithm="ppo", rollout={"engine": "vllm", "kv_cache_bytes": 33554432},
                         trainer={"max_steps": 2, "save_every": 0, "save_final": False})
    result = subprocess.run([*TRAIN, config], cwd=chat, env=launch_env(), capture_output=True, text=True, timeout=360)
    assert result.returncode == 0, result.stderr[-4000:]
    metrics = metrics_by_step(out)
    for step in (1, 2):
        m = metrics[step]
        assert m["skipped"] == 0.0 and m["tools/calls"] > 0 and m["value_loss"] >= 0.0
        assert m["logprob_mismatch_mean"] < 1e-3
    assert metrics[2]["tools/prefix_cache_hit"] >= 0.0  # vLLM reports what its prefix cache served


@pytest.mark.timeout(500)
def test_a_killed_tool_run_resumes_where_the_uninterrupted_run_ends(chat):
    straight, killed = chat / "straight", chat / "killed"
    rc, log = run_group([*TRAIN, tool_config(chat, straight)], env=launch_env(), timeout=300, cwd=str(chat))
    assert rc == 0, log[-4000:]
    # 4 episodes are scored per step: the 9th reward call is inside step 3, after the step-2 checkpoint.
    rc, log = run_group([*TRAIN, tool_config(chat, killed)], env=launch_env(FASTRLHF_TEST_KILL_AFTER_CALLS="8"),
                        timeout=300, cwd=str(chat))
    assert rc == -signal.SIGKILL, log[-4000:]
    rc, log = run_group([*TRAIN, tool_config(chat, killed), "--resume"], env=launch_env(), timeout=300,
                        cwd=str(chat))
    assert rc == 0, log[-4000:]
    assert sorted(metrics_by_step(killed)) == [1, 2, 3, 4]
    assert_resumed_like_straight(straight, killed, ("reward_mean", "policy_loss", "kl", "tools/calls", "tools/turns",
                                                    "generated_tokens"))
