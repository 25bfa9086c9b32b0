"""Held-out evaluation in ``fastrlhf sft`` and ``fastrlhf rm`` (``data.eval_path``, ``trainer.eval_every``;
fastrlhf.supervised.evaluation): its metrics against hand computations on tiny fp32 models, whatever the
micro-batches, packing and ranks; eval mode and back; one host read; the cadence, --resume and --dry-run of a
run; the config checks."""

import json
import math
import os
import random
import shutil
import sys

import pytest
import yaml
from helpers.launch import run_group, spawn_ranks
from helpers.other_device import OtherDevice
from helpers.supervised_eval_case import (
    CASES,
    RANK_CASES,
    RANK_MICRO,
    VOCAB,
    class_examples,
    config,
    evaluate_rank,
    evaluator,
    hand_classifier,
    hand_pairwise,
    hand_sft,
    pair_examples,
    sft_examples,
    tiny_classifier,
    tiny_lm,
)

from fastrlhf.config import ConfigError, load_config
from fastrlhf.data import DataError
from fastrlhf.engine.metrics import read_metrics
from fastrlhf.supervised.evaluation import EVAL_READ

LAYOUTS = [(packing, micro, max_tokens) for packing in (False, True) for micro, max_tokens in
           ((1, None), (3, None), (8, None), (8, 12))]
LAYOUT_IDS = [f"{'packed' if p else 'padded'}-micro{m}-{'budget' if t else 'count'}" for p, m, t in LAYOUTS]


@pytest.mark.parametrize("packing,micro,max_tokens", LAYOUTS, ids=LAYOUT_IDS)
def test_sft_eval_loss_is_the_token_mean_nll_of_every_held_out_token(packing, micro, max_tokens):
    model, examples = tiny_lm(), sft_examples()
    want = hand_sft(model, examples)
    got = evaluator(config("sft", packing=packing, max_tokens_per_microbatch=max_tokens), model, examples,
                    micro)(model)
    assert got["eval/loss"] == pytest.approx(want, abs=1e-5, rel=1e-5)
    assert got["eval/perplexity"] == pytest.approx(math.exp(got["eval/loss"]), rel=1e-12)
    assert set(got) == {"eval/loss", "eval/perplexity"}


def test_the_token_mean_is_not_trls_mean_of_batch_means():
    """transformers' evaluation loop (TRL's SFTTrainer ``eval_loss``): each eval batch's token mean, repeated per
    example and averaged (trainer.py ``evaluation_loop``: ``losses.repeat(batch_size)`` ... ``all_losses.mean()``):
    it moves with the batch size where lengths differ; the token mean does not (the cases above)."""
    model, examples = tiny_lm(), sft_examples()

    def trl_eval_loss(batch_size):
        per_example = []
        for start in range(0, len(examples), batch_size):
            batch = examples[start:start + batch_size]
            per_example += [hand_sft(model, batch)] * len(batch)
        return sum(per_example) / len(per_example)

    assert abs(trl_eval_loss(1) - trl_eval_loss(3)) > 1e-3  # the case differs from TRL's: the test can tell
    ours = evaluator(config("sft"), model, examples, 3)(model)["eval/loss"]
    assert ours == pytest.approx(hand_sft(model, examples), abs=1e-5)
    assert abs(ours - trl_eval_loss(3)) > 1e-3


@pytest.mark.parametrize("packing,micro,max_tokens", LAYOUTS, ids=LAYOUT_IDS)
@pytest.mark.parametrize("kind", ["pairwise", "classifier"])
def test_reward_model_eval_metrics_match_a_hand_computation(kind, packing, micro, max_tokens):
    model = tiny_classifier(1 if kind == "pairwise" else 3)
    examples = pair_examples() if kind == "pairwise" else class_examples()
    want = (hand_pairwise if kind == "pairwise" else hand_classifier)(model, examples)
    got = evaluator(config("rm", kind, packing=packing, max_tokens_per_microbatch=max_tokens), model, examples,
                    micro)(model)
    assert set(got) == set(want)
    for key, value in want.items():
        assert got[key] == pytest.approx(value, abs=1e-5, rel=1e-5), key
    if kind == "pairwise":  # the hand case has both outcomes: accuracy is not trivially 0 or 1
        assert 0 < got["eval/accuracy"] < 1


@pytest.mark.parametrize("case", ["sft", "pairwise"])
def test_evaluation_runs_without_dropout_or_gradients_and_restores_the_mode(case):
    command, kind, _, make_examples = CASES[case]
    model = tiny_lm(dropout=0.5) if case == "sft" else tiny_classifier(1, dropout=0.5)
    examples = make_examples()
    hand = hand_sft(model.eval(), examples) if case == "sft" else hand_pairwise(model.eval(), examples)["eval/loss"]
    evaluate = evaluator(config(command, kind), model, examples, 3)
    model.train()
    got = [evaluate(model)["eval/loss"] for _ in range(2)]
    assert got[0] == got[1] == pytest.approx(hand, abs=1e-5)  # dropout at 0.5 would move both
    assert model.training and all(m.training for m in model.modules())
    assert all(p.grad is None for p in model.parameters())
    model.eval()
    evaluate(model)
    assert not any(m.training for m in model.modules())  # the mode it was in, not train mode


@pytest.mark.parametrize("case,packing", [("sft", False), ("sft", True), ("pairwise", True), ("classifier", False)])
def test_one_named_host_read_per_evaluation(case, packing):
    """On the emulated second device (helpers.other_device), which records every read of a device value: the
    micro-batches' sums stay on the device and come to the host once, in the named read."""
    command, kind, make, make_examples = CASES[case]
    with OtherDevice() as dev:
        model = dev.move(make().train())
        evaluate = evaluator(config(command, kind, packing=packing, loss_chunk_size=4), model, make_examples(), 2)
        before = len(dev.reads)
        metrics = evaluate(model)
        reads = dev.reads[before:]
    assert len(evaluate.batches) > 1  # several micro-batches, one read
    assert [name for name, _, _ in reads] == [EVAL_READ], reads
    assert all(math.isfinite(v) for v in metrics.values()), metrics


@pytest.mark.slow
def test_two_gloo_ranks_give_the_one_rank_metrics_with_as_many_forwards_each():
    """Seven examples on two ranks (one rank holds one more), dealt by tokens; by count and by a token budget the
    ranks plan different numbers of micro-batches: the one with fewer runs filler forwards (ZeRO-3 gathers the
    parameters in every forward, on every rank), whose results are dropped."""
    out = spawn_ranks(evaluate_rank)
    assert set(out[0]) == set(out[1]) == set(RANK_CASES)
    fillers = 0
    for (name, packing, max_tokens), (got, forwards, filler) in out[0].items():
        command, kind, make, examples = CASES[name]
        cfg = config(command, kind, packing=packing, max_tokens_per_microbatch=max_tokens, balance_ranks=True)
        model = make().train()
        want = evaluator(cfg, model, examples(), micro=RANK_MICRO)(model)
        other, other_forwards, other_filler = out[1][name, packing, max_tokens]
        assert forwards == other_forwards, (name, packing, max_tokens)
        fillers += filler + other_filler
        for key, value in want.items():
            assert got[key] == other[key], key  # every rank reads the same reduced sums
            assert got[key] == pytest.approx(value, abs=1e-5, rel=1e-5), (name, packing, max_tokens, key)
    assert fillers > 0  # the uneven case is among them


# ------------------------------------------------------------------------------------------ runs


ENV = {**os.environ, "FASTRLHF_DIST_TIMEOUT": "60", "FASTRLHF_NO_PROGRESS": "1", "PYTHONUNBUFFERED": "1"}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    from fastrlhf.modeling.tiny import save_tiny_llama

    root = tmp_path_factory.mktemp("supervised_eval")
    save_tiny_llama(root / "model", vocab_size=VOCAB, hidden_size=64, num_layers=1)
    rng = random.Random(0)
    for name, n in (("sft.jsonl", 8), ("eval.jsonl", 5)):
        with open(root / name, "w") as f:
            for _ in range(n):
                prompt = [rng.randrange(3, VOCAB) for _ in range(rng.randrange(2, 6))]
                f.write(json.dumps({"prompt_ids": prompt, "response_ids": [(t * 7) % 61 + 3 for t in prompt]}) + "\n")
    with open(root / "bad_eval.jsonl", "w") as f:  # line 3: a token id outside the vocabulary
        for response in ([5, 6], [7, 8], [9, VOCAB + 5], [10]):
            f.write(json.dumps({"prompt_ids": [3, 4], "response_ids": response}) + "\n")
    return root


def write_config(workdir, name, data=None, **trainer):
    raw = {"output_dir": str(workdir / name), "model": {"path": str(workdir / "model")},
           "data": {"path": str(workdir / "sft.jsonl"), "max_len": 32, "eval_path": str(workdir / "eval.jsonl"),
                    **(data or {})},
           "trainer": {"max_steps": 5, "batch_size": 4, "lr": 1.0e-2, "eval_every": 2, **trainer},
           "deepspeed": {"zero_stage": 2}}
    path = workdir / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return str(path)


def _run_sft(config_path, monkeypatch, resume=False):
    """``fastrlhf sft`` in this process; returns the steps at which an evaluation ran."""
    from fastrlhf.supervised import evaluation, sft

    evaluated, call = [], evaluation.Evaluator.__call__
    monkeypatch.setenv("FASTRLHF_DIST_TIMEOUT", "60")
    monkeypatch.setenv("FASTRLHF_NO_PROGRESS", "1")
    monkeypatch.setattr(evaluation.Evaluator, "__call__",
                        lambda self, engine: evaluated.append(1) or call(self, engine))
    sft.run(load_config(config_path, "sft"), resume=resume)
    return len(evaluated)


@pytest.mark.slow
def test_a_run_evaluates_every_eval_every_steps_and_after_the_last_and_resume_does_not_repeat(workdir, monkeypatch):
    # log_every 3: steps 2 and 4 are evaluated off the log cadence, and logged all the same (once each)
    config = write_config(workdir, "cadence", log_every=3, save_every=2)
    assert _run_sft(config, monkeypatch) == 3
    out = workdir / "cadence"
    records = read_metrics(str(out / "metrics.jsonl"))
    assert [r["step"] for r in records] == [2, 3, 4, 5]
    assert [r["step"] for r in records if "eval/loss" in r] == [2, 4, 5]
    assert all("loss" in r and "lr" in r for r in records)  # the step's own record, the evaluation in it
    assert all(r["eval/perplexity"] == pytest.approx(math.exp(r["eval/loss"])) for r in records if "eval/loss" in r)

    # Killed after step 4's checkpoint: the resumed run evaluates step 5 only (step 4's evaluation is in its record).
    resumed = workdir / "cadence_resumed"
    shutil.copytree(out, resumed, ignore=shutil.ignore_patterns("final", "step-5"))
    (resumed / "checkpoints" / "latest").write_text("step-4\n")
    config = write_config(workdir, "cadence_resumed", log_every=3, save_every=2)
    assert _run_sft(config, monkeypatch, resume=True) == 1
    again = read_metrics(str(resumed / "metrics.jsonl"))
    assert [r["step"] for r in again if "eval/loss" in r] == [2, 4, 5]
    assert [r.get("eval/loss") for r in again] == [r.get("eval/loss") for r in records]  # exact resume


@pytest.mark.slow
def test_bad_eval_data_fails_before_training_with_its_line(workdir, monkeypatch):
    from fastrlhf import distributed as D
    from fastrlhf.supervised import sft

    config = write_config(workdir, "bad_eval", data={"eval_path": str(workdir / "bad_eval.jsonl")})
    rc, log = run_group([sys.executable, "-m", "fastrlhf", "sft", "--config", config, "--dry-run"], 120, env=ENV)
    assert rc == 2 and log.strip().splitlines() == [f"data error: bad_eval.jsonl:3: token id {VOCAB + 5} in response "
                                                    f"is outside the vocabulary [0, {VOCAB})"], log

    monkeypatch.setattr(D, "init_distributed", lambda **kw: pytest.fail("training started"))
    with pytest.raises(DataError, match="bad_eval.jsonl:3: token id"):
        sft.run(load_config(config, "sft"))


@pytest.mark.parametrize("command", ["sft", "rm"])
def test_eval_config_checks(workdir, command):
    def load(data=None, **trainer):
        return load_config(write_config(workdir, f"checks_{command}", data, **trainer), command)

    with pytest.raises(ConfigError, match=r"^trainer\.eval_every: must be > 0, got 0$"):
        load(eval_every=0)
    with pytest.raises(ConfigError, match=r"^data\.eval_path: path does not exist: .*missing\.jsonl$"):
        load(data={"eval_path": str(workdir / "missing.jsonl")})
    # Evaluation switched off (no eval_path): its cadence stays a setting, not an error
    assert load(data={"eval_path": None}, eval_every=7).trainer.eval_every == 7
    with pytest.raises(ConfigError, match=r"^trainer\.eval_every: must be > 0"):
        load(data={"eval_path": None}, eval_every=-1)


@pytest.mark.slow
def test_a_run_without_eval_path_logs_no_eval_metrics(workdir, monkeypatch):
    config = write_config(workdir, "no_eval", data={"eval_path": None}, max_steps=2)
    assert _run_sft(config, monkeypatch) == 0
    assert not any(k.startswith("eval/") for r in read_metrics(str(workdir / "no_eval" / "metrics.jsonl")) for k in r)


def test_the_hand_cases_hold_what_the_losses_treat_apart():
    """Some pairs carry a data margin (TRL's loss subtracts it), some not; an SFT example has a response mask and
    one has no prompt (its first token untrained); the lengths differ (a mean of batch means would then differ)."""
    assert any(p.margin for p in pair_examples()) and not all(p.margin for p in pair_examples())
    assert any(e.response_mask for e in sft_examples()) and any(not e.prompt_ids for e in sft_examples())
    assert len({len(e.response_ids) for e in sft_examples()}) > 2
