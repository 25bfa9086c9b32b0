import random

import pytest

from fastrlhf.demo import script_doubling as task


def test_vocabulary_and_ids():
    assert len(task.VOCAB) == len(set(task.VOCAB)) == 3 + 10 + 10 + 10 + 9
    assert (task.PAD_ID, task.BOS_ID, task.EOS_ID) == (0, 1, 2)
    assert task.decode(task.encode("S小写:2018x2=四〇三六E")) == "S小写:2018x2=四〇三六E"
    with pytest.raises(ValueError, match="'A'"):
        task.encode("SA")


@pytest.mark.parametrize("prompt, completion", [
    ("S小写:2018x2=", "四〇三六E"),
    ("S数字:3320x2=", "6640E"),
    ("S大写:3164x2=", "陆叁贰捌E"),
    ("S数字:5487x2=", "10974E"),
])
def test_expected_completion(prompt, completion):
    assert task.expected_completion(prompt) == completion


def test_examples_follow_the_format():
    rng = random.Random(0)
    for _ in range(200):
        ex = task.make_example(rng, prefixed=True)
        assert task.expected_completion(ex.prompt) == ex.completion
        assert task.completion_script(ex.completion) == ex.script
        plain = task.make_example(rng, prefixed=False)
        assert plain.prompt.startswith("S__:") and task.expected_completion(plain.prompt) is None
    scripts = {task.make_example(rng, prefixed=False).script for _ in range(100)}
    assert scripts == set(task.SCRIPTS)


@pytest.mark.parametrize("completion, expected_reward", [
    ("四〇三六E", 1.0),
    ("四〇三六", 0.0),        # no E
    ("4036E", 0.0),           # right number, wrong script
    ("肆零叁陆E", 0.0),       # wrong script
    ("四〇三六EE", 0.0),      # extra characters after E
    ("四〇三七E", 0.0),       # wrong number
    ("", 0.0),
])
def test_reward(completion, expected_reward):
    prompt_ids = task.encode("S小写:2018x2=")
    assert task.reward(prompt_ids, task.encode(completion), {}) == expected_reward


def test_reward_of_unprefixed_or_malformed_prompt_is_zero():
    assert task.reward(task.encode("S__:2018x2="), task.encode("四〇三六E")) == 0.0
    assert task.reward(task.encode("S小写:201x2="), task.encode("四〇二E")) == 0.0
    assert task.reward([999], task.encode("四〇三六E")) == 0.0


def test_hf_tokenizer_round_trip(tmp_path):
    from transformers import AutoTokenizer

    task.build_tokenizer().save_pretrained(tmp_path)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    text = "S大写:3164x2=陆叁贰捌E"
    assert tok(text, add_special_tokens=False)["input_ids"] == task.encode(text)
    assert tok.decode(task.encode(text)) == text
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (task.PAD_ID, task.BOS_ID, task.EOS_ID)
    assert len(tok) == len(task.VOCAB)
