"""What the tests that run ``fastrlhf train`` as a process share: the child environment, the tiny model
and prompts, the short GRPO config, and readers of a run's metrics and exported weights."""

import json
import os
import sys

import yaml

from helpers.paths import ROOT

SCRIPTS = os.path.join(ROOT, "tests", "rl", "scripts")
PY = sys.executable
DEEPSPEED = os.path.join(os.path.dirname(PY), "deepspeed")
TRAIN = [PY, "-m", "fastrlhf", "train", "--config"]
# Everything a launcher (or an in-process vLLM engine of an earlier test) may leave that says how many
# ranks and nodes there are: a stray LOCAL_WORLD_SIZE would make WORLD_SIZE=2 two nodes.
LAUNCH_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE", "LOCAL_SIZE",
              "GROUP_WORLD_SIZE", "GROUP_RANK", "CROSS_SIZE", "CROSS_RANK")


def launch_env(**extra):
    """The environment of a launched run: none of this process's rendezvous variables (a launcher sets
    its own), one thread per rank, a short collective timeout, no progress bar, the test reward
    functions importable, and Python's fault handler on: a rank killed by a signal (SIGABRT, SIGSEGV
    inside gloo or DeepSpeed) prints every thread's Python stack, not only the launcher's exit code."""
    e = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV}
    # One thread per rank: two ranks on a shared 2-core machine otherwise spin against each other.
    e.update(OMP_NUM_THREADS="1", FASTRLHF_DIST_TIMEOUT="120", FASTRLHF_NO_PROGRESS="1", PYTHONFAULTHANDLER="1",
             PYTHONPATH=os.pathsep.join([SCRIPTS, e.get("PYTHONPATH", "")]))
    e.update(extra)
    return e


def make_tiny(root):
    """A tiny Llama (``root/model``, head size 32: the smallest the vLLM CPU backend runs) and 8 prompts
    (``root/prompts.jsonl``); returns ``root``."""
    from fastrlhf.modeling.tiny import save_tiny_llama

    save_tiny_llama(root / "model", vocab_size=64, hidden_size=32, num_heads=1)
    with open(root / "prompts.jsonl", "w") as f:
        for i in range(8):
            f.write(json.dumps({"prompt_ids": [5 + i, 6 + i, 7], "meta": {"target_token": 3}}) + "\n")
    return root


def grpo_config(tiny, out_dir, reward=None, trainer=None, **sections):
    """The short GRPO run config these tests share (written beside ``out_dir``; returns its path), with
    ``reward.function``, ``trainer`` keys and whole sections replaced."""
    config = {
        "algorithm": "grpo", "output_dir": str(out_dir), "seed": 3,
        "model": {"path": str(tiny / "model")},
        "reward": {"function": "kill_reward:reward"},
        "data": {"prompts": str(tiny / "prompts.jsonl"), "max_prompt_len": 16},
        "rollout": {"engine": "hf", "n": 2, "max_new_tokens": 5},
        "trainer": {"max_steps": 4, "prompts_per_step": 2, "minibatch_size": 2, "lr": 1e-2, "kl_coef": 0.05,
                    "save_every": 2},
        "deepspeed": {"zero_stage": 1},
        **sections,
    }
    if reward is not None:
        config["reward"]["function"] = reward
    config["trainer"].update(trainer or {})
    path = out_dir.parent / f"{out_dir.name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


def final_weights(out_dir):
    from safetensors.torch import load_file

    return load_file(str(out_dir / "final" / "model.safetensors"))


def metrics_by_step(out_dir):
    with open(out_dir / "metrics.jsonl") as f:
        return {r["step"]: r for r in map(json.loads, f)}


def assert_resumed_like_straight(straight, resumed, keys, steps=(3, 4)):
    """The resumed run logged every step, its metrics ``keys`` of ``steps`` equal the uninterrupted run's, and
    both ended with the same weights."""
    import pytest
    import torch

    a, b = metrics_by_step(straight), metrics_by_step(resumed)
    assert sorted(b) == sorted(a)
    for step in steps:
        for key in keys:
            assert a[step][key] == pytest.approx(b[step][key], rel=1e-6, abs=1e-9), (step, key)
    wa, wb = final_weights(straight), final_weights(resumed)
    assert wa.keys() == wb.keys()
    for name in wa:
        assert torch.allclose(wa[name], wb[name], atol=1e-6), name
