"""Follow-ups of the sixth audit: a critic update stopped after the actor's, named reads in the collectives, an
encoder reward model under packing, the plan's context with the HF engine, the run's config.yaml written durably,
and the vectorised shared-prompt packed layout."""

import copy
import dataclasses

import pytest
import torch
from helpers.rl_case import (
    PAD,
    PPO,
    PROMPTS,
    SCORES,
    FixedScorer,
    changed,
    fixed_completions,
    make_config,
    tiny_actor,
    tiny_critic,
)

# ---- a critic update stopped by a NaN after the actor's whole update ------------------------------------------------


def _ppo_step_whose_critic_loss_is_nan():
    """A PPO RLStep whose critic gives NaN values while it trains (its value pass before the update is finite)."""
    from fastrlhf.rl.step import RLStep

    torch.manual_seed(0)
    hp = make_config(PPO, max_skipped_steps=2)
    actor, ref, critic = tiny_actor(), tiny_actor().eval(), tiny_critic()
    critic.register_forward_hook(lambda module, args, out: out * float("nan") if torch.is_grad_enabled() else None)
    rl = RLStep(
        hp,
        actor,
        rollout=None,
        scorer=FixedScorer(SCORES),
        reference=ref,
        critic=critic,
        actor_optimizer=torch.optim.AdamW(actor.parameters(), lr=1e-2),
        critic_optimizer=torch.optim.AdamW(critic.parameters(), lr=1e-2),
        pad_token_id=PAD,
        rollout_shares_actor=True,
    )
    return rl, actor, critic, fixed_completions(actor, hp.rollout.temperature)


def test_a_critic_nan_after_the_actors_update_is_not_a_skipped_step():
    """The actor's whole update stepped (its weights moved and reach the engine), then the critic's first loss was NaN:
    the step was reported "update skipped" and counted towards the skipped-in-a-row budget. Now it is not a skipped
    step; it is counted apart (stopped part-way), with a budget of its own."""
    from fastrlhf.engine.guards import TooManySkippedSteps

    rl, actor, critic, completions = _ppo_step_whose_critic_loss_is_nan()
    actor_before, critic_before = copy.deepcopy(actor), copy.deepcopy(critic)
    metrics = rl(PROMPTS, None, step=1, completions=completions)
    assert metrics["optimizer_steps"] > 0 and changed(actor, actor_before) > 0
    assert changed(critic, critic_before) == 0  # the critic's step dropped its gradients
    assert metrics["skipped"] == 0, metrics
    g = rl.guard
    assert (g.skipped_total, g.skipped_in_row) == (0, 0)
    assert (g.stopped_part_way, g.stopped_total, g.stopped_in_row, g.moved_steps) == (
        True,
        1,
        1,
        metrics["optimizer_steps"],
    )
    g.check_budget(1)
    rl(PROMPTS, None, step=2, completions=completions)
    with pytest.raises(TooManySkippedSteps, match="2 steps in a row had a non-finite loss or gradient part-way"):
        g.check_budget(2)
    state = g.state_dict()
    assert state["stopped_in_row"] == 2 and state["skipped_in_row"] == 0


def test_a_stopped_step_is_logged_as_such(tmp_path):
    """The loop's line says what happened (weights moved, the rest skipped), and the metrics carry it."""
    from fastrlhf.engine.guards import StepGuard
    from fastrlhf.engine.loop import run_steps

    guard = StepGuard(3)
    logged, lines = [], []

    class Logger:
        def log(self, step, metrics):
            logged.append((step, dict(metrics)))

        def message(self, text):
            lines.append(text)

        def close(self):
            pass

    def step_fn(step):
        guard.note_loss(torch.tensor(1.0))
        assert not guard.should_skip(True)  # one optimizer step moved weights
        guard.note_loss(torch.tensor(float("nan")))
        assert guard.should_skip(True)
        return {"skipped": int(guard.end_step())}

    config = make_config(max_steps=1, log_every=5, save_final=False)
    config = dataclasses.replace(config, output_dir=str(tmp_path))
    run_steps(
        config,
        step_fn,
        start_step=0,
        stateful={},
        logger=Logger(),
        guard=guard,
        skip_reason="non-finite loss or gradient",
        export_engine=None,
    )
    assert logged == [(1, {"skipped": 0, "update_stopped": 1})]
    assert lines == [
        "step 1: non-finite loss or gradient after 1 optimizer steps had moved the weights: the update "
        "stopped there, its remaining optimizer steps skipped (1 in a row, 1 in all)"
    ]


# ---- the run's config.yaml, written durably -------------------------------------------------------------------------


def test_the_runs_config_is_fsynced_before_it_replaces_the_old_one(tmp_path, monkeypatch):
    """tmp + os.replace without an fsync: after a power cut the rename can be on disk and the data not, leaving
    config.yaml empty. Now the file's data is fsynced before the rename, as the checkpoints' files are."""
    import os

    import yaml

    from fastrlhf.engine.loop import write_run_config

    events = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(os, "fsync", lambda fd: events.append(("fsync", os.fstat(fd).st_size)) or real_fsync(fd))
    monkeypatch.setattr(
        os, "replace", lambda a, b: events.append(("replace", os.path.basename(b))) or real_replace(a, b)
    )
    config = dataclasses.replace(make_config(), output_dir=str(tmp_path))
    write_run_config(config)
    assert [e[0] for e in events] == ["fsync", "replace"] and events[0][1] > 0 and events[1][1] == "config.yaml"
    assert yaml.safe_load((tmp_path / "config.yaml").read_text())["output_dir"] == str(tmp_path)


# ---- an encoder reward model under trainer.packing ------------------------------------------------------------------


@pytest.mark.parametrize("name", ["bert", "deberta-v2", "llama"])
def test_an_encoder_reward_model_keeps_its_attention_under_packing(tmp_path, monkeypatch, name):
    """With trainer.packing the reward model was set up for packed rows whatever it was: an encoder (scored by its own
    forward on padded rows, never packed) had its attention switched to fastrlhf_packed (BERT, RoBERTa) or logged
    transformers' "does not support setting its attention implementation dynamically" (DeBERTa). Now only a decoder
    classifier (a ``score`` head, run packed) is."""
    from helpers.reward_classifiers import tiny_classifier

    import fastrlhf.modeling as modeling
    from fastrlhf.rl.trainer import _reward_model

    model = tiny_classifier(name)
    default = model.config._attn_implementation
    model.save_pretrained(tmp_path / name)
    calls = []
    real = modeling.use_attention
    monkeypatch.setattr(
        modeling, "use_attention", lambda m, *a, **k: calls.append(type(m).__name__) or real(m, *a, **k)
    )
    config = make_config(packing=True)
    config = dataclasses.replace(config, reward=dataclasses.replace(config.reward, model_path=str(tmp_path / name)))
    loaded = _reward_model(config, "cpu")
    if name == "llama":
        assert calls == ["LlamaForSequenceClassification"] and loaded.config._attn_implementation == "fastrlhf_packed"
    else:
        assert calls == [] and loaded.config._attn_implementation == default


# ---- the collectives' reads, named ----------------------------------------------------------------------------------


def test_the_collectives_reads_are_named_host_reads_on_two_ranks():
    """On more than one rank these helpers read the device (NCCL reduces on it: the copy back, a flag's ``item()``,
    the gathered sizes), but in no :func:`host_read`, so a run under ``torch.cuda.set_sync_debug_mode("error")``
    stopped there and the read counters missed them (0 named reads each, on either rank). Now each is named."""
    from helpers.followups6_ranks import named_reads
    from helpers.launch import spawn_ranks

    out = spawn_ranks(named_reads)
    for rank in (0, 1):
        results = {k[:-1]: v for k, v in out.items() if k.endswith(str(rank))}
        assert results["agree_on_failure"] == (rank + 1, 1)
        assert results["reduce_floats"] == ([1.0, 1.0], 1)
        assert results["mean_over_ranks"] == ({"a": 0.5}, 1)
        assert results["any_rank_true"] == (True, 1) and results["all_ranks_true"] == (False, 1)
        assert results["gather_bytes"] == ([b"x", b"xx"], 2)


# ---- the plan's context with the HF engine --------------------------------------------------------------------------


def test_the_plan_counts_the_hf_engines_context_within_the_models_positions(tmp_path):
    """With rollout.engine hf a tool run's turns end at the model's positions (2,048 here), but the plan sized its
    sequences at prompt + new + tool tokens, 512 + 1,024 + 1,024 = 2,560: 25% more rollout KV and activations than
    the engine can ever hold (seq_len 2560, update micro-batch 40,960 tokens). vLLM's context is checked within the
    positions, as written."""
    from helpers.plan_cases import QWEN25_1_5B, gpu_grpo, model_folder

    from fastrlhf.memory import components as C

    path = model_folder(tmp_path / "m", {**QWEN25_1_5B, "max_position_embeddings": 2048})
    tools = dict(tools=["tests.helpers.tool_fixtures:add"], max_tool_tokens=1024)
    hf = gpu_grpo(path, 2, engine="hf", **tools)
    assert C.seq_len(hf) == 2048 and C.update_micro_batch(hf, 16)[0] == 16 * 2048
    assert C.seq_len(gpu_grpo(path, 2, engine="vllm", **tools)) == 2560
    assert C.seq_len(gpu_grpo(path, 2, engine="hf")) == 512 + 1024  # within the positions: as written
    assert C.seq_len(gpu_grpo(str(tmp_path / "none"), 2, engine="hf", **tools)) == 2560  # no config.json to read


# ---- the shared-prompt packed layout, vectorised --------------------------------------------------------------------


def _random_shared_case(generator):
    """Prompt groups of 1 to 6 members in a shuffled order (a group's members need not be adjacent), completions of
    0 to 12 tokens (some empty), prompts of 1 to 9."""
    sizes = torch.randint(1, 7, (int(torch.randint(1, 6, (1,), generator=generator)),), generator=generator).tolist()
    groups = [g for g, size in enumerate(sizes) for _ in range(size)]
    groups = [groups[i] for i in torch.randperm(len(groups), generator=generator).tolist()]
    prompt_of = torch.randint(1, 10, (len(sizes),), generator=generator).tolist()
    prompts = [prompt_of[g] for g in groups]
    completions = torch.randint(0, 13, (len(groups),), generator=generator).tolist()
    return prompts, completions, groups


def test_the_vectorised_shared_layout_equals_the_token_by_token_build():
    """A Python loop over every token (12.6 ms at 64 x 1,024 tokens, against 2.2 ms for the plain build) is now a
    loop over prompts and completions and a few tensor ops; every field equals the old build's, on random layouts."""
    from helpers.followups6_shared_layout import old_build_shared

    from fastrlhf.sequences.packing import PackedLayout

    generator = torch.Generator().manual_seed(6)
    for case in range(200):
        prompts, completions, groups = _random_shared_case(generator)
        prompt_width = None if case % 3 == 0 else max(prompts) + case % 2
        width = max(completions) + case % 4
        if case % 7 == 0:
            completions = [0] * len(completions)
        layout = PackedLayout.build(
            prompts, completions, response_width=width, prompt_width=prompt_width, prompt_groups=groups
        )
        old = old_build_shared(prompts, completions, width, prompt_width, groups)
        assert layout.segments == old["segments"], (prompts, completions, groups)
        for name in ("position_ids", "hidden_index", "token_index", "last_index", "source_index"):
            mine, theirs = getattr(layout, name), old[name]
            if theirs is None:
                assert mine is None
                continue
            assert mine.dtype == torch.long and mine.shape == theirs.shape and torch.equal(mine, theirs), (name, case)
