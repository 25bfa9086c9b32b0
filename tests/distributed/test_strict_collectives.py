"""No host tensor reaches an NCCL collective: the 2-rank paths under strict collectives.

gloo, the only backend a CPU machine has, accepts host tensors, so a CPU run of code that hands
``torch.tensor([x])`` to the default group passes, and the same code raises at step 1 on a GPU
node, where that group is NCCL ("No backend type associated with device type cpu"). Strict
collectives (``tests/helpers/strict_collectives.py``) declare the default group NCCL and reject any tensor
not placed for it by ``fastrlhf.distributed.comm``; see that module for how the check works without a GPU.
"""

import json
import os
import sys

import pytest
import torch
import torch.distributed as dist
import yaml
from helpers.launch import run_group
from helpers.paths import ROOT
from helpers.rl_runs import launch_env
from helpers.strict_collectives import StrictCollectiveError, install

from fastrlhf.distributed import comm, free_port

SCRIPT = os.path.join(ROOT, "tests", "rl", "scripts", "strict_collectives_run.py")
DEEPSPEED = os.path.join(os.path.dirname(sys.executable), "deepspeed")
VOCAB = 64


def test_device_for_backend_puts_nccl_tensors_on_the_ranks_own_gpu():
    assert comm.device_for_backend("nccl", 3) == torch.device("cuda", 3)
    assert comm.device_for_backend("cpu:gloo,cuda:nccl", 1) == torch.device("cuda", 1)
    assert comm.device_for_backend("gloo", 3) == torch.device("cpu")


@pytest.fixture
def one_rank_gloo():
    if dist.is_initialized():  # an earlier in-process test (SFT, RM) left its one-rank group
        assert dist.get_world_size() == 1 and dist.get_backend() == "gloo"
        yield
        return
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_strict_collectives_reject_a_host_tensor_that_comm_did_not_place(one_rank_gloo):
    """The check can fail: the very call today's metric reductions made is refused, one that went
    through comm's placement is not."""
    strict = install()
    try:
        with pytest.raises(StrictCollectiveError, match="No backend type associated with device type cpu"):
            dist.all_reduce(torch.tensor([1.0, 2.0], dtype=torch.float64))
        with pytest.raises(StrictCollectiveError, match="object collectives"):
            dist.all_gather_object([None], torch.zeros(2))
        with pytest.raises(StrictCollectiveError, match="device_ids"):
            dist.barrier()
        placed = comm.to_collective_device(torch.tensor([1.0, 2.0]))
        dist.all_reduce(placed)
        comm.barrier()  # world size 1: no call; the launcher test below covers 2 ranks
        assert strict.checked == {f"{__name__}.all_reduce": 1}
    finally:
        strict.uninstall()


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    import random

    from fastrlhf.modeling.tiny import save_tiny_llama

    root = tmp_path_factory.mktemp("strict")
    save_tiny_llama(root / "model", vocab_size=VOCAB, hidden_size=32, num_heads=1)
    rng = random.Random(0)
    rows = {
        "prompts": [{"prompt_ids": [5 + i, 6 + i, 7], "meta": {"target_token": 3}} for i in range(8)],
        "sft": [{"prompt_ids": [rng.randrange(3, VOCAB) for _ in range(3)],
                 "response_ids": [rng.randrange(3, VOCAB) for _ in range(3)]} for _ in range(8)],
        "pairs": [{"prompt_ids": [rng.randrange(3, VOCAB) for _ in range(3)],
                   "chosen_ids": [rng.randrange(3, 20) for _ in range(3)],
                   "rejected_ids": [rng.randrange(44, VOCAB) for _ in range(3)]} for _ in range(8)],
        "cls": [{"input_ids": [rng.randrange(3, VOCAB) for _ in range(4)], "label": i % 2} for i in range(8)],
    }
    for name, lines in rows.items():
        (root / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    return root


def _config(root, name, raw):
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump({"output_dir": str(root / name), "model": {"path": str(root / "model")}, **raw}))
    return str(path)


def _plan(root):
    rl = {"reward": {"function": "target_token"}, "data": {"prompts": str(root / "prompts.jsonl"), "max_prompt_len": 8},
          "rollout": {"engine": "hf", "n": 2, "max_new_tokens": 4},
          "trainer": {"max_steps": 3, "prompts_per_step": 4, "minibatch_size": 4, "grad_accum": 2, "lr": 1e-3,
                      "kl_coef": 0.05, "tis_cap": 2.0, "old_logprobs": "recompute", "save_every": 2}}
    zero3 = {"zero_stage": 3, "extra": {"zero_optimization": {"stage3_param_persistence_threshold": 0}}}
    small = {"max_steps": 3, "batch_size": 4, "lr": 1e-3, "save_every": 2}
    configs = {
        # GRPO with validation: the held-out reward is reduced over the ranks too. Packed, with a token
        # budget: the ranks agree on their micro-batch counts in one more collective.
        "grpo": {**rl, "algorithm": "grpo", "deepspeed": {"zero_stage": 2},
                 "eval": {"data": str(root / "prompts.jsonl"), "every": 2},
                 "trainer": {**rl["trainer"], "grad_accum": 1, "packing": True, "max_tokens_per_microbatch": 12}},
        # PPO: critic, GAE, advantages whitened over both ranks, KL in the reward.
        "ppo": {**rl, "algorithm": "ppo", "critic": {"lr": 1e-3}, "deepspeed": zero3,
                "trainer": {**rl["trainer"], "kl_in_reward": True}},
        "sft": {"data": {"path": str(root / "sft.jsonl"), "max_len": 16}, "trainer": small,
                "deepspeed": {"zero_stage": 2}},
        "rm_pairwise": {"kind": "pairwise", "data": {"path": str(root / "pairs.jsonl"), "max_len": 16},
                        "trainer": {**small, "packing": True, "max_tokens_per_microbatch": 16}, "deepspeed": zero3},
        "rm_classifier": {"kind": "classifier", "data": {"path": str(root / "cls.jsonl"), "max_len": 16},
                          "trainer": small, "deepspeed": {"zero_stage": 1}},
    }
    command = {"grpo": "train", "ppo": "train", "sft": "sft", "rm_pairwise": "rm", "rm_classifier": "rm"}
    plan = []
    for name, raw in configs.items():
        path = _config(root, name, raw)
        plan.append([command[name], "--config", path])
        # Resume from the step-2 checkpoint: the load path runs under the same checks.
        plan.append([command[name], "--config", path, "--resume", "--set", f"trainer.max_steps={4}"])
    return plan


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_strict_collectives_two_ranks_rl_sft_rm_and_checkpoints(workdir):
    plan_path = workdir / "plan.json"
    plan_path.write_text(json.dumps(_plan(workdir)))
    env = launch_env()
    rc, out = run_group([DEEPSPEED, "--num_gpus", "2", "--master_port", str(free_port()), SCRIPT, str(plan_path),
                         str(workdir)], timeout=400, env=env)
    assert rc == 0, out[-6000:]
    for rank in range(2):
        report = json.loads((workdir / f"strict-rank{rank}.json").read_text())
        assert report["declared"] == f"cuda:{rank}"
        # Every collective our code made went through fastrlhf.distributed.comm, and there were many of them
        # (metrics, NaN guard every optimizer step, whitening, SFT/RM metrics): the checks ran.
        owners = {key.rsplit(".", 1)[0] for key in report["checked"]}
        assert owners == {"fastrlhf.distributed.comm"}, report["checked"]
        assert report["checked"]["fastrlhf.distributed.comm.all_reduce"] >= 50, report
        assert report["barriers"].get("fastrlhf.distributed.comm", 0) >= 10, report  # checkpoints and exports
        assert sum(report["library"].values()) > 0, report  # DeepSpeed's own, counted not checked
    for name in ("grpo", "ppo", "sft", "rm_pairwise", "rm_classifier"):
        records = [json.loads(line) for line in open(workdir / name / "metrics.jsonl")]
        if name == "grpo":  # validated before training, every 2 steps and at each run's last step (3, then 4)
            assert [r["step"] for r in records if "eval/reward_mean" in r] == [0, 2, 3, 4], records
            assert sorted(os.listdir(workdir / name / "eval")) == [f"step-{s}.jsonl" for s in (0, 2, 3, 4)]
            records = [r for r in records if r["step"] > 0]
        assert [r["step"] for r in records] == [1, 2, 3, 4], name
        assert (workdir / name / "final" / "config.json").exists(), name
        # Every command records its resolved config, auto precision made concrete (fp32 on a CPU).
        resolved = yaml.safe_load((workdir / name / "config.yaml").read_text())
        assert (resolved["model"]["dtype"], resolved["deepspeed"]["bf16"]) == ("float32", False), name
