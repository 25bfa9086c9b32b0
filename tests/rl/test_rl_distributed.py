"""The train loop under real launchers: 2 ranks at ZeRO-2 and ZeRO-3 (PPO and GRPO), and a GRPO run
killed mid-step and resumed, which must end where the uninterrupted run ends."""

import json
import math
import os
import signal

import pytest
from helpers.launch import run_group
from helpers.rl_runs import (
    DEEPSPEED,
    PY,
    SCRIPTS,
    assert_resumed_like_straight,
    final_weights,
    grpo_config,
    launch_env,
    make_tiny,
    metrics_by_step,
)

from fastrlhf.distributed import free_port


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("rl"))


@pytest.mark.timeout(560)
def test_two_ranks_zero2_zero3_ppo_grpo(tiny):
    # HF engines for the tiny model (faster than vLLM below ~4M parameters on CPU), plus one vLLM-backed
    # case whose weights reach vLLM through the ZeRO-3 bucketed gather, and a LoRA actor at ZeRO-3
    # whose separate engine gets the adapter merged in on every sync.
    cases = ["grpo:2:hf", "grpo:3:hf", "ppo:2:hf", "ppo:3:hf", "grpo:3:vllm", "grpo:3:hf:lora"]
    port = free_port()
    rc, out = run_group([DEEPSPEED, "--num_gpus", "2", "--master_port", str(port),
                         os.path.join(SCRIPTS, "two_rank_steps.py"), str(tiny / "model"), str(tiny / "prompts.jsonl"),
                         str(tiny), *cases], timeout=540, env=launch_env())
    assert rc == 0, out[-4000:]
    # DeepSpeed's shared-memory all-reduce buffers (66 MiB of RAM per rank) do not outlive the run.
    assert [f for f in os.listdir("/dev/shm") if f.endswith((f"_{port}_0", f"_{port}_1"))] == []
    for case in cases:
        ranks = [json.load(open(tiny / f"{case.replace(':', '-')}-rank{r}.json")) for r in range(2)]
        for r, result in enumerate(ranks):
            assert result["finite"], (case, r, result["metrics"])
            assert result["synced"], f"{case}: rank {r}'s rollout engine does not hold the actor's weights"
            assert len(result["metrics"]) == 2 and all(m["skipped"] == 0.0 for m in result["metrics"])
            assert all(m["optimizer_steps"] == 2.0 for m in result["metrics"])
        # Data parallel: both ranks end with the same weights.
        assert ranks[0]["checksum"] == ranks[1]["checksum"], case
        last = ranks[0]["metrics"][-1]
        # ZeRO-3 generates with a separate copy that is synced (bucketed); ZeRO-2 shares the module.
        assert (last["sync_bytes"] > 0) == (":3:" in case or case.endswith("vllm")), (case, last["sync_bytes"])
        assert last["generated_tokens"] > 0 and last["tokens_per_second"] > 0
        if case.startswith("ppo"):
            assert last["value_loss"] >= 0.0
        if case.startswith("grpo") and case.endswith("hf"):
            # A NaN reward, then a NaN loss, on rank 1 only: both ranks skip both updates.
            for r, result in enumerate(ranks):
                assert result["guard"] == {"nan_reward_skipped": 1.0, "nan_loss_skipped": 1.0, "skipped_steps": 2.0,
                                           "unchanged_after_nan_reward": True,
                                           "unchanged_after_nan_loss": True}, (case, r, result["guard"])


@pytest.mark.timeout(420)
def test_kill_and_resume_matches_uninterrupted_grpo_run(tiny):
    train = [PY, "-m", "fastrlhf", "train", "--config"]
    straight, killed = tiny / "straight", tiny / "killed"
    # The KL coefficient adapts (trainer.kl_target): its value is part of the state a resume must restore.
    adaptive = {"kl_target": 0.01, "kl_horizon": 10}
    rc, out = run_group(train + [grpo_config(tiny, straight, trainer=adaptive)], env=launch_env(), timeout=300)
    assert rc == 0, out[-4000:]

    # 4 sequences are scored per step: the 9th reward call is inside step 3, after the step-2 checkpoint.
    rc, out = run_group(train + [grpo_config(tiny, killed, trainer=adaptive)], timeout=300,
                        env=launch_env(FASTRLHF_TEST_KILL_AFTER_CALLS="8"))
    assert rc == -signal.SIGKILL, out[-4000:]
    assert (killed / "checkpoints" / "latest").read_text().strip() == "step-2"
    assert not (killed / "final").exists()

    rc, out = run_group(train + [grpo_config(tiny, killed, trainer=adaptive), "--resume"], env=launch_env(),
                        timeout=300)
    assert rc == 0, out[-4000:]
    assert sorted(metrics_by_step(killed)) == [1, 2, 3, 4]
    assert_resumed_like_straight(straight, killed, ("reward_mean", "policy_loss", "kl", "entropy", "grad_norm",
                                                    "generated_tokens", "kl_coef"))
    coefs = [metrics_by_step(straight)[step]["kl_coef"] for step in (1, 2, 3, 4)]
    assert coefs[0] == 0.05 and len(set(coefs)) == 4, coefs  # it moved every step, from trainer.kl_coef
    wa = final_weights(straight)
    # The run really trained (lr 1e-2): the final weights are not the initial ones.
    from safetensors.torch import load_file

    initial = load_file(str(tiny / "model" / "model.safetensors"))
    assert max(float((wa[n] - initial[n]).abs().max()) for n in wa) > 1e-3


@pytest.mark.timeout(300)
def test_too_many_skipped_rl_steps_stop_with_a_checkpoint(tiny):
    out = tiny / "nan_run"
    path = grpo_config(tiny, out, reward="nan_reward:reward", trainer={"max_steps": 5, "max_skipped_steps": 2})
    rc, text = run_group([PY, "-m", "fastrlhf", "train", "--config", path], env=launch_env(), timeout=300)
    assert rc == 1, text[-4000:]
    assert "2 steps in a row" in text, text[-4000:]
    records = metrics_by_step(out)
    # The step that stops the run is logged too, and the last good weights are checkpointed.
    assert sorted(records) == [1, 2] and all(r["skipped"] == 1.0 for r in records.values())
    assert records[2]["skipped_steps"] == 2.0
    # No finite reward: NaN logged as JSON numbers (read back as floats), not "nan" strings nor a made-up 0.0.
    assert all(math.isnan(r[k]) for r in records.values() for k in ("reward_mean", "advantage_mean")), records
    assert (out / "checkpoints" / "latest").read_text().strip() == "step-2"
    assert not (out / "final").exists()



@pytest.mark.timeout(300)
def test_validation_runs_every_k_steps_and_stops_the_run_at_its_target(tiny):
    out = tiny / "eval_run"
    # stop_at 0: the first validation (step 2) reaches it, so steps 3-6 never run.
    path = grpo_config(tiny, out, reward="target_token", trainer={"max_steps": 6, "save_every": 0},
                          eval={"data": str(tiny / "prompts.jsonl"), "every": 2, "group_by": "target_token",
                                "stop_at": 0.0})
    rc, text = run_group([PY, "-m", "fastrlhf", "train", "--config", path], env=launch_env(), timeout=300)
    assert rc == 0, text[-4000:]
    assert "stopping early" in text, text[-4000:]
    records = metrics_by_step(out)
    assert sorted(records) == [0, 1, 2]  # step 0: validation before training
    assert "eval/reward_mean" not in records[1] and "reward_mean" not in records[0]
    assert 0.0 <= records[2]["eval/reward_mean"] <= 1.0
    assert records[2]["eval/reward_mean/3"] == records[2]["eval/reward_mean"]  # every prompt is in group 3
    # Every held-out prompt's completion, gathered from both ranks, in prompt order.
    for step in (0, 2):
        lines = [json.loads(x) for x in (out / "eval" / f"step-{step}.jsonl").read_text().splitlines()]
        n_prompts = sum(1 for x in (tiny / "prompts.jsonl").read_text().splitlines() if x.strip())
        assert [r["index"] for r in lines] == list(range(n_prompts))
        assert all(r["finish_reason"] in ("stop", "length") and "completion_ids" in r for r in lines)
    assert (out / "checkpoints" / "latest").read_text().strip() == "step-2"
    assert (out / "final" / "model.safetensors").exists()
