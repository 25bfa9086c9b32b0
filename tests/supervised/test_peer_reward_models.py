"""A reward model trained by a peer scores in fastrlhf's RL step as the peer scores it, and ``fastrlhf rm`` keeps the
peers' reward-model settings.

* TRL's RewardTrainer folder (a one-label ``*ForSequenceClassification``), ``reward.model_kind: classifier``: the
  scores are transformers' logits at the last token that is not the pad id (TRL GRPO's
  ``reward_func(**inputs).logits[:, 0]``), Llama and Qwen2, and with a config without a pad id (transformers then
  reads one sequence at a time).
* OpenRLHF's ``train_rm`` folder (its ``RewardModel``: a ``value_head_prefix`` linear among the model's weights,
  ``mean``/``std`` in config.json), ``reward.model_kind: value_head``: the reward at the last attended token, and
  ``(r - mean) / std`` with ``reward.normalize: stored`` (OpenRLHF's ``--reward.normalize_enable``).
* ``fastrlhf rm``: TRL's ``center_rewards_coefficient`` term, and the exported ``mean``/``std`` as OpenRLHF's
  ``rm_trainer.py`` measures them.

The peers' save code and formulas are written out, with their source paths, in ``tests/helpers/peer_reward_models.py``.
"""

import json
import random
import sys

import pytest
import torch
import yaml
from helpers.hf_architectures import architecture_config
from helpers.launch import run_group
from helpers.model_folders import fake_train_raw
from helpers.peer_reward_models import (
    config_json,
    openrlhf_rewards,
    save_openrlhf_reward_model,
    save_trl_reward_model,
)

from fastrlhf.config import ConfigError, parse_config
from fastrlhf.rl.experience import build_experience
from fastrlhf.rl.rewards import RewardScorer
from fastrlhf.rollout import Completion

PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
COMPLETIONS = [[20, 21, 1], [22, 23, 24, 25], [26]]  # 1: the tiny architectures' eos; 2 is their pad id


def _experience(pad_id: int = 2):
    """The RL step's batch of PROMPTS + COMPLETIONS: prompts left-padded, completions right-padded."""
    return build_experience(PROMPTS, [[Completion(c, [0.0] * len(c), "stop")] for c in COMPLETIONS], pad_id, "cpu")


def _train_config(tmp_path, reward: dict):
    """A checked GRPO config scoring with ``reward`` (its model folder checked, never loaded)."""
    raw = fake_train_raw(tmp_path)
    raw["reward"] = reward
    raw["data"]["max_prompt_len"], raw["rollout"]["max_new_tokens"] = 16, 16  # the tiny folders' 128 positions
    return parse_config(raw)


def _scores(tmp_path, reward: dict) -> torch.Tensor:
    """fastrlhf's scores of the batch: the reward model loaded as the RL trainer loads it, scored by its scorer."""
    from fastrlhf.rl.trainer import _reward_model

    config = _train_config(tmp_path, reward)
    model = _reward_model(config, "cpu")
    scorer = RewardScorer(None, model, config.reward.model_kind, config.reward.label_index,
                          normalize=config.reward.normalize)
    return scorer(_experience(), PROMPTS, COMPLETIONS, [{} for _ in PROMPTS])


# ---------------------------------------------------------------------------------------------------------- TRL


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_trl_reward_model_scores_as_transformers_pools_it(tmp_path, arch):
    from transformers import AutoModelForSequenceClassification

    folder = save_trl_reward_model(tmp_path / "rm", architecture_config(arch), pad_token_id=2)
    got = _scores(tmp_path, {"model_path": folder, "model_kind": "classifier"})
    # TRL GRPO (grpo_trainer.py _calculate_rewards): right-padded rows, reward_func(**inputs).logits[:, 0]
    peer = AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float32).eval()
    rows = [p + c for p, c in zip(PROMPTS, COMPLETIONS, strict=True)]
    width = max(map(len, rows))
    ids = torch.tensor([r + [2] * (width - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    with torch.no_grad():
        expected = peer(input_ids=ids, attention_mask=mask).logits[:, 0]
    assert expected.std() > 0.1  # the rows score apart: a wrong position would show
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_a_reward_model_without_a_pad_id_scores_each_row_at_its_last_token(tmp_path):
    """Many Llama folders have no pad id: transformers' pooling then reads the last position and refuses batches of
    more than one row; fastrlhf reads each row's last attended token, the single-row logits in a padded batch."""
    from transformers import AutoModelForSequenceClassification

    folder = save_trl_reward_model(tmp_path / "rm", architecture_config("llama"), pad_token_id=None)
    assert "pad_token_id" not in config_json(folder) or config_json(folder)["pad_token_id"] is None
    got = _scores(tmp_path, {"model_path": folder})
    peer = AutoModelForSequenceClassification.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        with pytest.raises(ValueError, match="no padding token"):
            peer(input_ids=torch.tensor([[5, 6], [7, 8]]))
        expected = torch.stack([peer(input_ids=torch.tensor([p + c])).logits[0, 0]
                                for p, c in zip(PROMPTS, COMPLETIONS, strict=True)])
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


# ----------------------------------------------------------------------------------------------------- OpenRLHF


@pytest.mark.parametrize("arch,prefix", [("llama", "score"), ("qwen2", "value_head")])
@pytest.mark.parametrize("normalize", [False, "stored"])
def test_an_openrlhf_reward_model_scores_as_openrlhf(tmp_path, arch, prefix, normalize):
    folder = save_openrlhf_reward_model(tmp_path / "rm", architecture_config(arch), prefix, mean=0.75, std=2.5)
    got = _scores(tmp_path, {"model_path": folder, "model_kind": "value_head", "normalize": normalize})
    exp = _experience()  # OpenRLHF's rows too: left-padded prompts, right-padded responses, one attention mask
    expected = openrlhf_rewards(folder, exp.input_ids, exp.attention_mask, normalize=normalize == "stored")
    raw = openrlhf_rewards(folder, exp.input_ids, exp.attention_mask, normalize=False)
    assert raw.std() > 0.1
    if normalize:
        torch.testing.assert_close(expected, (raw - 0.75) / 2.5)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_an_openrlhf_folder_is_named_for_what_it_is(tmp_path):
    folder = save_openrlhf_reward_model(tmp_path / "rm", architecture_config("llama"))
    with pytest.raises(ConfigError) as info:
        _train_config(tmp_path, {"model_path": folder})  # model_kind classifier
    assert info.value.key == "reward.model_path" and "OpenRLHF reward model: set model_kind value_head" in str(
        info.value)
    assert _train_config(tmp_path, {"model_path": folder, "model_kind": "value_head"}).reward.model_kind == "value_head"


def test_a_named_value_head_missing_from_the_weights_is_an_error_not_a_fresh_head(tmp_path):
    from fastrlhf.modeling.loading import _reward_score_head

    folder = save_openrlhf_reward_model(tmp_path / "rm", architecture_config("llama"))
    config = config_json(folder)
    config["value_head_prefix"] = "reward_head"
    (tmp_path / "rm" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="no reward_head.weight"):
        _reward_score_head(folder)


def test_stored_normalisation_needs_a_stored_mean_and_std(tmp_path):
    folder = save_openrlhf_reward_model(tmp_path / "rm", architecture_config("llama"))  # never evaluated: no mean
    for reward in ({"model_path": folder, "model_kind": "value_head", "normalize": "stored"},
                   {"function": "length", "normalize": "stored"}):
        with pytest.raises(ConfigError) as info:
            _train_config(tmp_path, reward)
        assert info.value.key == "reward.normalize" and "\n" not in str(info.value)
    for normalize in (True, False):  # the running moments, or none, need nothing from the folder
        reward = {"model_path": folder, "model_kind": "value_head", "normalize": normalize}
        assert _train_config(tmp_path, reward).reward.normalize is normalize


# ------------------------------------------------------------------------------------------------- fastrlhf rm


@pytest.fixture
def tiny_rm():
    from transformers import LlamaForSequenceClassification

    from fastrlhf.modeling.tiny import tiny_llama_config

    torch.manual_seed(0)
    model = LlamaForSequenceClassification(tiny_llama_config(vocab_size=64, hidden_size=32, num_heads=1,
                                                             num_labels=1)).eval()
    with torch.no_grad():
        model.score.weight.normal_(0.0, 1.0)
    return model


def _pairs(n: int, margins: bool = False):
    from types import SimpleNamespace

    rng = random.Random(0)
    return [SimpleNamespace(prompt_ids=[rng.randrange(3, 64) for _ in range(3)],
                            chosen_ids=[rng.randrange(3, 64) for _ in range(rng.randrange(1, 5))],
                            rejected_ids=[rng.randrange(3, 64) for _ in range(rng.randrange(1, 5))],
                            margin=rng.random() if margins else 0.0) for _ in range(n)]


@pytest.mark.parametrize("margins", [False, True])
def test_center_rewards_coefficient_adds_trl_term(tiny_rm, margins):
    from fastrlhf.supervised.reward_model import pairwise_loss, scores

    pairs = _pairs(4, margins)
    with torch.no_grad():
        chosen = scores(tiny_rm, [p.prompt_ids + p.chosen_ids for p in pairs], 2)[:, 0]
        rejected = scores(tiny_rm, [p.prompt_ids + p.rejected_ids for p in pairs], 2)[:, 0]
        margin = torch.tensor([p.margin for p in pairs])
        # TRL trl/trainer/reward_trainer.py compute_loss
        trl = -torch.nn.functional.logsigmoid(chosen - rejected - margin).mean()
        trl = trl + 0.05 * torch.mean((chosen + rejected) ** 2)
        loss, _ = pairwise_loss(tiny_rm, pairs, 2, center=0.05)
        shared, _ = pairwise_loss(tiny_rm, pairs, 2, scale=1 / 8, center=0.05)  # 4 of a step's 8 pairs
    torch.testing.assert_close(loss, trl, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(shared, trl * 4 / 8, rtol=1e-5, atol=1e-6)


def test_center_rewards_coefficient_is_checked(tmp_path):
    from fastrlhf.modeling.tiny import save_tiny_llama

    save_tiny_llama(tmp_path / "model", vocab_size=64, hidden_size=32, num_layers=1)
    (tmp_path / "pairs.jsonl").write_text("")
    raw = {"output_dir": str(tmp_path / "out"), "model": {"path": str(tmp_path / "model")},
           "data": {"path": str(tmp_path / "pairs.jsonl")}, "trainer": {"max_steps": 1}}
    assert parse_config({**raw, "center_rewards_coefficient": 0.01}, "rm").center_rewards_coefficient == 0.01
    for bad, kind in ((-0.01, "pairwise"), (0.01, "classifier")):
        with pytest.raises(ConfigError) as info:
            parse_config({**raw, "center_rewards_coefficient": bad, "kind": kind}, "rm")
        assert info.value.key == "center_rewards_coefficient"


@pytest.mark.parametrize("micro", [1, 3])
def test_reward_moments_are_openrlhf_eval_mean_and_std(tiny_rm, micro):
    from fastrlhf.supervised.reward_model import reward_moments, scores

    pairs = _pairs(5)
    mean, std = reward_moments(tiny_rm, pairs, 2, micro)
    with torch.no_grad():
        rewards = torch.cat([scores(tiny_rm, [p.prompt_ids + p.chosen_ids for p in pairs], 2)[:, 0],
                             scores(tiny_rm, [p.prompt_ids + p.rejected_ids for p in pairs], 2)[:, 0]])
    # OpenRLHF openrlhf/trainer/rm_trainer.py evaluate
    assert mean == pytest.approx(torch.mean(rewards).item(), abs=1e-6)
    assert std == pytest.approx(torch.std(rewards).clamp(min=1e-8).item(), rel=1e-5)
    assert not tiny_rm.training


def test_reward_moments_over_two_ranks_run_as_many_passes_on_each(tiny_rm, monkeypatch):
    """5 pairs over 2 ranks, 2 pairs a pass: each rank runs 2 passes (ZeRO-3 gathers in each: a rank with fewer
    would leave the other waiting), rank 1's last one on a stand-in pair it does not count."""
    from fastrlhf.supervised import reward_model as rm

    pairs, passes, totals = _pairs(5), {0: 0, 1: 0}, {}
    score = rm.scores

    def counted_scores(*args, **kwargs):
        passes[rm.D.rank()] += 1
        return score(*args, **kwargs)

    def all_reduce_(t):  # rank 1 runs first; rank 0 then sees both ranks' sums
        totals[rm.D.rank()] = t.clone()
        return t + totals[1] if rm.D.rank() == 0 else t

    monkeypatch.setattr(rm, "scores", counted_scores)
    monkeypatch.setattr(rm.comm, "all_reduce_", all_reduce_)
    monkeypatch.setattr(rm.D, "world_size", lambda: 2)
    for rank in (1, 0):
        monkeypatch.setattr(rm.D, "rank", lambda rank=rank: rank)
        mean, std = rm.reward_moments(tiny_rm, pairs, 2, micro=2)
    assert passes == {0: 2, 1: 2} and totals[1][0] == 4 and totals[0][0] == 6  # rows counted: 2 x pairs
    with torch.no_grad():
        rewards = torch.cat([score(tiny_rm, [p.prompt_ids + p.chosen_ids for p in pairs], 2)[:, 0],
                             score(tiny_rm, [p.prompt_ids + p.rejected_ids for p in pairs], 2)[:, 0]])
    assert mean == pytest.approx(torch.mean(rewards).item(), abs=1e-6)
    assert std == pytest.approx(torch.std(rewards).item(), rel=1e-5)


@pytest.mark.parametrize("packing", [False, True])
def test_the_exported_moments_keep_to_the_token_budget_training_keeps_to(monkeypatch, packing):
    """``trainer.max_tokens_per_microbatch`` bounds every forward pass of training; the export's moments pass ran
    ``batch_size / ranks / grad_accum`` pairs at once whatever it said (here 7 pairs, 14 sequences, in one pass where
    the budget holds one pair): a run sized to fit by its budget ran out of memory after its last step, before
    its final checkpoint. The moments are the same either way."""
    from helpers.supervised_eval_case import config, pair_examples, tiny_classifier

    from fastrlhf.modeling import use_attention
    from fastrlhf.supervised import reward_model as rm

    pairs, model = pair_examples(7), tiny_classifier(1).eval()
    use_attention(model, packing, backend="sdpa")
    budget = max(sum(rm.rm_token_parts(p, packing)) * (1 if packing else 2) for p in pairs)  # one pair
    costs, score = [], rm.scores

    def costed_scores(engine, sequences, pad_id, packed=False):  # the tokens a pass holds, padded or packed
        costs.append(sum(map(len, sequences)) if packed else len(sequences) * max(map(len, sequences)))
        return score(engine, sequences, pad_id, packed)

    monkeypatch.setattr(rm, "scores", costed_scores)
    moments = {}
    for max_tokens in (None, budget):
        job = rm.build_job(config("rm", "pairwise", batch_size=8, packing=packing,
                                  max_tokens_per_microbatch=max_tokens), model, pairs)
        costs.clear()
        job.before_export(model)
        moments[max_tokens] = (model.config.mean, model.config.std)
        if max_tokens is not None:
            assert len(costs) > 1 and max(costs) <= budget, (costs, budget)
    assert moments[budget] == pytest.approx(moments[None], rel=1e-6)


@pytest.mark.slow
def test_fastrlhf_rm_exports_the_mean_and_std_stored_normalisation_reads(tmp_path):
    from transformers import AutoModelForSequenceClassification

    from fastrlhf.modeling.tiny import save_tiny_llama
    from fastrlhf.supervised.reward_model import scores

    save_tiny_llama(tmp_path / "model", vocab_size=64, hidden_size=32, num_layers=1)
    pairs = _pairs(6)
    with open(tmp_path / "pairs.jsonl", "w") as f:
        for p in pairs:
            f.write(json.dumps({"prompt_ids": p.prompt_ids, "chosen_ids": p.chosen_ids,
                                "rejected_ids": p.rejected_ids}) + "\n")
    raw = {"output_dir": str(tmp_path / "out"), "model": {"path": str(tmp_path / "model")},
           "data": {"path": str(tmp_path / "pairs.jsonl"), "max_len": 32}, "center_rewards_coefficient": 0.01,
           "trainer": {"max_steps": 2, "batch_size": 2, "lr": 1.0e-2}, "deepspeed": {"zero_stage": 2}}
    (tmp_path / "rm.yaml").write_text(yaml.safe_dump(raw))
    from helpers.rl_runs import launch_env

    env = launch_env(FASTRLHF_DIST_TIMEOUT="60")  # without the rendezvous variables an in-process engine left
    rc, log = run_group([sys.executable, "-m", "fastrlhf", "rm", "--config", str(tmp_path / "rm.yaml")], 300, env=env)
    assert rc == 0, log[-3000:]
    final = tmp_path / "out" / "final"
    stored = config_json(final)
    model = AutoModelForSequenceClassification.from_pretrained(final, dtype=torch.float32).eval()
    pad = model.config.pad_token_id
    with torch.no_grad():
        rewards = torch.cat([scores(model, [p.prompt_ids + p.chosen_ids for p in pairs], pad)[:, 0],
                             scores(model, [p.prompt_ids + p.rejected_ids for p in pairs], pad)[:, 0]])
    assert stored["mean"] == pytest.approx(torch.mean(rewards).item(), abs=1e-4)
    assert stored["std"] == pytest.approx(torch.std(rewards).item(), rel=1e-3)
    # ... and a later run's reward.normalize: stored reads them
    normalized = _scores(tmp_path, {"model_path": str(final), "normalize": "stored"})
    plain = _scores(tmp_path, {"model_path": str(final)})
    torch.testing.assert_close(normalized, (plain - stored["mean"]) / stored["std"])


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_grpo_run_scores_with_the_stored_mean_and_std_not_running_moments(tmp_path):
    """``fastrlhf train`` with an OpenRLHF reward model storing mean 1000, std 1 and ``reward.normalize: stored``:
    every logged score is about -1000 (the stored moments applied by the scorer). Running moments (what
    ``stored`` was taken for before the trainer passed it on) would centre them at 0."""
    import subprocess

    from helpers.rl_runs import TRAIN, grpo_config, launch_env, make_tiny, metrics_by_step

    tiny = make_tiny(tmp_path)
    folder = save_openrlhf_reward_model(tmp_path / "rm", architecture_config("llama"), "score", mean=1000.0, std=1.0)
    out = tmp_path / "out"
    path = grpo_config(tiny, out, trainer={"max_steps": 2, "save_every": 0})
    raw = yaml.safe_load(open(path))
    raw["reward"] = {"model_path": folder, "model_kind": "value_head", "normalize": "stored"}
    (tmp_path / "out.yaml").write_text(yaml.safe_dump(raw))
    result = subprocess.run([*TRAIN, path], env=launch_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    for step, row in metrics_by_step(out).items():
        assert -1100 < row["reward_mean"] < -900, (step, row["reward_mean"])


@pytest.mark.parametrize("kind", ["classifier", "pairwise"])
def test_a_starting_folders_stored_moments_do_not_reach_the_export(kind):
    """A reward model trained from a folder whose config.json holds ``mean``/``std`` (an earlier export): a
    classifier's export kept them (reward.normalize: stored would then divide by another model's moments); a
    pairwise one measures its own at the export."""
    from types import SimpleNamespace

    from transformers import LlamaForSequenceClassification

    from fastrlhf.modeling.tiny import tiny_llama_config
    from fastrlhf.supervised.reward_model import build_job

    model = LlamaForSequenceClassification(tiny_llama_config(vocab_size=64, hidden_size=32, num_heads=1,
                                                             num_labels=2))
    model.config.mean, model.config.std = 3.0, 2.0
    config = SimpleNamespace(kind=kind, trainer=SimpleNamespace(packing=False), center_rewards_coefficient=None)
    job = build_job(config, model, [])
    assert not hasattr(model.config, "mean") and not hasattr(model.config, "std")
    assert (job.before_export is not None) == (kind == "pairwise")
