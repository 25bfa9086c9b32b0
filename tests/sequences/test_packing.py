"""Token-budget micro-batches and packed sequences (#17) change the cost of a step, never its result.

* grouping: the budget is respected, every sequence is in exactly one micro-batch (none straddles
  two), an over-budget sequence gets one of its own, ranks agree on counts by splitting;
* packed forwards: hidden states, logprobs, values and reward-model scores of packed sequences
  equal the padded ones per sequence (tiny Llama and Qwen2, fp32), and no token attends across a
  sequence boundary;
* the update: a packed + token-budget RL step gives the loss, the gradients of every parameter at
  every optimizer step and the metrics of the padded step with one micro-batch per minibatch, for
  every aggregation mode, PPO (actor and critic) and GRPO, LoRA on and off, on a ragged batch with
  one very long completion among short ones (and an empty one).
"""

import copy
import math
import warnings

import pytest
import torch
from helpers.packing_case import PAD, VOCAB, RecordingSGD, make_config, ragged_batch
from helpers.paths import ROOT

import fastrlhf.sequences.packing as packing_module
from fastrlhf.algorithms import AGG_MODES
from fastrlhf.modeling import use_attention
from fastrlhf.modeling.tiny import make_tiny_llama, make_tiny_qwen2
from fastrlhf.rl.experience import build_experience
from fastrlhf.rl.forward import reward_model_scores, sequence_logprobs, token_values
from fastrlhf.rl.step import RLStep
from fastrlhf.rollout import Completion
from fastrlhf.sequences.packing import (
    PackedLayout,
    fixed_count_groups,
    group_cost,
    split_to_count,
    token_budget_groups,
)

# ----------------------------------------------------------------------------------------------
# Grouping
# ----------------------------------------------------------------------------------------------


def test_token_budget_groups_respect_the_budget_and_keep_every_sequence_once():
    g = torch.Generator().manual_seed(0)
    parts = [(int(torch.randint(1, 9, (1,), generator=g)), int(torch.randint(0, 30, (1,), generator=g)))
             for _ in range(40)]
    for packed in (True, False):
        groups = token_budget_groups(parts, 48, packed)
        assert sorted(i for grp in groups for i in grp) == list(range(40))  # membership kept, nothing twice
        for grp in groups:
            assert grp == sorted(grp)
            assert group_cost(parts, grp, packed) <= 48 or len(grp) == 1
    # Packed costs the real tokens; padded the rows times the widest prompt plus the widest completion.
    assert group_cost([(3, 1), (1, 5)], [0, 1], packed=True) == 10
    assert group_cost([(3, 1), (1, 5)], [0, 1], packed=False) == 2 * (3 + 5)
    # First-fit decreasing: 7 + 3 and 6 + 4 fill two budgets of 10 exactly.
    assert token_budget_groups([(1, 6), (1, 2), (1, 5), (1, 3)], 10, True) == [[0, 1], [2, 3]]


def test_an_over_budget_sequence_gets_a_micro_batch_of_its_own_and_one_warning(monkeypatch):
    monkeypatch.setattr(packing_module, "_warned_over_budget", False)
    parts = [(2, 3), (4, 60), (2, 2), (1, 1)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        groups = token_budget_groups(parts, 16, True)
        token_budget_groups([(50, 50)], 16, False)
    assert [1] in groups and sorted(i for g in groups for i in g) == [0, 1, 2, 3]
    assert len(groups) == 2
    assert len(caught) == 1 and "64 tokens does not fit trainer.max_tokens_per_microbatch 16" in str(caught[0].message)


def test_split_to_count_and_fixed_count_groups():
    parts = [(1, 9), (1, 1), (1, 1), (1, 5), (1, 3)]
    groups = split_to_count([[0, 1, 2, 3, 4]], parts, 3)
    assert len(groups) == 3 and sorted(i for g in groups for i in g) == [0, 1, 2, 3, 4]
    assert split_to_count([[0], [1]], parts[:2], 2) == [[0], [1]]
    with pytest.raises(ValueError, match="cannot make 3 micro-batches of 2 items"):
        split_to_count([[0], [1]], parts[:2], 3)
    assert fixed_count_groups(5, 2) == [[0, 1], [2, 3], [4]]


def test_packed_layout_indices():
    exp = build_experience([[5, 6, 7], [8]], [[Completion([10, 11], [0.0, 0.0], "stop")],
                                              [Completion([12, 13, 14], [0.0] * 3, "stop")]], PAD)
    layout = exp.packed_layout()
    assert layout.pack_padded(exp.input_ids).tolist() == [[5, 6, 7, 10, 11, 8, 12, 13, 14]]
    assert layout.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 3]]
    assert layout.hidden_index.tolist() == [2, 3, 5, 6, 7]  # the token before each completion token
    assert layout.take(exp.labels).tolist() == [10, 11, 12, 13, 14]
    assert layout.last_index.tolist() == [4, 8]
    assert torch.equal(layout.put(layout.take(exp.response_mask)), exp.response_mask)
    with pytest.raises(ValueError, match="needs a prompt of at least one token"):
        PackedLayout.build([0], [2])


def test_shared_prompt_layout_and_its_budget():
    # Rows 0 and 2 share a 3-token prompt (group 7), row 1 has its own 2-token prompt; row 2's completion is empty.
    layout = PackedLayout.build([3, 2, 3], [2, 1, 0], response_width=2, prompt_width=3, prompt_groups=[7, 5, 7])
    # Group 7's prompt once, then row 0's completion (row 2 has none); then row 1's prompt and completion.
    assert layout.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2]]
    assert layout.segments == [(0, 3, 0, 0), (3, 5, 0, 3), (5, 7, 5, 5), (7, 8, 5, 7)]
    assert layout.hidden_index.tolist() == [2, 3, 6]  # prompt's last token predicts each first completion token
    assert layout.token_index.tolist() == [0, 1, 2]  # [B, T] places: row 0 t 0-1, row 1 t 0
    assert layout.last_index.tolist() == [4, 7, 2]  # an empty completion ends at its prompt's last token
    assert layout.source_index.tolist() == [0, 1, 2, 3, 4, 6, 7, 8]  # rows of width 3 + 2: row 0's prompt, ...
    with pytest.raises(ValueError, match="a shared prompt must be the same prompt"):
        PackedLayout.build([3, 2], [1, 1], prompt_groups=[0, 0])
    # Token budget: a group's prompt counts once per micro-batch.
    parts, keys = [(10, 4), (10, 5), (10, 6), (3, 2)], [0, 0, 0, 1]
    assert group_cost(parts, [0, 1, 2], True, keys=keys) == 10 + 15
    assert group_cost(parts, [0, 1, 2], True) == 45
    groups = token_budget_groups(parts, 25, packed=True, keys=keys)
    assert sorted(i for g in groups for i in g) == [0, 1, 2, 3]
    assert all(group_cost(parts, g, True, keys=keys) <= 25 for g in groups)
    assert [0, 1, 2] in groups  # without sharing these three need 45 tokens


# ----------------------------------------------------------------------------------------------
# Packed forward passes
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["sdpa", "flex"])
@pytest.mark.parametrize("attention", ["per-sequence", "shared-prompts"])
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_packed_hidden_states_and_logprobs_equal_the_padded_ones(family, attention, backend, cpu_flex):
    make = make_tiny_llama if family == "llama" else make_tiny_qwen2
    model = make(vocab_size=VOCAB, hidden_size=64, num_heads=2, num_layers=2)
    mode = "shared" if attention == "shared-prompts" else True
    use_attention(model, True, mode == "shared", backend)
    prompts, completions = ragged_batch()
    exp = build_experience(prompts, completions, PAD)
    parts = exp.token_parts()
    keys = exp.prompt_keys() if mode == "shared" else None
    longest = max(sum(p) for p in parts)
    padded = sequence_logprobs(model, exp, micro_batch=exp.batch_size)
    # One budget that the longest sequence fills exactly, one it overflows (alone in its micro-batch),
    # and all sequences in one row.
    for budget in (longest, 12, sum(sum(p) for p in parts)):
        groups = token_budget_groups(parts, budget, packed=True, keys=keys)
        for fused in (True, False):
            got = sequence_logprobs(model, exp, groups=groups, packed=mode, fused=fused)
            for a, b in zip(got, padded, strict=True):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    # Hidden states, sequence by sequence: packed row vs each sequence alone.
    layout = exp.packed_layout()
    with torch.no_grad():
        packed = model.model(input_ids=layout.pack_padded(exp.input_ids), position_ids=layout.position_ids,
                             use_cache=False).last_hidden_state[0]
        offset = 0
        for b, (p, n) in enumerate(parts):
            ids = exp.input_ids[b, exp.prompt_width - p:exp.prompt_width + n][None]
            alone = model.model(input_ids=ids, use_cache=False).last_hidden_state[0]
            torch.testing.assert_close(packed[offset:offset + p + n], alone, rtol=1e-5, atol=1e-5)
            offset += p + n


def test_no_token_attends_across_a_sequence_boundary():
    model = make_tiny_qwen2(vocab_size=VOCAB, hidden_size=64, num_heads=2)
    use_attention(model, True)
    prompts, completions = ragged_batch(seed=1, empty=False)
    exp = build_experience(prompts, completions, PAD)
    before, _ = sequence_logprobs(model, exp, packed=True)
    changed = copy.deepcopy(completions)
    changed[1][0].token_ids = [(t + 7) % (VOCAB - 3) + 3 for t in changed[1][0].token_ids]  # row 4's tokens only
    after, _ = sequence_logprobs(model, build_experience(prompts, changed, PAD), packed=True)
    others = [b for b in range(exp.batch_size) if b != 4]
    assert torch.equal(before[others], after[others])
    assert not torch.equal(before[4], after[4])


def test_packed_values_and_reward_model_scores_equal_the_padded_ones():
    from transformers import LlamaForSequenceClassification

    from fastrlhf.modeling import CausalLMWithValueHead
    from fastrlhf.modeling.tiny import tiny_llama_config

    prompts, completions = ragged_batch(seed=2)
    exp = build_experience(prompts, completions, PAD)
    groups = token_budget_groups(exp.token_parts(), 16, packed=True)
    torch.manual_seed(0)
    critic = CausalLMWithValueHead(make_tiny_llama(vocab_size=VOCAB, hidden_size=32, num_heads=1)).eval()
    use_attention(critic.lm, True, share_prompts=True)
    torch.testing.assert_close(token_values(critic, exp, groups=groups, packed=True), token_values(critic, exp),
                               rtol=1e-5, atol=1e-5)
    shared = token_budget_groups(exp.token_parts(), 16, packed=True, keys=exp.prompt_keys())
    torch.testing.assert_close(token_values(critic, exp, groups=shared, packed="shared"), token_values(critic, exp),
                               rtol=1e-5, atol=1e-5)
    rm = LlamaForSequenceClassification(tiny_llama_config(vocab_size=VOCAB, hidden_size=32, num_heads=1,
                                                          num_labels=2)).eval()
    use_attention(rm, True)
    for kind, model in (("classifier", rm), ("value_head", critic)):
        torch.testing.assert_close(reward_model_scores(model, exp, kind, 1 if kind == "classifier" else 0,
                                                       groups=groups, packed=True),
                                   reward_model_scores(model, exp, kind, 1 if kind == "classifier" else 0),
                                   rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------------------------
# The update: packed + token budget vs padded, one micro-batch per minibatch
# ----------------------------------------------------------------------------------------------


def lora(model):
    from peft import LoraConfig, get_peft_model

    # Random B (not the zero init), so the adapted policy differs from the reference (adapter off).
    return get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                            init_lora_weights=False))


def run_step(config, with_lora, checkpointing=False, episodes=False, completions=None):
    from fastrlhf.modeling import CausalLMWithValueHead

    torch.manual_seed(0)
    actor = make_tiny_llama(seed=0, vocab_size=VOCAB, hidden_size=32, num_layers=2, num_heads=1).train()
    reference = None if with_lora else make_tiny_llama(seed=1, vocab_size=VOCAB, hidden_size=32, num_heads=1)
    if checkpointing:
        actor.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if with_lora:
        actor = lora(actor)
    trainable = [(n, p) for n, p in actor.named_parameters() if p.requires_grad]
    opt = RecordingSGD(trainable, lr=0.5)
    critic = copt = None
    if config.algorithm == "ppo":
        torch.manual_seed(3)
        critic = CausalLMWithValueHead(make_tiny_llama(seed=5, vocab_size=VOCAB, hidden_size=32, num_heads=1)).train()
        copt = RecordingSGD(list(critic.named_parameters()), lr=0.01)
    for model in (actor, reference, critic and critic.lm):  # as the trainer does: per-sequence attention on CPU
        if model is not None:
            use_attention(model, config.trainer.packing, config.trainer.share_prompts)
    prompts, batch = ragged_batch(seed=4, episodes=episodes)
    completions = completions if completions is not None else batch
    scores = torch.linspace(-1.0, 1.0, 12)[torch.randperm(12, generator=torch.Generator().manual_seed(1))]
    rl = RLStep(config, actor, rollout=None, scorer=lambda exp, *a: scores.clone(), reference=reference,
                critic=critic, actor_optimizer=opt, critic_optimizer=copt, pad_token_id=PAD, rollout_shares_actor=True)
    metrics = rl(prompts, None, step=2, completions=completions)
    return metrics, opt.grads, copt.grads if copt is not None else None


def assert_same_grads(got, want):
    assert len(got) == len(want) > 0
    for step, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.keys() == w.keys()
        for name in w:
            scale = float(w[name].abs().max())
            torch.testing.assert_close(g[name], w[name], rtol=1e-4, atol=1e-5 * max(scale, 1e-3),
                                       msg=lambda m, name=name, step=step: f"step {step}, {name}: {m}")


METRICS = ("policy_loss", "loss_kl", "clipfrac", "approx_kl", "entropy", "grad_norm", "rollout_entropy", "kl",
           "logprob_mismatch_mean", "advantage_mean", "optimizer_steps")


def check_same_update(config, reference_config, with_lora=False, checkpointing=False, episodes=False):
    got, grads, critic_grads = run_step(config, with_lora, checkpointing, episodes)
    want, want_grads, want_critic = run_step(reference_config, with_lora, episodes=episodes)
    assert got["skipped"] == want["skipped"] == 0.0
    assert want["optimizer_steps"] == 4.0
    keys = METRICS + (("value_loss", "vf_clipfrac", "critic_grad_norm") if config.algorithm == "ppo" else ())
    for key in keys:
        assert math.isclose(got[key], want[key], rel_tol=1e-4, abs_tol=1e-6), (key, got[key], want[key])
    assert_same_grads(grads, want_grads)
    if critic_grads is not None:
        assert_same_grads(critic_grads, want_critic)


@pytest.mark.parametrize("share_prompts", [False, True], ids=["rows", "shared-prompts"])
@pytest.mark.parametrize("with_lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
@pytest.mark.parametrize("agg", AGG_MODES)
def test_packed_token_budget_update_equals_the_padded_update(agg, algorithm, with_lora, share_prompts):
    # 12 sequences of 2-29 tokens, minibatches of 6: a 14-token budget makes micro-batches of 1 to
    # about 5 sequences, the 29-token one alone (over the budget), sorted by length, not by row.
    # Shared prompts: the minibatches mix samples of 3 prompts, so micro-batches hold 1-4 of a group.
    padded = make_config(algorithm, agg, tis_cap=1.5 if algorithm == "grpo" else None)
    packed = make_config(algorithm, agg, packing=True, max_tokens_per_microbatch=14, share_prompts=share_prompts,
                         tis_cap=1.5 if algorithm == "grpo" else None)
    check_same_update(packed, padded, with_lora)


@pytest.mark.parametrize("case", ["padded-budget", "padded-grad-accum", "packed-by-count", "packed-unfused",
                                  "packed-gspo", "packed-checkpointing"])
def test_other_groupings_and_loss_paths_equal_the_padded_update(case):
    agg = "seq-mean-token-sum-norm"
    extra = {}
    if case == "packed-gspo":
        agg, extra = "seq-mean-token-mean", dict(policy_loss="gspo", clip_low=3e-4, clip_high=4e-4)
    padded = make_config("grpo", agg, **extra)
    change = {"padded-budget": dict(max_tokens_per_microbatch=40),  # rows x padded width
              "padded-grad-accum": dict(grad_accum=3),  # today's fixed micro-batches, one minibatch loss
              "packed-by-count": dict(packing=True, grad_accum=2),
              "packed-unfused": dict(packing=True, max_tokens_per_microbatch=20, fused_loss=False),
              "packed-gspo": dict(packing=True, max_tokens_per_microbatch=20),
              "packed-checkpointing": dict(packing=True, max_tokens_per_microbatch=20, share_prompts=True)}[case]
    check_same_update(make_config("grpo", agg, **change, **extra), padded,
                      checkpointing=case == "packed-checkpointing")


@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
def test_on_multi_turn_episodes_the_packed_update_equals_the_padded_one(algorithm):
    """Episodes (tool turns masked in the middle of completions): packed rows with shared prompts and a token
    budget give the padded update, for GRPO and for PPO (GAE across the masked middle)."""
    padded = make_config(algorithm, "seq-mean-token-mean", tis_cap=1.5 if algorithm == "grpo" else None)
    packed = make_config(algorithm, "seq-mean-token-mean", packing=True, max_tokens_per_microbatch=14,
                         share_prompts=True, tis_cap=1.5 if algorithm == "grpo" else None)
    _, episodes = ragged_batch(seed=4, episodes=True)
    assert sum(c.mask is not None and 0 in c.mask for samples in episodes for c in samples) >= 4
    check_same_update(packed, padded, episodes=True)


@pytest.mark.parametrize("algorithm", ["grpo", "ppo"])
def test_the_tokens_between_turns_reach_no_loss(algorithm):
    """What the engine reports at masked positions (tool output: no logprob of the policy's) changes nothing:
    the policy loss, KL, entropy, TIS weights, the mismatch probe and the critic see the policy's tokens only."""
    config = make_config(algorithm, "token-mean", tis_cap=1.5 if algorithm == "grpo" else None)
    _, episodes = ragged_batch(seed=4, episodes=True)
    _, garbled = ragged_batch(seed=4, episodes=True)
    for c in (c for samples in garbled for c in samples if c.mask is not None):
        c.logprobs = [lp if m else -50.0 for lp, m in zip(c.logprobs, c.mask, strict=True)]
    want, want_grads, want_critic = run_step(config, False, completions=episodes)
    got, grads, critic_grads = run_step(config, False, completions=garbled)
    for key in METRICS:
        assert math.isclose(got[key], want[key], rel_tol=1e-6, abs_tol=1e-9), (key, got[key], want[key])
    assert_same_grads(grads, want_grads)
    if critic_grads is not None:
        assert_same_grads(critic_grads, want_critic)


def test_config_fields_and_their_checks(tmp_path):
    from fastrlhf.config import ConfigError, parse_config
    from fastrlhf.modeling.tiny import save_tiny_llama

    save_tiny_llama(tmp_path / "model", vocab_size=64, hidden_size=32, num_heads=1)
    (tmp_path / "p.jsonl").write_text('{"prompt_ids": [5, 6]}\n')

    def raw(**trainer):
        return {"algorithm": "grpo", "output_dir": str(tmp_path / "out"), "model": {"path": str(tmp_path / "model")},
                "data": {"prompts": str(tmp_path / "p.jsonl")}, "reward": {"function": "target_token"},
                "trainer": {"max_steps": 1, "prompts_per_step": 2, "minibatch_size": 8, **trainer},
                "rollout": {"n": 4}}

    t = parse_config(raw()).trainer
    assert t.packing is False and t.max_tokens_per_microbatch is None
    t = parse_config(raw(packing=True, max_tokens_per_microbatch=4096)).trainer
    assert t.packing is True and t.max_tokens_per_microbatch == 4096
    for bad, key, message in [
        (dict(max_tokens_per_microbatch=0), "trainer.max_tokens_per_microbatch", "must be > 0, got 0"),
        (dict(max_tokens_per_microbatch=64, grad_accum=2), "trainer.grad_accum", "must be 1 with"),
        (dict(max_tokens_per_microbatch=64, forward_micro_batch=4), "trainer.forward_micro_batch", "conflicts"),
        (dict(packing="yes"), "trainer.packing", ""),
        (dict(share_prompts=True), "trainer.share_prompts", "needs trainer.packing: true"),
    ]:
        with pytest.raises(ConfigError) as info:
            parse_config(raw(**bad))
        assert info.value.key == key and message in str(info.value) and "\n" not in str(info.value)


# ----------------------------------------------------------------------------------------------
# Two ranks under the deepspeed launcher, ZeRO-2 and ZeRO-3
# ----------------------------------------------------------------------------------------------


@pytest.mark.timeout(360)
def test_two_ranks_zero2_zero3_packed_step_equals_the_padded_step(tmp_path):
    import json
    import os
    import sys

    from helpers.launch import run_group
    from helpers.rl_runs import launch_env

    from fastrlhf.distributed import free_port
    from fastrlhf.modeling.tiny import save_tiny_llama

    root = ROOT
    scripts = os.path.join(root, "tests", "rl", "scripts")
    # Tied embeddings: the update hands the LM head's gradient to the embedding (fastrlhf.modeling.tied_gradient);
    # each case also runs padded with autograd's own sum of the two ("summed") for comparison.
    save_tiny_llama(tmp_path / "model", vocab_size=64, hidden_size=32, num_heads=1, tie_word_embeddings=True)
    with open(tmp_path / "prompts.jsonl", "w") as f:
        for i in range(4):
            f.write(json.dumps({"prompt_ids": [5 + i, 6, 7 + 2 * i][: 1 + i % 3], "meta": {"target_token": 3}}) + "\n")
    env = launch_env(FASTRLHF_DIST_TIMEOUT="60")
    cases = ["ppo:2", "grpo:2", "ppo:3", "grpo:3", "grpo:2:shared", "ppo:3:shared"]
    deepspeed = os.path.join(os.path.dirname(sys.executable), "deepspeed")
    rc, out = run_group([deepspeed, "--num_gpus", "2", "--master_port", str(free_port()),
                         os.path.join(scripts, "packing_two_ranks.py"), str(tmp_path / "model"),
                         str(tmp_path / "prompts.jsonl"), str(tmp_path), *cases], timeout=340, env=env)
    assert rc == 0, out[-4000:]
    for case in cases:
        result = json.load(open(tmp_path / f"{case.replace(':', '-')}.json"))
        padded, packed = result["padded"], result["packed"]
        assert padded["skipped"] == packed["skipped"] == 0.0 and padded["optimizer_steps"] == 2.0
        keys = ["policy_loss", "grad_norm", "clipfrac", "approx_kl", "entropy", "kl", "rollout_entropy"]
        keys += ["value_loss", "critic_grad_norm", "vf_clipfrac"] if case.startswith("ppo") else ["loss_kl"]
        for key in keys:
            assert math.isclose(packed[key], padded[key], rel_tol=1e-4, abs_tol=1e-6), (case, key, packed[key],
                                                                                         padded[key])
        # The same update: the weights moved, and by the same amount in both layouts.
        assert result["max_weight_change"] > 1e-4
        assert result["max_weight_diff"] < 1e-5, (case, result["max_weight_diff"])
        assert result["tied"] and result["max_weight_diff_summed"] < 1e-6, (case, result["max_weight_diff_summed"])


# ----------------------------------------------------------------------------------------------
# SFT and reward-model training
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def supervised_data(tmp_path_factory):
    import json
    import random

    from fastrlhf.modeling.tiny import save_tiny_llama

    root = tmp_path_factory.mktemp("packing_sft_rm")
    save_tiny_llama(root / "model", vocab_size=64, hidden_size=32, num_heads=1)
    rng = random.Random(0)

    def tokens(n):
        return [rng.randrange(3, 64) for _ in range(n)]  # never the pad id 2

    with open(root / "sft.jsonl", "w") as f:
        for i in range(8):  # ragged, one long response among short ones
            f.write(json.dumps({"prompt_ids": tokens(rng.randrange(1, 7)),
                                "response_ids": tokens(30 if i == 3 else rng.randrange(1, 9))}) + "\n")
    with open(root / "pairs.jsonl", "w") as f:
        for _ in range(8):
            f.write(json.dumps({"prompt_ids": tokens(rng.randrange(2, 6)), "chosen_ids": tokens(rng.randrange(1, 9)),
                                "rejected_ids": tokens(rng.randrange(1, 12))}) + "\n")
    with open(root / "cls.jsonl", "w") as f:
        for i in range(8):
            f.write(json.dumps({"input_ids": tokens(rng.randrange(2, 14)), "label": i % 2}) + "\n")
    return root


def run_supervised_command(root, command, name, data, trainer, zero_stage=2, **top):
    import os

    from safetensors.torch import load_file

    from fastrlhf.config import parse_config
    from fastrlhf.engine.metrics import read_metrics

    os.environ["FASTRLHF_NO_PROGRESS"] = "1"
    os.environ.setdefault("FASTRLHF_DIST_TIMEOUT", "60")
    raw = {"output_dir": str(root / name), "model": {"path": str(root / "model")},
           "data": {"path": str(root / data), "max_len": 64},
           "trainer": {"max_steps": 2, "batch_size": 8, "lr": 1e-2, **trainer},
           "deepspeed": {"zero_stage": zero_stage}, **top}
    config = parse_config(raw, command)
    if command == "sft":
        from fastrlhf.supervised.sft import run
    else:
        from fastrlhf.supervised.reward_model import run
    run(config)
    return read_metrics(os.path.join(root / name, "metrics.jsonl")), load_file(str(root / name / "final" /
                                                                                   "model.safetensors"))


@pytest.mark.parametrize("command,data,top,stage", [("sft", "sft.jsonl", {}, 2), ("sft", "sft.jsonl", {}, 3),
                                                    ("rm", "pairs.jsonl", {}, 2),
                                                    ("rm", "cls.jsonl", {"kind": "classifier"}, 2)],
                         ids=["sft", "sft-zero3", "rm-pairwise", "rm-classifier"])
def test_packed_token_budget_supervised_steps_equal_the_padded_ones(supervised_data, command, data, top, stage):
    # ZeRO-3: padded SFT runs the model's own forward (materialised logits), packed the fused head as a module.
    name = f"{command}-{data.split('.')[0]}-{stage}"
    padded, padded_weights = run_supervised_command(supervised_data, command, f"{name}-padded", data, {}, stage,
                                                    **top)
    packed, packed_weights = run_supervised_command(supervised_data, command, f"{name}-packed", data,
                                                    {"packing": True, "max_tokens_per_microbatch": 24}, stage, **top)
    assert len(padded) == len(packed) == 2
    for a, b in zip(padded, packed, strict=True):
        for key in ("loss", "grad_norm", "accuracy", "margin", "response_tokens"):
            if key in a:
                assert math.isclose(a[key], b[key], rel_tol=1e-5, abs_tol=1e-6), (a["step"], key, a[key], b[key])
    change = max(float((padded_weights[n] - start).abs().max()) for n, start in run_initial(supervised_data).items()
                 if n in padded_weights)
    diff = max(float((padded_weights[n] - packed_weights[n]).abs().max()) for n in padded_weights)
    # Adam moves every weight by about lr = 1e-2 whatever its gradient's size, so an entry whose gradient
    # is ~0 moves by an amount its rounding decides; a wrong gradient anywhere would differ by ~lr.
    assert change > 1e-3 and diff < 1e-3, (change, diff)


def run_initial(root):
    from safetensors.torch import load_file

    return {n: t for n, t in load_file(str(root / "model" / "model.safetensors")).items() if "embed" not in n}
