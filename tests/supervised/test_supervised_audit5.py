"""SFT and reward-model data in the shapes of the common Hub sets: a chat row that also carries a text prompt
(HuggingFaceH4/ultrachat_200k) is trained as its chat, pairs of whole conversations beside their prompt
(HuggingFaceH4/ultrafeedback_binarized) hold the prompt once, and a tokenizer that fails to load says why."""

import json

import pytest

from fastrlhf.data import DataError, load_pairwise_examples, load_sft_examples

QUESTION = "what is two plus two"
USER = {"role": "user", "content": QUESTION}


def write_rows(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_a_chat_row_with_a_text_prompt_column_is_trained_as_its_chat(chat_tokenizer, tmp_path):
    folder, tokenizer = chat_tokenizer
    chat = [USER, {"role": "assistant", "content": "four"}]
    path = write_rows(
        tmp_path / "s.jsonl",
        [
            {"prompt": QUESTION, "prompt_id": "a1", "messages": chat},  # an ultrachat_200k row
            {"messages": chat},
            {"messages": [USER], "response": "four"},  # a response beside it: the chat is its prompt, as before
        ],
    )
    # Before: "s.jsonl:1: missing field 'response_ids' or 'response'" (the prompt column made it a pair)
    ultrachat, plain, pair = load_sft_examples(path, 128, tokenizer_path=folder)
    assert ultrachat == plain
    assert tokenizer.decode(plain.prompt_ids).count(QUESTION) == 1
    assert pair.prompt_ids == plain.prompt_ids and pair.response_ids == plain.response_ids


def test_whole_conversation_pairs_beside_their_prompt_hold_it_once(chat_tokenizer, tmp_path):
    folder, tokenizer = chat_tokenizer

    def reply(text):
        return [{"role": "assistant", "content": text}]

    path = write_rows(
        tmp_path / "p.jsonl",
        [
            # an ultrafeedback_binarized row: a text prompt, and chats that already open with it
            {
                "prompt": QUESTION,
                "chosen": [USER, *reply("four")],
                "rejected": [USER, *reply("five")],
                "score_chosen": 8.0,
                "score_rejected": 3.0,
            },
            {"chosen": [USER, *reply("four")], "rejected": [USER, *reply("five")]},  # implicit prompt
            {"prompt": [USER], "chosen": reply("four"), "rejected": reply("five")},  # explicit prompt
            {"prompt": QUESTION, "chosen": [USER, *reply("four")], "rejected": reply("five")},  # one of each
            {"prompt": "hello there", "chosen": [USER, *reply("four")], "rejected": reply("five")},
        ],
    )
    with_prompt, implicit, explicit, mixed, other = load_pairwise_examples(path, 256, tokenizer_path=folder)
    scored = tokenizer.decode(with_prompt.prompt_ids + with_prompt.chosen_ids)
    # Before: the question twice, "<|im_start|>user\nwhat is two plus two<|im_end|>\n" repeated
    assert scored.count(QUESTION) == 1, scored
    assert with_prompt == implicit == explicit == mixed
    # A prompt that a side does not open with is the prompt of its reply
    assert tokenizer.decode(other.prompt_ids).startswith("<|im_start|>user\nhello there")


def test_a_tokenizer_that_fails_to_load_says_why(tmp_path):
    from transformers import AutoTokenizer

    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "NoSuchTokenizerFast"}))
    with pytest.raises(Exception) as loading:  # noqa: B017, PT011 -- whatever transformers raises for it
        AutoTokenizer.from_pretrained(str(broken))
    reason = " ".join(str(loading.value).split())[:60]
    assert reason
    path = write_rows(tmp_path / "s.jsonl", [{"prompt": "hi", "response": "there"}])
    with pytest.raises(DataError) as info:
        load_sft_examples(path, 64, tokenizer_path=str(broken))
    (problem,) = info.value.problems
    # Before: "(ValueError)" alone, without transformers' message (which names the class, or the package to install)
    assert f"({type(loading.value).__name__}: {reason}" in problem, problem


def test_text_with_half_a_surrogate_pair_is_a_bad_line_with_its_row(chat_tokenizer, tmp_path):
    """JSON allows a lone ``\\ud83d`` escape (an emoji cut in half); no tokenizer reads the string it makes."""
    folder, _ = chat_tokenizer
    lines = [
        '{"prompt": "hello", "response": "fine"}',
        '{"prompt": "hi \\ud800 there", "response": "x"}',
        '{"messages": [{"role": "user", "content": "a \\udc80"}, {"role": "assistant", "content": "b"}]}',
        '{"prompt": "hello", "response": "cut \\ud83d"}',
    ]
    path = tmp_path / "s.jsonl"
    path.write_text("\n".join(lines) + "\n")
    # Before: a raw TypeError from the fast tokenizer (TextEncodeInput must be Union[...]) naming no row, and no
    # other bad line reported
    with pytest.raises(DataError) as info:
        load_sft_examples(str(path), 64, tokenizer_path=folder)
    assert [p.split(": ", 1)[0] for p in info.value.problems] == ["s.jsonl:2", "s.jsonl:3", "s.jsonl:4"]
    assert "field 'prompt' holds an unpaired surrogate \\ud800 at character 3" in info.value.problems[0]
    assert "field 'messages': message 0's content holds an unpaired surrogate \\udc80" in info.value.problems[1]
    assert "field 'response'" in info.value.problems[2]
    pairs = tmp_path / "p.jsonl"
    pairs.write_text('{"chosen": "ok \\ud83d", "rejected": "no"}\n')
    with pytest.raises(DataError, match=r"p\.jsonl:1: field 'chosen' holds an unpaired surrogate"):
        load_pairwise_examples(str(pairs), 64, tokenizer_path=folder)


def test_a_saved_dataset_dict_reads_its_train_split_or_names_the_splits(tmp_path):
    """``load_dataset(...).save_to_disk(path)`` writes a DatasetDict: a folder of split folders."""
    datasets = pytest.importorskip("datasets")
    from fastrlhf.data import load_prompts

    rows = {"prompt_ids": [[1, 2], [3, 4]], "response_ids": [[5], [6]]}
    datasets.DatasetDict({"train": datasets.Dataset.from_dict(rows)}).save_to_disk(str(tmp_path / "with_train"))
    splits = {"train_sft": datasets.Dataset.from_dict(rows), "test_sft": datasets.Dataset.from_dict(rows)}
    datasets.DatasetDict(splits).save_to_disk(str(tmp_path / "uc"))
    # Before: AttributeError: 'str' object has no attribute 'get' (the split names were read as rows), and for
    # RL prompts "with_train:row 0: missing field 'prompt_ids' or 'prompt' or 'messages'"
    examples = load_sft_examples(str(tmp_path / "with_train"), 64)
    assert [(e.prompt_ids, e.response_ids) for e in examples] == [([1, 2], [5]), ([3, 4], [6])]
    assert [e.prompt_ids for e in load_prompts(str(tmp_path / "with_train"))] == [[1, 2], [3, 4]]
    with pytest.raises(DataError) as info:
        load_sft_examples(str(tmp_path / "uc"), 64)
    assert info.value.problems == [
        "uc: a DatasetDict without a 'train' split (has train_sft, test_sft); give one split's folder, "
        f"e.g. {tmp_path / 'uc' / 'train_sft'}"
    ]
    assert len(load_sft_examples(str(tmp_path / "uc" / "train_sft"), 64)) == 2


def test_trls_prompt_completion_rows_train_the_completion(chat_tokenizer, tmp_path):
    """TRL's prompt-completion datasets, standard (text) and conversational (chats), give the pair fastrlhf's own
    fields give; a language-modelling ``text`` row is a bad line naming what to give instead."""
    folder, tokenizer = chat_tokenizer
    answer = [{"role": "assistant", "content": "four"}]
    path = write_rows(
        tmp_path / "c.jsonl",
        [
            {"prompt": [USER], "completion": answer},  # conversational
            {"messages": [USER, *answer]},
            {"prompt": QUESTION, "completion": "four"},  # standard
            {"prompt": QUESTION, "response": "four"},
        ],
    )
    # Before: "c.jsonl:1: missing field 'response_ids' or 'response'" on both prompt-completion rows
    conversational, chat, standard, pair = load_sft_examples(path, 128, tokenizer_path=folder)
    assert conversational == chat and standard == pair
    assert tokenizer.decode(conversational.response_ids).startswith("four")
    bad = write_rows(tmp_path / "t.jsonl", [{"text": "two"}, {"completion": answer}])
    with pytest.raises(DataError) as e:
        load_sft_examples(bad, 128, tokenizer_path=folder)
    assert "t.jsonl:2: field 'completion' is a chat without its 'prompt'" in str(e.value)


def test_trls_language_modelling_rows_train_every_token_after_the_first(chat_tokenizer, tmp_path):
    """TRL's SFTTrainer reads ``{"text": ...}`` rows (its default dataset_text_field) as language modelling: every
    token trains but the first, with EOS appended and no chat template. They were bad lines."""
    folder, tokenizer = chat_tokenizer
    text = "two plus two is four"
    path = write_rows(tmp_path / "t.jsonl", [{"text": text}, {"text": [5, 6, 7]}, {"text": "", "label": 1}])
    with pytest.raises(DataError) as e:
        load_sft_examples(path, 128, tokenizer_path=folder)
    assert e.value.problems == ["t.jsonl:3: empty text"]
    path = write_rows(tmp_path / "t.jsonl", [{"text": text}, {"text": [5, 6, 7]}])
    words, ids = load_sft_examples(path, 128, tokenizer_path=folder)
    expected = tokenizer(text)["input_ids"] + [tokenizer.eos_token_id]
    assert words.prompt_ids + words.response_ids == expected and len(words.prompt_ids) == 1
    assert (ids.prompt_ids, ids.response_ids) == ([5], [6, 7])  # token ids as given (no EOS added to ids)


def test_rm_data_takes_the_chat_template_kwargs_the_rl_run_renders_with(tmp_path):
    """A Qwen3 RL run with ``enable_thinking: false`` scores completions after an empty think block: the reward
    model's pairs and labelled chats are rendered with the same ``data.chat_template_kwargs`` (before: the RM data
    had none, and always trained on the template's default)."""
    from fastrlhf.config import ConfigError, parse_config
    from fastrlhf.data import load_classification_examples, reading
    from fastrlhf.modeling.tiny_chat import build_chat_tokenizer
    from tests.helpers.episodes_templates import QWEN3
    from tests.helpers.model_folders import fake_model_folder

    tokenizer = build_chat_tokenizer()
    tokenizer.chat_template = QWEN3
    tokenizer.save_pretrained(tmp_path / "tok")
    reply = {"role": "assistant", "content": "four"}
    pairs = write_rows(
        tmp_path / "p.jsonl", [{"prompt": [USER], "chosen": [reply], "rejected": [reply | {"content": "5"}]}]
    )
    labelled = write_rows(tmp_path / "c.jsonl", [{"messages": [USER, reply], "label": 1}])
    off = {"enable_thinking": False}
    try:
        for kwargs in ({}, off):
            (pair,) = load_pairwise_examples(
                pairs, 128, tokenizer_path=str(tmp_path / "tok"), chat_template_kwargs=kwargs
            )
            (row,) = load_classification_examples(
                labelled, 128, 2, tokenizer_path=str(tmp_path / "tok"), chat_template_kwargs=kwargs
            )
            for prompt in (tokenizer.decode(pair.prompt_ids), tokenizer.decode(row.input_ids)):
                assert ("<think>\n\n</think>\n\n" in prompt) == bool(kwargs), prompt
    finally:
        reading._LOADED.clear()
    raw = {
        "output_dir": str(tmp_path / "out"),
        "model": {"path": fake_model_folder(tmp_path / "m")},
        "data": {"path": pairs, "chat_template_kwargs": {"tokenize": True}},
        "trainer": {"max_steps": 1},
    }
    with pytest.raises(ConfigError, match="data.chat_template_kwargs"):
        parse_config(raw, "rm")
    raw["data"]["chat_template_kwargs"] = off
    assert parse_config(raw, "rm").data.chat_template_kwargs == off


@pytest.mark.parametrize("name", ["bert", "llama"])
def test_fastrlhf_rm_scores_an_encoder_as_its_own_forward_does(name):
    """``fastrlhf rm`` trained an encoder (BERT, RoBERTa, DeBERTa: a ``classifier`` head that pools the first token,
    most through a pooler of its own) at its last token without the pooler, which the RL step no longer reads that
    way; a decoder's score head is read at the last token as before."""
    import torch

    from fastrlhf.supervised.reward_model import scores
    from tests.helpers.reward_classifiers import tiny_classifier

    model = tiny_classifier(name)
    sequences = [[5, 6, 7, 8, 9], [10, 11], [12, 13, 14]]
    with torch.no_grad():
        expected = torch.cat([model(input_ids=torch.tensor([s])).logits for s in sequences])
        got = scores(model, sequences, pad_id=0)
    torch.testing.assert_close(got, expected.float(), atol=1e-5, rtol=1e-4)


def test_overlong_sft_and_rm_examples_are_bad_lines_or_left_out_and_counted(tmp_path, capsys):
    """Hub sets hold a few rows over any max_len: a bad line each stopped the run (``data.overlong: error``, the
    default, still does); ``skip`` leaves them out and says how many, as TRL's reward trainer filters its pairs."""
    from fastrlhf.data import load_classification_examples
    from fastrlhf.supervised.reward_model import load_examples as rm_examples

    sft = write_rows(
        tmp_path / "s.jsonl",
        [
            {"prompt_ids": [1, 2], "response_ids": [3]},
            {"prompt_ids": [1, 2], "response_ids": [3, 4, 5, 6]},
            {"prompt_ids": [1, 2, 3, 4], "response_ids": [5]},
        ],
    )
    with pytest.raises(DataError) as e:
        load_sft_examples(sft, 4, max_prompt_len=3)
    assert e.value.problems == [
        "s.jsonl:2: prompt + response of 6 tokens is longer than the limit of 4",
        "s.jsonl:3: prompt of 4 tokens is longer than the limit of 3",
    ]
    assert len(load_sft_examples(sft, 4, max_prompt_len=3, overlong="skip")) == 1
    assert "skipped 2 of 3 rows" in capsys.readouterr().err
    pairs = write_rows(
        tmp_path / "p.jsonl",
        [{"chosen_ids": [1, 2], "rejected_ids": [3]}, {"chosen_ids": [1], "rejected_ids": [3, 4, 5]}],
    )
    labelled = write_rows(
        tmp_path / "c.jsonl",
        [{"input_ids": [1, 2], "label": 0}, {"input_ids": [1, 2, 3], "label": 1}, {"input_ids": [1, 2, 3], "label": 7}],
    )  # a bad label stays a bad line
    assert len(load_pairwise_examples(pairs, 2, overlong="skip")) == 1
    with pytest.raises(DataError, match="c.jsonl:3: label must be an integer in"):
        load_classification_examples(labelled, 2, 2, overlong="skip")
    with pytest.raises(ValueError, match="overlong must be one of error, skip, got 'truncate'"):
        load_pairwise_examples(pairs, 2, overlong="truncate")
    from fastrlhf.config import ConfigError, parse_config
    from tests.helpers.model_folders import fake_model_folder

    raw = {
        "output_dir": str(tmp_path / "out"),
        "model": {"path": fake_model_folder(tmp_path / "m")},
        "data": {"path": pairs, "max_len": 2, "overlong": "skip"},
        "trainer": {"max_steps": 1},
    }
    assert len(rm_examples(parse_config(raw, "rm"))) == 1
    raw["data"]["overlong"] = "truncate"
    with pytest.raises(ConfigError, match="data.overlong"):
        parse_config(raw, "rm")


def test_overlong_sft_examples_are_truncated_as_trl_does_and_counted(tmp_path, capsys):
    """``data.overlong: truncate`` for SFT (there was only error or skip): a prompt over max_prompt_len keeps its end,
    as an RL prompt does; then the example keeps its first max_len tokens (TRL's SFTTrainer, keep_start); one left
    with no trained response token is skipped. Both counts are said."""
    from fastrlhf.data.examples import SFTExample

    sft = write_rows(
        tmp_path / "s.jsonl",
        [
            {"prompt_ids": [1, 2], "response_ids": [3]},  # within both limits: as it is
            {"prompt_ids": [1, 2], "response_ids": [3, 4, 5, 6]},  # the response loses its end
            {"prompt_ids": [1, 2, 3, 4], "response_ids": [5, 6, 7]},  # the prompt its start, the response its end
            {"prompt_ids": [1, 2, 3, 4, 5, 6], "response_ids": [7]},  # without max_prompt_len, no room left: skipped
        ],
    )
    got = load_sft_examples(sft, 5, max_prompt_len=3, overlong="truncate")
    assert got == [SFTExample([1, 2], [3]), SFTExample([1, 2], [3, 4, 5]), SFTExample([2, 3, 4], [5, 6]),
                   SFTExample([4, 5, 6], [7])]
    assert "truncated 3 of 4 examples" in capsys.readouterr().err
    got = load_sft_examples(sft, 5, overlong="truncate")
    assert got == [SFTExample([1, 2], [3]), SFTExample([1, 2], [3, 4, 5]), SFTExample([1, 2, 3, 4], [5])]
    err = capsys.readouterr().err
    assert "truncated 2 of 3 examples" in err and "skipped 1 of 4 rows" in err
