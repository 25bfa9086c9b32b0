"""The ``auto`` settings the memory plan decides (fastrlhf.memory.auto): gradient checkpointing off where the run
fits without it, the update's micro-batch tokens as large as fit, both together; the reasons in the plan's notes,
the decided values in the config the trainer runs (said once), and the safe side without a plan."""

import math
from dataclasses import replace

import pytest
from helpers.plan_cases import QWEN25_1_5B, GiB, gpu_grpo, model_folder

from fastrlhf.config import ConfigError
from fastrlhf.memory import components as C
from fastrlhf.memory.auto import EFFICIENT_MICRO_TOKENS, resolve_auto_settings
from fastrlhf.memory.plan import plan_memory

LENGTH = 512 + 1024  # gpu_grpo's longest sequence
SHARE = 256 // 8  # its minibatch share per rank on 8 GPUs


@pytest.fixture
def config(tmp_path):
    return gpu_grpo(model_folder(tmp_path / "m", QWEN25_1_5B), zero_stage=2)


def with_(config, checkpointing=None, tokens=None, grad_accum=None):
    if checkpointing is not None:
        config = replace(config, model=replace(config.model, gradient_checkpointing=checkpointing))
    t = config.trainer
    return replace(config, trainer=replace(t, max_tokens_per_microbatch=t.max_tokens_per_microbatch if tokens is None
                                           else tokens, grad_accum=grad_accum or t.grad_accum))


def budget_below(plan_of_budget) -> int:
    """The largest budget (to 1 MiB) that ``plan_of_budget(budget)`` does not fit: the plan depends on the budget
    (the loss chunks and vLLM's share take what is free), so the budget is searched, not worked out."""
    low, high = 1 * GiB, 400 * GiB  # low does not fit, high does
    assert not plan_of_budget(low).fits and plan_of_budget(high).fits
    while high - low > (1 << 20):
        mid = (low + high) // 2
        low, high = (low, mid) if plan_of_budget(mid).fits else (mid, high)
    return low


def test_auto_gradient_checkpointing_is_off_where_the_run_fits_without_it(config):
    config = with_(config, checkpointing="auto")

    def plan_at(budget, on):
        return plan_memory(with_(config, checkpointing=on), 8, budget)

    without, with_it = plan_at(80 * GiB, False), plan_at(80 * GiB, True)
    assert with_it.total < without.total  # what checkpointing saves: activations
    roomy = plan_memory(config, 8, 80 * GiB)
    assert roomy.fits and not roomy.gradient_checkpointing and roomy.total == without.total
    assert roomy.notes[0].startswith("model.gradient_checkpointing auto: off: the run fits without it")
    assert resolve_auto_settings(config, roomy) == (with_(config, checkpointing=False), [roomy.notes[0]])
    # A budget the run fits only with checkpointing (margin included): on, for as few layers as fit.
    budget = budget_below(lambda b: plan_at(b, False))
    assert plan_at(budget, True).fits and not plan_at(budget, False).fits
    tight = plan_memory(config, 8, budget)
    k = tight.checkpoint_layers
    assert tight.gradient_checkpointing and tight.fits and 1 <= k < 28 == tight.layers
    assert tight.total == plan_layers(config, budget, k).total and not plan_layers(config, budget, k - 1).fits
    assert tight.notes[0].startswith(f"model.gradient_checkpointing auto: on for the first {k} of 28 layers (")
    assert "without it the run needs" in tight.notes[0]
    decided = resolve_auto_settings(config, tight)[0].model
    assert decided.gradient_checkpointing is True and decided.checkpoint_layers == k
    # Where no layout fits: on for every layer (checkpoint_layers null), and said so.
    hopeless = plan_memory(config, 8, 8 * GiB)
    assert not hopeless.fits and hopeless.gradient_checkpointing and hopeless.checkpoint_layers is None
    assert hopeless.notes[0].startswith("model.gradient_checkpointing auto: on: without it the run needs")
    assert resolve_auto_settings(config, hopeless)[0].model.checkpoint_layers is None
    decided, why = resolve_auto_settings(config, None)  # no plan: the safe side, and said
    assert decided.model.gradient_checkpointing is True and why == ["model.gradient_checkpointing auto: on: no plan"]
    fixed = with_(config, checkpointing=False)
    kept, why = resolve_auto_settings(fixed, tight)
    assert kept is fixed and why == []  # true or false: as written


def plan_layers(config, budget, k):
    """The plan with the first ``k`` decoder layers checkpointed (0: none)."""
    model = replace(config.model, gradient_checkpointing=k > 0, checkpoint_layers=k or None)
    return plan_memory(replace(config, model=model), 8, budget)


def test_auto_checkpoints_the_fewest_layers_that_fit(config):
    """Each checkpointed layer keeps only its input: the plan falls with every layer checkpointed, down to all but
    the last (whose kept activations weigh what its recompute would). Between two layer counts' budgets, auto takes
    the larger count, which is the fewest that fit; at a budget where the first 14 fit, 14."""
    totals = [plan_layers(config, 80 * GiB, k).total for k in range(29)]
    assert all(a > b for a, b in zip(totals[:27], totals[1:28], strict=True))
    everything = replace(config.model, gradient_checkpointing=True)
    assert totals[28] > totals[27] and totals[28] == plan_memory(replace(config, model=everything), 8, 80 * GiB).total
    auto = with_(config, checkpointing="auto")
    between = budget_below(lambda b: plan_layers(config, b, 14))
    assert plan_layers(config, between, 15).fits
    assert plan_memory(auto, 8, between).checkpoint_layers == 15
    assert plan_memory(auto, 8, budget_below(lambda b: plan_layers(config, b, 15)) + (1 << 20)).checkpoint_layers == 15


def test_auto_micro_batch_tokens_are_the_most_whole_sequences_that_fit(config):
    config = with_(config, tokens="auto", grad_accum=1)

    def plan_at(sequences, budget=80 * GiB):
        return plan_memory(with_(config, tokens=sequences * LENGTH), 8, budget)

    # Plenty of memory: the whole share in one micro-batch.
    roomy = plan_memory(config, 8, 200 * GiB)
    assert roomy.fits and roomy.max_tokens_per_microbatch == SHARE * LENGTH
    assert roomy.total == plan_at(SHARE, 200 * GiB).total
    assert roomy.notes[0] == (f"trainer.max_tokens_per_microbatch auto: {SHARE * LENGTH:,}: the whole minibatch "
                              f"share ({SHARE} sequences of {LENGTH:,} tokens) fits")
    # A budget between 11 and 12 sequences: 11, and the plan is the one of 11.
    budget = budget_below(lambda b: plan_at(12, b))
    assert plan_at(11, budget).fits and not plan_at(12, budget).fits
    tight = plan_memory(config, 8, budget)
    assert tight.max_tokens_per_microbatch == 11 * LENGTH and tight.total == plan_at(11, budget).total
    assert tight.notes[0].startswith(f"trainer.max_tokens_per_microbatch auto: {11 * LENGTH:,}: 11 of the share's "
                                     f"{SHARE} sequences")
    assert tight.notes[0].endswith("12 would not")
    decided, notes = resolve_auto_settings(config, tight)
    assert decided == with_(config, tokens=11 * LENGTH) and notes == [tight.notes[0]]
    # Nothing fits: one sequence, said so (and the plan does not fit: a CUDA launch stops on it).
    hopeless = plan_memory(config, 8, 8 * GiB)
    assert not hopeless.fits and hopeless.max_tokens_per_microbatch == LENGTH
    assert "one sequence; even that needs" in hopeless.notes[0]
    # No plan: one sequence per micro-batch.
    decided, notes = resolve_auto_settings(config, None)
    assert decided.trainer.max_tokens_per_microbatch == LENGTH and notes == [
        f"trainer.max_tokens_per_microbatch auto: {LENGTH:,} (one sequence): no plan"]


def test_both_auto_keep_checkpointing_on_where_only_small_micro_batches_fit_without_it(config):
    config = with_(config, checkpointing="auto", tokens="auto", grad_accum=1)
    efficient = -(-EFFICIENT_MICRO_TOKENS // LENGTH)  # 3 sequences of 1,536 tokens

    def plan_at(checkpointing, sequences, budget=80 * GiB):
        return plan_memory(with_(config, checkpointing, sequences * LENGTH), 8, budget)

    # Without checkpointing the efficient micro-batch fits: off, then as many sequences as fit without it.
    plan = plan_memory(config, 8, 80 * GiB)
    assert not plan.gradient_checkpointing and plan_at(False, efficient).fits
    assert plan.notes[0].startswith("model.gradient_checkpointing auto: off: the run fits without it")
    assert f"in micro-batches of {efficient * LENGTH:,} tokens" in plan.notes[0]
    assert plan.notes[1].startswith("trainer.max_tokens_per_microbatch auto:")
    most = plan.max_tokens_per_microbatch // LENGTH
    assert efficient <= most < SHARE and not plan_at(False, most + 1).fits
    decided, notes = resolve_auto_settings(config, plan)
    assert decided == with_(config, False, most * LENGTH) and notes == plan.notes[:2]
    # A budget where only fewer sequences than that fit without it: on, for the fewest layers with which the
    # efficient micro-batch fits, and the most sequences that fit with them.
    budget = budget_below(lambda b: plan_at(False, efficient, b))
    assert plan_at(False, efficient - 1, budget).fits
    plan = plan_memory(config, 8, budget)
    k = plan.checkpoint_layers
    assert plan.gradient_checkpointing and plan.notes[0].startswith(f"model.gradient_checkpointing auto: on for the "
                                                                    f"first {k} of 28 layers")
    assert plan.max_tokens_per_microbatch >= efficient * LENGTH and plan.fits

    def layers_at(k, sequences):
        model = replace(config.model, gradient_checkpointing=k > 0, checkpoint_layers=k or None)
        return plan_memory(with_(replace(config, model=model), tokens=sequences * LENGTH), 8, budget)

    assert layers_at(k, efficient).fits and not layers_at(k - 1, efficient).fits
    assert not layers_at(k, plan.max_tokens_per_microbatch // LENGTH + 1).fits


def test_auto_micro_batch_tokens_need_grad_accum_1_and_the_train_command(tmp_path):
    from fastrlhf.config import load_config
    from fastrlhf.memory.plan_command import _config_json_only, load_plan_config

    path = tmp_path / "run.yaml"
    model = model_folder(tmp_path / "m", QWEN25_1_5B)
    path.write_text(f"algorithm: grpo\noutput_dir: out\nmodel: {{path: {model}}}\ndata: {{prompts: p.jsonl}}\n"
                    "trainer: {max_steps: 1, grad_accum: 2, max_tokens_per_microbatch: auto}\n"
                    "reward: {function: match_answer}\n")
    (tmp_path / "p.jsonl").write_text('{"prompt": "1+1"}\n')
    with pytest.raises(ConfigError, match="trainer.grad_accum"):
        load_plan_config(str(path), device="cpu")
    path.write_text(path.read_text().replace("grad_accum: 2", "grad_accum: 1"))
    assert load_plan_config(str(path), device="cpu").trainer.max_tokens_per_microbatch == "auto"
    sft = tmp_path / "sft.yaml"
    (tmp_path / "d.jsonl").write_text('{"prompt": "a", "response": "b"}\n')
    sft.write_text(f"output_dir: out\nmodel: {{path: {model}}}\ndata: {{path: d.jsonl}}\n"
                   "trainer: {max_steps: 1, max_tokens_per_microbatch: auto}\n")
    with pytest.raises(ConfigError, match="trainer.max_tokens_per_microbatch.*memory plan of `fastrlhf train`"), \
            _config_json_only():  # no weights in the model folder: the config's own checks only
        load_config(str(sft), "sft")


def test_the_rl_trainer_loads_its_models_as_the_plan_decided(config, capsys):
    from fastrlhf.rl import trainer

    config = with_(config, checkpointing="auto", tokens="auto", grad_accum=1)
    plan = plan_memory(config, 8, 80 * GiB)
    decided = trainer._with_auto_decided(config, plan)
    assert decided.model.gradient_checkpointing is False
    assert decided.trainer.max_tokens_per_microbatch == plan.max_tokens_per_microbatch
    assert C.update_micro_batch(decided, SHARE)[0] == plan.max_tokens_per_microbatch
    assert capsys.readouterr().out.strip().splitlines() == plan.notes[:2]  # said once, by the main rank
    safe = trainer._with_auto_decided(config, None)
    assert safe.model.gradient_checkpointing is True and safe.trainer.max_tokens_per_microbatch == LENGTH


def test_every_rank_runs_the_most_cautious_decision_of_any(config, monkeypatch, capsys):
    """Each rank plans on its own budget (a CPU's free memory when it looked); ranks that decide differently would
    hang under ZeRO-3 (one recomputes, and gathers, where another does not)."""
    from fastrlhf.distributed import comm
    from fastrlhf.memory.auto import agree_over_ranks
    from fastrlhf.rl import trainer

    both = with_(config, checkpointing="auto", tokens="auto", grad_accum=1)
    roomy = resolve_auto_settings(both, plan_memory(both, 8, 80 * GiB))[0]
    assert roomy.model.gradient_checkpointing is False and roomy.trainer.max_tokens_per_microbatch > 3 * LENGTH

    def with_a_rank_that_decided(other):
        """max over this rank and one that decided ``other``, as D.reduce_floats(..., "max") gives it."""
        m = other.model  # its checkpointed layers: none, some, every one
        layers = 0.0 if m.gradient_checkpointing is not True else (
            math.inf if m.checkpoint_layers is None else float(m.checkpoint_layers))
        theirs = [layers, -float(other.trainer.max_tokens_per_microbatch)]
        return lambda mine: [max(a, b) for a, b in zip(mine, theirs, strict=True)]

    tighter = with_(roomy, checkpointing=True, tokens=3 * LENGTH)
    agreed, note = agree_over_ranks(both, roomy, with_a_rank_that_decided(tighter))
    assert agreed == tighter
    assert note == ("the ranks' plans decided differently; every rank runs the most cautious: "
                    f"model.gradient_checkpointing on, trainer.max_tokens_per_microbatch {3 * LENGTH:,}")
    assert agree_over_ranks(both, tighter, with_a_rank_that_decided(roomy)) == (tighter, None)  # already cautious
    # Some layers checkpointed: the most layers any rank checkpoints (every one counts as more than any number).
    def some(k):
        return replace(roomy, model=replace(roomy.model, gradient_checkpointing=True, checkpoint_layers=k))

    agreed, note = agree_over_ranks(both, some(10), with_a_rank_that_decided(some(12)))
    assert agreed == some(12) and "model.gradient_checkpointing on for the first 12 layers" in note
    assert agree_over_ranks(both, some(12), with_a_rank_that_decided(some(10))) == (some(12), None)
    assert agree_over_ranks(both, roomy, with_a_rank_that_decided(some(3)))[0] == some(3)
    assert agree_over_ranks(both, some(27), with_a_rank_that_decided(with_(roomy, checkpointing=True)))[0] == \
        with_(roomy, checkpointing=True)
    # A setting that was not auto stays as configured, whatever another rank decided.
    fixed = with_(config, checkpointing=False, tokens="auto", grad_accum=1)
    decided = resolve_auto_settings(fixed, plan_memory(fixed, 8, 80 * GiB))[0]
    agreed, note = agree_over_ranks(fixed, decided, with_a_rank_that_decided(tighter))
    assert agreed.model.gradient_checkpointing is False and agreed.trainer.max_tokens_per_microbatch == 3 * LENGTH
    assert note.endswith(f"most cautious: trainer.max_tokens_per_microbatch {3 * LENGTH:,}")

    # The trainer asks the other ranks, in one collective.
    asked = []
    monkeypatch.setattr(comm, "reduce_floats", lambda values, op: asked.append(op) or
                        with_a_rank_that_decided(tighter)(values))
    assert trainer._with_auto_decided(both, plan_memory(both, 8, 80 * GiB)) == tighter and asked == ["max"]
    assert capsys.readouterr().out.strip().splitlines()[-1] == note.replace(
        "most cautious: ", "most cautious: model.gradient_checkpointing on, ")
