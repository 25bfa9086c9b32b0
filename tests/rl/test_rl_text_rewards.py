"""Batch reward functions on text (reward.functions, TRL's signature): decoding, dataset columns,
weights, None, errors; and the columns of a prompt row travelling to the reward."""

import json
import math

import numpy as np
import pytest
import torch

from fastrlhf.config import RewardFunctionConfig
from fastrlhf.data import Columns, load_prompts
from fastrlhf.rl.experience import build_experience
from fastrlhf.rl.rewards import RewardFunctionError, RewardScorer, TextReward, completion_text, resolve_text_rewards
from fastrlhf.rollout import Completion


class CharTokenizer:
    """Token id i is the character chr(ord('a') + i); ids >= 26 are special: skipped, or shown as <i>."""

    def batch_decode(self, rows, skip_special_tokens=True):
        def text(t):
            return chr(ord("a") + t) if t < 26 else "" if skip_special_tokens else f"<{t}>"

        return ["".join(map(text, row)) for row in rows]


PROMPTS = [[0, 1], [2]]  # "ab", "c"
COMPLETIONS = [[Completion([3, 4, 30], [0.0] * 3, "stop"), Completion([5], [0.0], "length")],
               [Completion([0], [0.0], "stop"), Completion([1, 1], [0.0] * 2, "stop")]]
METAS = [{"answer": "de", "source": "x"}, {"answer": "a"}]


def score(scorer, prompts=PROMPTS, metas=METAS):
    exp = build_experience(prompts, COMPLETIONS, pad_token_id=31)
    rows = [(p, c.token_ids, m) for p, m, samples in zip(prompts, metas, COMPLETIONS, strict=True) for c in samples]
    return scorer(exp, *map(list, zip(*rows, strict=True)))


def test_text_rewards_get_decoded_text_ids_and_columns_and_add_up_by_weight():
    seen = {}

    def exact(prompts, completions, completion_ids, answer, **columns):
        seen.update(prompts=prompts, completions=completions, completion_ids=completion_ids, answer=answer,
                    columns=columns)
        return [float(c == a) for c, a in zip(completions, answer, strict=True)]

    def short(prompts, completions, completion_ids, source, **_):
        # Not applicable (None) where the row has no source column.
        return [None if s is None else 1.0 / len(c) for c, s in zip(completions, source, strict=True)]

    scorer = RewardScorer(text_rewards=[TextReward("exact", exact, 2.0), TextReward("short", short, 0.5)],
                          tokenizer=CharTokenizer())
    scores = score(scorer)
    assert seen["prompts"] == ["ab", "ab", "c", "c"]
    assert seen["completions"] == ["de", "f", "a", "bb"]  # the special id 30 is not text
    assert seen["completion_ids"] == [[3, 4, 30], [5], [0], [1, 1]]
    assert seen["answer"] == ["de", "de", "a", "a"] and seen["columns"] == {"source": ["x", "x", None, None]}
    torch.testing.assert_close(scores, torch.tensor([2.0 + 0.25, 0.5, 2.0, 0.0]))
    assert scorer.metrics == {"reward/exact": 0.5, "reward/short": 0.75}  # short: mean of its 2 applicable


# In the spirit of TRL's documentation (GRPOTrainer, "Using a custom reward function"): a conversational
# reward reads each completion's content and the prompt's last user turn; a standard one reads strings.
def trl_conversational(seen):
    def reward(prompts, completions, answer, **kwargs):
        seen.append({"prompts": prompts, "completions": completions, "answer": answer, "kwargs": kwargs})
        contents = [completion[0]["content"] for completion in completions]
        asked = [prompt[-1]["content"] for prompt in prompts]
        return [float(a in c or q == c) for c, q, a in zip(contents, asked, answer, strict=True)]

    return reward


def trl_standard(seen):
    def reward(prompts, completions, **kwargs):
        seen.append({"prompts": prompts, "completions": completions, "kwargs": kwargs})
        return [float(len(c) > len(p)) for p, c in zip(prompts, completions, strict=True)]

    return reward


CHATS = [[{"role": "system", "content": "be brief"}, {"role": "user", "content": "ab"}],
         [{"role": "user", "content": "c"}]]


def test_trl_format_conversational_rows_get_their_messages_and_assistant_turns():
    seen = []
    metas = [Columns({"answer": "de", "level": 1}, CHATS[0]), Columns({"answer": "a", "level": 2}, CHATS[1])]
    scorer = RewardScorer(text_rewards=[TextReward("conv", trl_conversational(seen))], tokenizer=CharTokenizer())
    scores = score(scorer, prompts=[[26, 0, 1, 27], [26, 2, 27]], metas=metas)
    (got,) = seen
    assert got["prompts"] == [CHATS[0], CHATS[0], CHATS[1], CHATS[1]]
    assert got["completions"] == [[{"role": "assistant", "content": "de"}], [{"role": "assistant", "content": "f"}],
                                  [{"role": "assistant", "content": "a"}], [{"role": "assistant", "content": "bb"}]]
    assert got["answer"] == ["de", "de", "a", "a"]
    assert got["kwargs"] == {"completion_ids": [[3, 4, 30], [5], [0], [1, 1]], "level": [1, 1, 2, 2]}
    torch.testing.assert_close(scores, torch.tensor([1.0, 0.0, 1.0, 0.0]))


def test_trl_format_prompts_are_copies_a_function_may_edit():
    def pops(prompts, completions, **kwargs):  # TRL's own trainer pops a prefilled assistant turn
        for prompt in prompts:
            prompt.pop()
        return [0.0] * len(prompts)

    seen = []
    metas = [Columns({"answer": "x"}, CHATS[0]), Columns({"answer": "y"}, CHATS[1])]
    scorer = RewardScorer(text_rewards=[TextReward("pops", pops), TextReward("conv", trl_conversational(seen))],
                          tokenizer=CharTokenizer())
    score(scorer, metas=metas)
    assert seen[0]["prompts"] == [CHATS[0], CHATS[0], CHATS[1], CHATS[1]]  # the next function sees them whole
    assert metas[0].prompt == CHATS[0] and len(CHATS[0]) == 2  # and so does the data set


def test_trl_format_standard_rows_get_strings_and_token_id_rows_their_decoded_text():
    seen = []
    # Row 0 was given as text (its prompt, not the decoded ids); row 1 as token ids (a plain dict: no prompt).
    metas = [Columns({"answer": "de"}, "Q: ab?"), {"answer": "a"}]
    scorer = RewardScorer(text_rewards=[TextReward("std", trl_standard(seen))], tokenizer=CharTokenizer())
    score(scorer, prompts=[[0, 1], [2, 28]], metas=metas)
    (got,) = seen
    assert got["prompts"] == ["Q: ab?", "Q: ab?", "c", "c"]  # special id 28 skipped
    assert got["completions"] == ["de", "f", "a", "bb"]
    assert got["kwargs"] == {"completion_ids": [[3, 4, 30], [5], [0], [1, 1]], "answer": ["de", "de", "a", "a"]}


def test_text_format_gives_the_prompt_the_model_saw_with_its_special_tokens():
    seen = []
    metas = [Columns({"answer": "de"}, CHATS[0]), Columns({"answer": "a"}, "c")]
    scorer = RewardScorer(text_rewards=[TextReward("std", trl_standard(seen))], tokenizer=CharTokenizer(),
                          reward_format="text")
    score(scorer, prompts=[[26, 0, 1, 27], [2]], metas=metas)
    assert seen[0]["prompts"] == ["<26>ab<27>", "<26>ab<27>", "c", "c"]
    assert seen[0]["completions"] == ["de", "f", "a", "bb"]  # special tokens skipped, as in trl
    with pytest.raises(ValueError, match="reward_format must be one of trl, text, got 'chat'"):
        RewardScorer(text_rewards=[TextReward("std", trl_standard([]))], tokenizer=CharTokenizer(),
                     reward_format="chat")


def test_completion_text_reads_either_form():
    assert completion_text("The answer is 4.") == "The answer is 4."
    assert completion_text([{"role": "assistant", "content": "The answer is 4."}]) == "The answer is 4."


def test_a_reward_function_that_raises_or_miscounts_is_named_in_one_line():
    def broken(prompts, completions, completion_ids, **_):
        raise KeyError("answer\nsecond line")

    with pytest.raises(RewardFunctionError) as info:
        score(RewardScorer(text_rewards=[TextReward("broken", broken)], tokenizer=CharTokenizer()))
    assert "\n" not in info.value.summary and info.value.exit_code == 1  # raised on some input: exit 1
    assert info.value.summary.startswith("reward function 'broken' raised KeyError on a batch of 4 completions")
    assert str(info.value).startswith(info.value.summary + "\n")  # then the function's own frames

    def miscount(prompts, completions, completion_ids, **_):
        return [1.0]

    with pytest.raises(RewardFunctionError, match="'miscount' returned 1 values for a batch of 4 completions") as info:
        score(RewardScorer(text_rewards=[TextReward("miscount", miscount)], tokenizer=CharTokenizer()))
    assert info.value.exit_code == 2 and "\n" not in str(info.value)  # wrong as written: exit 2
    assert str(info.value).endswith(f"(it is at tests/rl/test_rl_text_rewards.py:{miscount.__code__.co_firstlineno})")


def _parse(text):
    return int(text[1:])  # "de" -> ValueError


def _checked(completions):
    return [float(_parse(c)) for c in completions]


def test_a_raising_reward_shows_the_frames_of_the_users_own_file_not_fastrlhfs():
    """Per-sample and batch alike: the summary line, then the frames of this file (the user's), from the
    function down to the line that raised; none of fastrlhf's, of an installed package's or the stdlib's."""

    def per_sample(prompt_ids, completion_ids, meta):
        return json.loads("{")  # raises inside the standard library: its frames are not shown

    def batch(prompts, completions, completion_ids, **_):
        return _checked(completions)

    for scorer, first in ((RewardScorer(per_sample), "json.loads"), (RewardScorer(
            text_rewards=[TextReward("batch", batch)], tokenizer=CharTokenizer()), "return _checked(completions)")):
        with pytest.raises(RewardFunctionError) as info:
            score(scorer)
        lines = str(info.value).splitlines()
        files = [line.split('"')[1] for line in lines[1:] if line.startswith("  File ")]
        assert files and all(f == __file__ for f in files), lines
        assert first in lines[2] and info.value.exit_code == 1, lines
    assert lines[0] == "reward function 'batch' raised ValueError on a batch of 4 completions: invalid literal " \
                       "for int() with base 10: 'e'"
    functions = [line.rsplit(" in ", 1)[1] for line in lines if line.startswith("  File ")]
    assert [f for f in functions if f != "<listcomp>"] == ["batch", "_checked", "_parse"], lines
    assert "    return int(text[1:])  # \"de\" -> ValueError" in lines, lines  # the line that raised


def test_a_per_sample_reward_that_raises_is_a_reward_error_naming_the_completion():
    def fails_on_the_third(prompt_ids, completion_ids, meta):
        if completion_ids == [0]:
            raise ZeroDivisionError("division by zero")
        return 1.0

    fails_on_the_third.__name__ = "mine"
    with pytest.raises(RewardFunctionError) as info:
        score(RewardScorer(fails_on_the_third))
    assert info.value.summary == ("reward function 'mine' raised ZeroDivisionError on completion 2 of a batch of 4: "
                                  "division by zero") and info.value.exit_code == 1


@pytest.mark.parametrize("returned, got", [
    (lambda n: ["correct"] * n, "str 'correct' for completion 0 of a batch of 4"),
    (lambda n: ["1.0"] * n, "str '1.0' for completion 0 of a batch of 4"),  # TRL refuses these too
    (lambda n: [0.5, [1.0], 0.5, 0.5], "list [1.0] for completion 1 of a batch of 4"),
    (lambda n: 0.5, "float for a batch of 4 completions"),
    (lambda n: "0.5", "str for a batch of 4 completions"),
    (lambda n: {"a": 1.0}, "dict for a batch of 4 completions"),
    (lambda n: torch.ones(n, 1), "Tensor of shape (4, 1) for a batch of 4 completions"),
])
def test_a_batch_reward_of_the_wrong_type_is_wrong_as_written_exit_2(returned, got):
    def wrong(prompts, completions, completion_ids, **_):
        return returned(len(completions))

    with pytest.raises(RewardFunctionError) as info:
        score(RewardScorer(text_rewards=[TextReward("wrong", wrong)], tokenizer=CharTokenizer()))
    assert info.value.summary.startswith(f"reward function 'wrong' returned {got}; expected "), info.value.summary
    assert info.value.exit_code == 2 and "\n" not in str(info.value)


@pytest.mark.parametrize("value", ["1.0", [1.0], (1.0,), 1 + 2j])
def test_a_per_sample_reward_of_the_wrong_type_is_wrong_as_written_exit_2(value):
    with pytest.raises(RewardFunctionError) as info:
        score(RewardScorer(lambda prompt_ids, completion_ids, meta: value))
    assert info.value.summary.startswith(f"reward function '<lambda>' returned {type(value).__name__} "
                                         f"{value!r} for completion 0 of a batch of 4; expected a number")
    assert info.value.exit_code == 2


@pytest.mark.parametrize("convert", [np.array, tuple, torch.tensor, lambda v: (x for x in v),
                                     lambda v: [np.float32(x) for x in v], lambda v: [torch.tensor(x) for x in v]],
                         ids=["numpy", "tuple", "tensor", "generator", "numpy-scalars", "0-dim-tensors"])
def test_batch_rewards_as_trl_takes_them_numpy_arrays_tuples_tensors(convert):
    def exact(prompts, completions, completion_ids, answer, **_):
        return convert([float(c == a) for c, a in zip(completions, answer, strict=True)])

    scores = score(RewardScorer(text_rewards=[TextReward("exact", exact)], tokenizer=CharTokenizer()))
    torch.testing.assert_close(scores, torch.tensor([1.0, 0.0, 1.0, 0.0]))


def test_per_sample_rewards_take_numpy_scalars_bools_and_none_as_no_reward():
    values = iter([np.float64(0.25), None, True, np.int64(2)])
    scorer = RewardScorer(lambda prompt_ids, completion_ids, meta: next(values))
    torch.testing.assert_close(score(scorer), torch.tensor([0.25, 0.0, 1.0, 2.0]))


def test_none_is_no_reward_from_that_function_and_a_completion_none_scores_gets_0_as_in_trl():
    """TRL turns None into NaN and sums the functions with nansum: a None adds nothing, and a completion
    that no function scores gets 0. The per-sample function takes part in the same sum."""

    def some(prompts, completions, completion_ids, **_):
        return [1.0, None, None, 0.5]

    def others(prompts, completions, completion_ids, **_):
        return np.array([None, 2.0, None, 0.5])  # an object array, as np.array of floats and None makes

    per_sample = iter([None, 0.25, None, None])
    scorer = RewardScorer(lambda prompt_ids, completion_ids, meta: next(per_sample), tokenizer=CharTokenizer(),
                          text_rewards=[TextReward("some", some), TextReward("others", others, 2.0)])
    torch.testing.assert_close(score(scorer), torch.tensor([1.0, 4.25, 0.0, 1.5]))
    assert scorer.metrics == {"reward/some": 0.75, "reward/others": 1.25}


def test_nan_from_a_text_reward_reaches_the_scores_so_the_guard_skips_the_step():
    def nan(prompts, completions, completion_ids, **_):
        return [math.nan] + [0.0] * (len(completions) - 1)

    scores = score(RewardScorer(text_rewards=[TextReward("nan", nan)], tokenizer=CharTokenizer()))
    assert math.isnan(float(scores[0])) and not torch.isnan(scores[1:]).any()


def test_resolve_text_rewards():
    rewards = resolve_text_rewards([RewardFunctionConfig("fastrlhf.rl.rewards:length_reward", 0.5)])
    assert (rewards[0].name, rewards[0].weight) == ("length_reward", 0.5)
    with pytest.raises(ValueError, match="unknown reward function 'nope'"):
        resolve_text_rewards([RewardFunctionConfig("nope")])


def test_every_column_of_a_prompt_row_travels_in_meta(tmp_path):
    path = tmp_path / "prompts.jsonl"
    rows = [{"prompt_ids": [1, 2], "answer": "42", "data_source": "gsm"},
            {"prompt_ids": [3], "answer": "7", "meta": {"answer": "8", "level": 2}}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    examples = load_prompts(str(path))
    assert examples[0].meta == {"answer": "42", "data_source": "gsm"}
    assert examples[1].meta == {"answer": "8", "level": 2}  # meta's own key wins over the column


@pytest.fixture(scope="module")
def text_model(tmp_path_factory):
    """A tiny Llama with a word-level tokenizer saved beside it (token i is the word ``w<i>``)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from fastrlhf.modeling.tiny import save_tiny_llama

    root = tmp_path_factory.mktemp("text_rl")
    save_tiny_llama(root / "model", vocab_size=64, hidden_size=32, num_heads=1)
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(64)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0")
    # A chat template in this vocabulary: w40 <content> w41 per message, w42 opens the assistant's turn.
    tokenizer.chat_template = ("{% for m in messages %}w40 {{ m['content'] }} w41 {% endfor %}"
                               "{% if add_generation_prompt %}w42{% endif %}")
    tokenizer.save_pretrained(root / "model")
    with open(root / "prompts.jsonl", "w") as f:
        for i in range(4):
            f.write(json.dumps({"prompt_ids": [5 + i, 6 + i, 7], "answer": f"w{3 + i}"}) + "\n")
    return root


def _run(text_model, name, functions, launcher=False, trainer=None, **sections):
    import os
    import subprocess
    import sys

    import yaml
    from helpers.rl_runs import launch_env

    config = {"algorithm": "grpo", "output_dir": str(text_model / name), "model": {"path": str(text_model / "model")},
              "reward": {"functions": functions}, "data": {"prompts": str(text_model / "prompts.jsonl")},
              "rollout": {"engine": "hf", "n": 2, "max_new_tokens": 3},
              "trainer": {"max_steps": 2, "prompts_per_step": 2, "minibatch_size": 4, "lr": 1e-3, **(trainer or {})},
              "deepspeed": {"zero_stage": 0}}
    for key, value in sections.items():
        config[key] = {**config.get(key, {}), **value}
    path = text_model / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    env = launch_env(FASTRLHF_DIST_TIMEOUT="60")
    if launcher:
        from helpers.launch import run_group

        from fastrlhf.distributed import free_port

        deepspeed = os.path.join(os.path.dirname(sys.executable), "deepspeed")
        rc, out = run_group([deepspeed, "--num_gpus", "2", "--master_port", str(free_port()), "--module", "fastrlhf",
                             "train", "--config", str(path)], timeout=240, env=env)
        return subprocess.CompletedProcess([], rc, out, out), text_model / name
    proc = subprocess.run([sys.executable, "-m", "fastrlhf", "train", "--config", str(path)], env=env,
                          capture_output=True, text=True, timeout=240)
    return proc, text_model / name


@pytest.mark.slow
def test_fastrlhf_train_scores_with_weighted_text_rewards_on_dataset_columns(text_model):
    proc, out = _run(text_model, "text_ok", [{"function": "text_rewards:mentions_answer", "weight": 2.0},
                                             {"function": "text_rewards:only_short", "weight": 0.5}])
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        assert 0.0 <= r["reward/mentions_answer"] <= 1.0 and r["reward/only_short"] in (0.0, 1.0)
        assert r["reward_mean"] <= 2.0 * r["reward/mentions_answer"] + 0.5 + 1e-9


@pytest.mark.slow
def test_a_raising_text_reward_ends_the_run_with_one_line_naming_it(text_model):
    proc, _ = _run(text_model, "text_boom", [{"function": "text_rewards:boom"}])
    assert proc.returncode == 1, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("reward error")]
    assert lines == ["reward error: reward function 'boom' raised KeyError on a batch of 4 completions: "
                     "\"no column 'missing' in this batch\""], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    proc, _ = _run(text_model, "text_unknown", [{"function": "text_rewards:nope"}])
    assert proc.returncode == 2 and "config error: reward.functions: reward.functions[0].function 'text_rewards:nope'" \
        in proc.stderr, proc.stderr[-3000:]


def _ended_alike(proc, out, line, frame):
    """Both ranks stopped with ``line`` (said once, by rank 0), then the user's ``frame``; no rank lost
    contact with the other or crashed; step 1's weights kept, step 2 (which changed nothing) to retry."""
    text = proc.stdout
    assert proc.returncode == 1, text[-4000:]
    said = [x.split("] ", 1)[-1] if x.startswith("[") else x for x in text.splitlines() if "reward error: " in x]
    assert said == [line], text[-4000:]
    assert frame in text and "lost contact" not in text and "Traceback" not in text, text[-4000:]
    assert (out / "checkpoints" / "latest").read_text().strip() == "step-1"
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_reward_failing_on_one_rank_stops_both_with_its_line_and_the_last_good_checkpoint(text_model):
    proc, out = _run(text_model, "text_boom_rank1", [{"function": "text_rewards:boom_on_rank_1_at_step_2"}],
                     launcher=True, trainer={"max_steps": 3})
    _ended_alike(proc, out, "reward error: reward function 'boom_on_rank_1_at_step_2' raised ValueError on a batch "
                 "of 2 completions on rank 1: could not parse the answer of row 7",
                 'text_rewards.py", line 35, in boom_on_rank_1_at_step_2')


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_per_sample_reward_raising_on_one_rank_stops_both_alike(text_model):
    """reward.function takes the batch rewards' path: the healthy rank does not report a lost peer."""
    proc, out = _run(text_model, "sample_boom_rank1", [], launcher=True, trainer={"max_steps": 3},
                     reward={"function": "sample_rewards:raise_on_rank_1_at_step_2"})
    _ended_alike(proc, out, "reward error: reward function 'raise_on_rank_1_at_step_2' raised ValueError on "
                 "completion 0 of a batch of 2 on rank 1: no answer in this completion",
                 'sample_rewards.py", line 10, in _answer')


@pytest.mark.slow
def test_chat_prompts_stop_strings_and_validation_end_to_end(text_model):
    """messages rows through the chat template, a stop string, and validation before training, every
    2 steps and at the end, with eval/accuracy and the completions written as text. The reward is written
    the TRL way (conversational): it raises unless training and validation hand it TRL's format."""
    rows = [{"messages": [{"role": "user", "content": f"w{5 + i} w{6 + i}"}], "answer": f"w{3 + i}"}
            for i in range(4)]
    (text_model / "chats.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    proc, out = _run(text_model, "text_chat", [{"function": "text_rewards:chat_mentions_answer"}],
                     trainer={"max_steps": 3}, data={"prompts": str(text_model / "chats.jsonl")},
                     rollout={"max_new_tokens": 6, "stop": ["w9"]},
                     eval={"data": str(text_model / "chats.jsonl"), "every": 2, "n": 2, "temperature": 1.0})
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    validated = [r for r in records if "eval/accuracy" in r]
    assert [r["step"] for r in validated] == [0, 2, 3]
    for r in validated:
        assert 0.0 <= r["eval/accuracy"] <= r["eval/pass@2"] <= 1.0 and 0.0 <= r["eval/reward_mean"] <= 1.0
    assert all(0.0 <= r["truncated_fraction"] <= 1.0 for r in records if r["step"] > 0)
    written = [json.loads(line) for line in (out / "eval" / "step-3.jsonl").read_text().splitlines()]
    assert [r["index"] for r in written] == [0, 0, 1, 1, 2, 2, 3, 3]
    for r in written:
        # The template wrapped the chat; a completion ends at its first w9, if it has one.
        assert r["prompt"].startswith("w40 ") and r["prompt"].endswith(" w41 w42"), r
        words = r["completion"].split()
        assert "w9" not in words[:-1] and (words[-1:] == ["w9"]) == (r["finish_reason"] == "stop" and
                                                                      "w9" in words), r
        assert r["correct"] == (r["answer"] in r["completion"]) and r["reward"] == float(r["correct"])


def test_a_reward_module_in_the_current_directory_resolves_as_under_the_console_script(tmp_path, monkeypatch):
    import sys

    from fastrlhf.rl.rewards import resolve_reward_function

    (tmp_path / "cwd_reward_mod.py").write_text("def fn(prompts, completions, completion_ids, **kw):\n"
                                                 "    return [1.0] * len(completions)\n")
    monkeypatch.chdir(tmp_path)
    # The console script's sys.path holds neither '' nor the current directory.
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    fn = resolve_reward_function("cwd_reward_mod:fn")
    assert fn(prompts=["a"], completions=["b"], completion_ids=[[1]]) == [1.0]


def test_a_reward_model_with_another_vocabulary_reads_the_text_re_tokenized():
    """Policy word w<i> is id i; the reward model's tokenizer numbers the same words backwards (62 - i)
    and adds a BOS: its scores must equal its own forward on those ids, not on the policy's."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import LlamaForSequenceClassification, PreTrainedTokenizerFast

    from fastrlhf.modeling.tiny import tiny_llama_config
    from fastrlhf.rl.experience import build_experience
    from fastrlhf.rl.forward import reward_model_scores

    def word_tokenizer(mapping, bos=None):
        tok = Tokenizer(models.WordLevel(mapping, unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        if bos is not None:
            tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, mapping[bos])])
        return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token=bos, pad_token="<pad>")

    policy = word_tokenizer({**{f"w{i}": i for i in range(62)}, "<unk>": 62, "<pad>": 63})
    theirs = word_tokenizer({**{f"w{i}": 62 - i for i in range(61)}, "<s>": 0, "<unk>": 1, "<pad>": 63}, bos="<s>")
    torch.manual_seed(0)
    rm = LlamaForSequenceClassification(tiny_llama_config(vocab_size=64, hidden_size=32, num_heads=1,
                                                          num_labels=1)).eval()
    prompts, completions = [[5, 6], [7]], [[9, 10, 11], [12]]
    exp = build_experience(prompts, [[Completion(c, [0.0] * len(c), "stop")] for c in completions], 2)
    scorer = RewardScorer(reward_model=rm, tokenizer=policy, reward_tokenizer=theirs)
    got = scorer(exp, prompts, completions, [{}, {}])

    expected = []
    for p, c in zip(prompts, completions, strict=True):
        one = build_experience([[0] + [62 - t for t in p + c]], [[Completion([], [], "stop")]], 63)
        expected.append(reward_model_scores(rm, one, "classifier"))
    assert torch.allclose(got, torch.cat(expected), atol=1e-5)
    same_vocab = RewardScorer(reward_model=rm)(exp, prompts, completions, [{}, {}])
    assert not torch.allclose(same_vocab, got, atol=1e-3)  # reading the policy's ids would give other scores


def test_a_stopped_completion_is_re_tokenized_with_the_reward_models_eos():
    """`fastrlhf rm` trains a reward model at the EOS after a reply, and a shared vocabulary reads the completion's
    own EOS; re-tokenized text had lost it (skip_special_tokens), so the other vocabulary was read one token early.
    A completion cut at max_new_tokens has no EOS, and gets none."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from fastrlhf.rl.rewards import retokenized

    def word_tokenizer(mapping, eos):
        tok = Tokenizer(models.WordLevel(mapping, unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token=eos, pad_token="<pad>")

    policy = word_tokenizer({**{f"w{i}": i for i in range(60)}, "</s>": 60, "<unk>": 62, "<pad>": 63}, "</s>")
    theirs = word_tokenizer({**{f"w{i}": 61 - i for i in range(60)}, "<eos>": 0, "<unk>": 1, "<pad>": 63}, "<eos>")
    exp = retokenized([[5, 6], [7], [8]], [[9, 60], [12, 13], [60]], policy, theirs, "cpu")
    rows = [[t for t in row if t != 63] for row in exp.input_ids.tolist()]
    assert rows == [[56, 55, 52, 0], [54, 49, 48], [53, 0]]

