"""The RL trainer's newer settings as a user runs them, through the command line with a tiny model and in
combination with what they are run with: verl's straight-through KL kinds (``k3+``, ``k1+``, ``low_var_kl+``),
verl's estimators (``grpo_passk``, ``opo``, ``gpg``) and losses (``gpg``, ``clip_cov``, ``kl_cov``),
``trainer.top_entropy_quantile``, ``trainer.tis_floor`` under ``tis_mode: truncate``, SFT's ``data.overlong:
truncate`` and ``--set key[i]``; with packing, shared prompts, dynamic sampling, several minibatches and epochs,
DAPO's overlong filtering, LoRA, vLLM, two ranks at ZeRO-3, a kill and ``--resume``, ``--dry-run`` and ``fastrlhf
plan``. On the emulated second device (helpers.other_device) the step with them reads the device no more often
than without them."""

import json
import math
import os
import subprocess
import sys

import pytest
import yaml
from helpers.launch import run_group
from helpers.paths import ROOT
from helpers.rl_runs import (
    DEEPSPEED,
    TRAIN,
    assert_resumed_like_straight,
    grpo_config,
    launch_env,
    make_tiny,
    metrics_by_step,
)

from fastrlhf.distributed import free_port

CASES = {
    "entropy-passk-gpg-packed-shared-epochs-tis-masked": dict(
        trainer={
            "top_entropy_quantile": 0.5,
            "kl_kind": "k3+",
            "adv_estimator": "grpo_passk",
            "policy_loss": "gpg",
            "packing": True,
            "share_prompts": True,
            "ppo_epochs": 2,
            "minibatch_size": 2,
            "tis_cap": 2.0,
            "tis_floor": 0.5,
            "tis_mode": "truncate",
            "mask_truncated_completions": True,
        },
        # a quarter of the tokens stop a completion: about one in five is cut at 5 tokens and left out of the loss
        rollout={"engine": "hf", "n": 2, "max_new_tokens": 5, "stop_token_ids": list(range(3, 20))},
    ),
    "gpg-klcov-packed-masked": dict(
        trainer={
            "kl_kind": "low_var_kl+",
            "adv_estimator": "gpg",
            "policy_loss": "kl_cov",
            "packing": True,
            "mask_truncated_completions": True,
            "ppo_epochs": 2,
        },
        # a quarter of the tokens stop a completion: about one in five is cut at 5 tokens and left out of the loss
        rollout={"engine": "hf", "n": 2, "max_new_tokens": 5, "stop_token_ids": list(range(3, 20))},
    ),
    "opo-clipcov-dynamic-sampling": dict(
        trainer={
            "kl_kind": "k1+",
            "adv_estimator": "opo",
            "policy_loss": "clip_cov",
            "filter_groups": True,
            "max_sampling_rounds": 2,
        }
    ),
    "entropy-lora-vllm": dict(
        trainer={
            "top_entropy_quantile": 0.3,
            "kl_kind": "k3+",
            "adv_estimator": "opo",
            "filter_groups": True,
            "max_sampling_rounds": 2,
        },
        model={"lora_r": 4},
        rollout={"engine": "vllm", "n": 2, "max_new_tokens": 5},
    ),
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("new_settings"))


def _config(tiny, out, case, **trainer):
    sections = {k: v for k, v in case.items() if k != "trainer"}
    if "model" in sections:
        sections["model"] = {"path": str(tiny / "model"), **sections["model"]}
    return grpo_config(tiny, out, trainer={"max_steps": 2, "save_every": 0, **case["trainer"], **trainer}, **sections)


def _assert_finite_and_trained(records, entropy_mask):
    for step, record in records.items():
        bad = [k for k, v in record.items() if isinstance(v, float) and not math.isfinite(v)]
        assert not bad, (step, bad)
        assert record["skipped"] == 0.0 and record["optimizer_steps"] > 0, (step, record)
        if entropy_mask:  # the step's share of trained tokens whose policy term trained: some, not all
            assert 0.0 < record["entropy_kept_fraction"] < 1.0, (step, record)
        else:
            assert "entropy_kept_fraction" not in record


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "name", [pytest.param(name, marks=pytest.mark.slow) if "vllm" in name else name for name in CASES]
)
def test_a_run_with_the_new_settings_trains_and_logs_finite_metrics(tiny, name):
    if "vllm" in name:
        pytest.importorskip("vllm")
    out = tiny / name
    rc, log = run_group(TRAIN + [_config(tiny, out, CASES[name])], timeout=280, env=launch_env())
    assert rc == 0, log[-4000:]
    records = metrics_by_step(out)
    assert sorted(records) == [1, 2]
    _assert_finite_and_trained(records, "top_entropy_quantile" in CASES[name]["trainer"])
    if CASES[name]["trainer"].get("mask_truncated_completions"):  # some rows left out, not all
        assert any(0.0 < r["truncated_fraction"] < 1.0 for r in records.values()), records
    assert (out / "final" / "model.safetensors").exists()


@pytest.mark.slow  # the deepspeed launcher
@pytest.mark.timeout(300)
def test_two_ranks_at_zero3_train_with_the_entropy_mask(tiny):
    out = tiny / "two_ranks"
    case = {
        "trainer": {
            "top_entropy_quantile": 0.4,
            "kl_kind": "k3+",
            "adv_estimator": "gpg",
            "policy_loss": "gpg",
            "packing": True,
            "ppo_epochs": 2,
            "minibatch_size": 2,
        },
        "deepspeed": {"zero_stage": 3},
    }
    config = _config(tiny, out, case)
    rc, log = run_group(
        [
            DEEPSPEED,
            "--num_gpus",
            "2",
            "--master_port",
            str(free_port()),
            "--module",
            "fastrlhf",
            "train",
            "--config",
            config,
        ],
        timeout=280,
        env=launch_env(),
    )
    assert rc == 0, log[-4000:]
    records = metrics_by_step(out)
    assert sorted(records) == [1, 2]
    _assert_finite_and_trained(records, entropy_mask=True)


@pytest.mark.timeout(420)
def test_killed_and_resumed_with_the_new_settings_ends_as_the_uninterrupted_run(tiny):
    """Nothing these settings hold lives outside the checkpoint: the entropy threshold, GPG's alpha and OPO's
    baseline are each step's own, so a resumed run logs and ends as the straight one."""
    case = {
        "trainer": {
            "top_entropy_quantile": 0.5,
            "kl_kind": "k3+",
            "adv_estimator": "opo",
            "tis_cap": 2.0,
            "tis_floor": 0.5,
            "ppo_epochs": 2,
            "minibatch_size": 2,
        }
    }
    straight, killed = tiny / "straight", tiny / "killed"
    steps = {"max_steps": 4, "save_every": 2}
    rc, log = run_group(TRAIN + [_config(tiny, straight, case, **steps)], timeout=280, env=launch_env())
    assert rc == 0, log[-4000:]
    # 4 completions are scored per step: the 9th reward call is inside step 3, after the step-2 checkpoint.
    config = _config(tiny, killed, case, **steps)
    rc, log = run_group(TRAIN + [config], timeout=280, env=launch_env(FASTRLHF_TEST_KILL_AFTER_CALLS="8"))
    assert rc < 0, log[-4000:]
    assert (killed / "checkpoints" / "latest").read_text().strip() == "step-2"
    rc, log = run_group(TRAIN + [config, "--resume"], timeout=280, env=launch_env())
    assert rc == 0, log[-4000:]
    assert_resumed_like_straight(
        straight,
        killed,
        (
            "reward_mean",
            "policy_loss",
            "kl",
            "grad_norm",
            "entropy_kept_fraction",
            "entropy_threshold",
            "tis_weight_mean",
        ),
    )


def test_dry_run_shows_the_new_settings_and_a_list_item_set_on_the_command_line(tiny, tmp_path):
    case = {
        "trainer": {
            "top_entropy_quantile": 0.3,
            "kl_kind": "low_var_kl+",
            "adv_estimator": "grpo_passk",
            "tis_cap": 2.0,
            "tis_floor": 0.5,
        }
    }
    path = _config(tiny, tmp_path / "dry", case)
    raw = yaml.safe_load(open(path))
    raw["rollout"]["stop_token_ids"] = [1, 2]
    with open(path, "w") as f:
        yaml.safe_dump(raw, f)
    result = subprocess.run(
        [*TRAIN, path, "--dry-run", "--set", "rollout.stop_token_ids[1]=7"],
        capture_output=True,
        text=True,
        env=launch_env(),
        timeout=120,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    printed = yaml.safe_load(result.stdout)  # the resolved config
    t = printed["trainer"]
    assert (t["top_entropy_quantile"], t["kl_kind"], t["adv_estimator"], t["tis_floor"]) == (
        0.3,
        "low_var_kl+",
        "grpo_passk",
        0.5,
    )
    assert printed["rollout"]["stop_token_ids"] == [1, 7]
    # A loss that does not scale with its advantages is refused with the mask at load, naming the key.
    result = subprocess.run(
        [*TRAIN, path, "--dry-run", "--set", "trainer.policy_loss=kl_cov"],
        capture_output=True,
        text=True,
        env=launch_env(),
        timeout=120,
        cwd=ROOT,
    )
    assert result.returncode == 2 and "trainer.tis_cap" in result.stderr, result.stderr[-2000:]


@pytest.mark.timeout(300)
def test_sft_truncates_overlong_examples_and_trains_on_them_packed(tiny, tmp_path):
    rows = [{"prompt_ids": [5 + i] * (3 + 3 * (i % 3)), "response_ids": [9 + i] * (2 + 4 * (i % 4))} for i in range(8)]
    (tmp_path / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    raw = {
        "output_dir": str(tmp_path / "out"),
        "model": {"path": str(tiny / "model")},
        "data": {"path": str(tmp_path / "sft.jsonl"), "max_len": 10, "max_prompt_len": 6, "overlong": "truncate"},
        "trainer": {"max_steps": 2, "batch_size": 4, "lr": 1e-2, "save_every": 0, "packing": True},
        "deepspeed": {"zero_stage": 2},
    }
    (tmp_path / "sft.yaml").write_text(yaml.safe_dump(raw))
    rc, log = run_group(
        [sys.executable, "-m", "fastrlhf", "sft", "--config", str(tmp_path / "sft.yaml")], timeout=280, env=launch_env()
    )
    assert rc == 0, log[-4000:]
    assert "truncated 6 of 8 examples" in log, log[-3000:]
    records = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    # no example is longer than max_len: each trains its kept response tokens (at most 10 - its prompt's)
    assert all(math.isfinite(r["loss"]) and 0 < r["response_tokens"] <= 4 * 7 for r in records), records


def test_plan_reads_the_new_settings_without_torch(tmp_path):
    from helpers.plan_cases import QWEN25_1_5B, model_folder

    raw = yaml.safe_load(open(os.path.join(ROOT, "examples/gpu/grpo_qwen2.5_1.5b.yaml")))
    raw["model"]["path"] = model_folder(tmp_path / "model", QWEN25_1_5B)
    raw["trainer"].update(top_entropy_quantile=0.2, kl_kind="k3+", tis_cap=2.0, tis_floor=0.5)
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(raw))
    code = (
        "import sys; from fastrlhf.cli import main; rc = main(sys.argv[1:]); "
        "print('heavy:', [m for m in ('torch', 'deepspeed', 'vllm', 'transformers') if m in sys.modules]); "
        "sys.exit(rc)"
    )
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            code,
            "plan",
            "--config",
            str(tmp_path / "run.yaml"),
            "--gpus",
            "8",
            "--gpu-memory",
            "80GiB",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "heavy: []" in result.stdout


@pytest.mark.parametrize(
    "trainer",
    [
        {"top_entropy_quantile": 0.5, "ppo_epochs": 1, "minibatch_size": 12},  # on-policy: the old pass runs for it
        {"top_entropy_quantile": 0.5, "packing": True, "share_prompts": True, "tis_cap": 2.0, "tis_floor": 0.5},
        {"adv_estimator": "opo", "policy_loss": "clip_cov", "kl_kind": "low_var_kl+", "packing": True},
        {"adv_estimator": "grpo_passk", "policy_loss": "kl_cov", "kl_kind": "k1+", "fused_loss": False},
    ],
    ids=["entropy-on-policy", "entropy-shared-tis", "opo-clipcov-packed", "passk-klcov-unfused"],
)
def test_the_new_settings_read_the_device_as_often_as_the_old(trainer):
    from helpers.new_settings_device import rl_config, step_reads

    from fastrlhf.engine.guards import INPUTS_READ
    from fastrlhf.rl.step_metrics import METRICS_READ

    metrics, update_reads, other_reads = step_reads(rl_config(**trainer))
    assert metrics["skipped"] == 0 and metrics["optimizer_steps"] > 0, metrics
    assert update_reads == ["the optimizer step's skip decision and metrics"] * int(metrics["optimizer_steps"])
    assert other_reads == [INPUTS_READ, METRICS_READ]
    if "top_entropy_quantile" in trainer:
        assert 0.0 < metrics["entropy_kept_fraction"] < 1.0


def test_a_row_left_out_of_the_loss_does_not_move_kl_covs_picks():
    """``mask_truncated_completions`` leaves a cut completion out of the loss (weight 0). KL-Cov's covariance, its
    budget and its picks are over the micro-batch's tokens: a pick on the left-out row is a penalty lost, so the
    gradient must be the batch's without that row."""
    import torch

    from fastrlhf.config import DataConfig, ModelConfig, RewardConfig, RolloutConfig, TrainConfig, TrainerConfig
    from fastrlhf.modeling.tiny import make_tiny_llama
    from fastrlhf.rl.experience import build_experience
    from fastrlhf.rl.forward import policy_loss_from_model
    from fastrlhf.rollout.sampling import Completion

    g = torch.Generator().manual_seed(0)

    def completion(reason):
        return Completion(torch.randint(3, 64, (6,), generator=g).tolist(), [0.0] * 6, reason)

    exp = build_experience(
        [[5, 6, 7], [8, 9]], [[completion("stop"), completion("stop")], [completion("stop"), completion("length")]], 0
    )
    exp.old_logprobs = -4.0 + 0.3 * torch.randn(exp.response_mask.shape, generator=g)
    exp.advantages = torch.tensor([1.0, -0.5, 0.8, 3.0])[:, None] * exp.response_mask
    exp.loss_rows = torch.tensor([1.0, 1.0, 1.0, 0.0])  # the cut one
    trainer = TrainerConfig(
        max_steps=1,
        prompts_per_step=2,
        minibatch_size=4,
        kl_coef=0.0,
        policy_loss="kl_cov",
        policy_loss_args={"kl_cov_ratio": 0.1},
    )
    config = TrainConfig(
        output_dir="u",
        model=ModelConfig(path="u"),
        data=DataConfig(prompts="u"),
        reward=RewardConfig(),
        trainer=trainer,
        rollout=RolloutConfig(n=2, max_new_tokens=6),
        algorithm="grpo",
    )

    def gradient(batch):
        model = make_tiny_llama(seed=0, vocab_size=64, hidden_size=32, num_layers=1, num_heads=1)
        policy_loss_from_model(model, batch, config)[0].backward()
        return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])

    torch.testing.assert_close(gradient(exp), gradient(exp.select([0, 1, 2])), rtol=0, atol=1e-7)
