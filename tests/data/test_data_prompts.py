"""Prompt data for real tasks: chats through the tokenizer's template, Parquet and ``datasets`` input,
overlong prompts, and the reward columns every row must carry."""

import json

import pytest

from fastrlhf.data import (
    DataError,
    check_columns,
    load_classification_examples,
    load_pairwise_examples,
    load_prompts,
    load_sft_examples,
    report_uneven_columns,
)
from fastrlhf.rl.rewards import required_columns

tokenizers = pytest.importorskip("tokenizers")
transformers = pytest.importorskip("transformers")

TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TEMPLATE_WITH_BOS = "{{ bos_token }}" + TEMPLATE
CORPUS = ["what is two plus two", "the answer is four", "you are a helpful assistant", "hello world"]
CHAT = [{"role": "system", "content": "you are a helpful assistant"},
        {"role": "user", "content": "what is two plus two"}]


def write_lines(path, lines):
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return str(path)


def _tokenizer(template):
    from tokenizers import decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS * 5, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token="<|im_end|>")
    fast.chat_template = template
    return fast


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    """(folder, tokenizer) of a byte-level BPE tokenizer with a Qwen-style chat template."""
    folder = tmp_path_factory.mktemp("chat_tok")
    tokenizer = _tokenizer(TEMPLATE)
    tokenizer.save_pretrained(folder)
    return str(folder), transformers.AutoTokenizer.from_pretrained(str(folder))


@pytest.fixture(scope="module")
def plain_tok(tmp_path_factory):
    """Folder of the same kind of tokenizer without a chat template."""
    folder = tmp_path_factory.mktemp("plain_tok")
    _tokenizer(None).save_pretrained(folder)
    return str(folder)


def template_ids(tokenizer, messages, generation_prompt=True):
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def test_chat_rows_are_the_template_with_the_generation_prompt(tok, tmp_path):
    folder, tokenizer = tok
    expected = template_ids(tokenizer, CHAT)
    assert tokenizer.decode(expected).endswith("<|im_start|>assistant\n")
    path = write_lines(tmp_path / "p.jsonl", [{"messages": CHAT, "answer": "4"}])
    for mode in ("auto", True):
        (example,) = load_prompts(path, "prompt", tokenizer_path=folder, chat_template=mode)
        assert example.prompt_ids == expected
        assert example.meta == {"answer": "4"}  # the chat itself is not a column
        assert example.source == "p.jsonl:1"
    verl = write_lines(tmp_path / "verl.jsonl", [{"prompt": CHAT}])  # verl's form: the chat in the prompt column
    assert load_prompts(verl, "prompt", tokenizer_path=folder)[0].prompt_ids == expected


def test_the_prompt_as_given_rides_beside_the_columns(tok, tmp_path):
    folder, _ = tok
    rows = [{"messages": CHAT, "answer": "4"}, {"prompt": CHAT, "answer": "4"}, {"prompt": "hello world"},
            {"prompt_ids": [7, 8]}, {"messages": [{"role": "user", "content": "hi", "name": None}]}]
    examples = load_prompts(write_lines(tmp_path / "p.jsonl", rows), "prompt", tokenizer_path=folder)
    assert [e.meta.prompt for e in examples] == [CHAT, CHAT, "hello world", None, [{"role": "user", "content": "hi"}]]
    assert [dict(e.meta) for e in examples] == [{"answer": "4"}, {"answer": "4"}, {}, {}, {}]  # not a column
    # data.chat_template true sends text through the template; the prompt as given stays the text.
    templated = load_prompts(write_lines(tmp_path / "t.jsonl", rows[2:3]), "prompt", tokenizer_path=folder,
                             chat_template=True)
    assert templated[0].meta.prompt == "hello world"


def test_uneven_columns_warn_once_per_column_or_fail_with_strict_columns(tmp_path, monkeypatch, capsys):
    rows = [{"prompt_ids": [1], "answer": "4", "kind": "add"}] * 4 + [{"prompt_ids": [2], "anwser": "5"},
                                                                      {"prompt_ids": [3], "answer": None}]
    examples = load_prompts(write_lines(tmp_path / "p.jsonl", rows))
    monkeypatch.setenv("RANK", "0")
    report_uneven_columns(examples)
    assert capsys.readouterr().err.splitlines() == [
        "warning: data: column 'answer' is missing from 1 of 6 rows, first at p.jsonl:5 (data.strict_columns: true "
        "makes this an error)",
        "warning: data: column 'kind' is missing from 2 of 6 rows, first at p.jsonl:5 (data.strict_columns: true "
        "makes this an error)",
        "warning: data: column 'anwser' is missing from 5 of 6 rows, first at p.jsonl:1 (data.strict_columns: true "
        "makes this an error)"]  # a null answer is an answer the row gives: only line 5 lacks one
    monkeypatch.setenv("RANK", "1")
    report_uneven_columns(examples)
    assert capsys.readouterr().err == ""  # only rank 0 says it
    with pytest.raises(DataError) as info:
        report_uneven_columns(examples, strict=True)  # every rank stops
    assert info.value.problems[0] == ("column 'answer' is missing from 1 of 6 rows, first at p.jsonl:5 "
                                      "(data.strict_columns is true)") and len(info.value.problems) == 3
    even = load_prompts(write_lines(tmp_path / "e.jsonl", rows[:4]))
    report_uneven_columns(even, strict=True)
    monkeypatch.setenv("RANK", "0")
    report_uneven_columns(even)
    assert capsys.readouterr().err == ""


def test_template_with_bos_matches_apply_chat_template(tmp_path):
    folder = tmp_path / "bos_tok"
    tokenizer = _tokenizer(TEMPLATE_WITH_BOS)
    tokenizer.save_pretrained(folder)
    expected = template_ids(tokenizer, CHAT)
    assert expected[0] == tokenizer.bos_token_id and expected.count(tokenizer.bos_token_id) == 1
    path = write_lines(tmp_path / "p.jsonl", [{"messages": CHAT}])
    assert load_prompts(path, tokenizer_path=str(folder))[0].prompt_ids == expected


def test_text_rows_templated_only_with_true(tok, tmp_path):
    folder, tokenizer = tok
    text = "what is two plus two"
    raw = tokenizer(text)["input_ids"]
    path = write_lines(tmp_path / "p.jsonl", [{"prompt": text}, {"prompt_ids": [5, 6]}])
    for mode in ("auto", False):
        examples = load_prompts(path, "prompt", tokenizer_path=folder, chat_template=mode)
        assert [e.prompt_ids for e in examples] == [raw, [5, 6]]
    examples = load_prompts(path, "prompt", tokenizer_path=folder, chat_template=True)
    assert examples[0].prompt_ids == template_ids(tokenizer, [{"role": "user", "content": text}]) != raw
    assert examples[1].prompt_ids == [5, 6]  # ids are never templated


def test_chat_with_template_off_or_missing_is_a_bad_line(tok, plain_tok, tmp_path):
    folder, _ = tok
    path = write_lines(tmp_path / "p.jsonl", [{"prompt_ids": [1]}, {"messages": CHAT}])
    with pytest.raises(DataError) as info:
        load_prompts(path, tokenizer_path=folder, chat_template=False)
    assert info.value.problems == ["p.jsonl:2: field 'messages' is a chat but data.chat_template is false; "
                                   "set data.chat_template to true or auto"]
    with pytest.raises(DataError, match=r"p\.jsonl:2: field 'messages' needs a tokenizer with a chat template"):
        load_prompts(path, tokenizer_path=plain_tok)
    with pytest.raises(DataError, match=r"p\.jsonl:2: field 'messages' needs a tokenizer with a chat template "
                                        r"\(no tokenizer is configured\)"):
        load_prompts(path)
    text = write_lines(tmp_path / "t.jsonl", [{"prompt": "hello"}])
    with pytest.raises(DataError, match=r"t\.jsonl:1: field 'prompt' needs a tokenizer with a chat template "
                                        r"\(data\.chat_template is true\)"):
        load_prompts(text, tokenizer_path=plain_tok, chat_template=True)


@pytest.mark.parametrize("messages, phrase", [
    ([], "field 'messages' must be a non-empty list"),
    ("hi", "field 'messages' must be a non-empty list"),
    ([{"role": "user"}], "field 'messages': message 0 must be an object with text 'role' and 'content'"),
    ([{"role": "user", "content": "a"}, {"role": 1, "content": "b"}], "field 'messages': message 1"),
    ([{"role": "user", "content": "a"}, "b"], "field 'messages': message 1"),
])
def test_bad_chat_shapes_name_the_field(tok, tmp_path, messages, phrase):
    path = write_lines(tmp_path / "p.jsonl", [{"prompt_ids": [1]}, {"messages": messages}])
    with pytest.raises(DataError) as info:
        load_prompts(path, tokenizer_path=tok[0])
    assert len(info.value.problems) == 1 and info.value.problems[0].startswith(f"p.jsonl:2: {phrase}")


def test_unknown_modes_are_refused(tmp_path):
    path = write_lines(tmp_path / "p.jsonl", [{"prompt_ids": [1]}])
    with pytest.raises(ValueError, match="chat_template"):
        load_prompts(path, chat_template="yes")
    with pytest.raises(ValueError, match="overlong"):
        load_prompts(path, overlong="drop")


ROWS = [
    {"messages": CHAT, "answer": "4", "data_source": "math"},
    {"prompt": "hello world", "answer": "hi", "data_source": "chat"},
    {"prompt_ids": [7, 8, 9], "answer": "x", "data_source": "ids"},
]


def _as_tuples(examples):
    return [(e.prompt_ids, {k: v for k, v in e.meta.items() if v is not None}) for e in examples]


def test_parquet_and_datasets_folder_give_the_jsonl_examples(tok, tmp_path):
    pd = pytest.importorskip("pandas")
    pytest.importorskip("pyarrow")
    datasets = pytest.importorskip("datasets")
    folder, _ = tok
    from_jsonl = load_prompts(write_lines(tmp_path / "p.jsonl", ROWS), "prompt", tokenizer_path=folder)
    pd.DataFrame(ROWS).to_parquet(str(tmp_path / "p.parquet"))
    from_parquet = load_prompts(str(tmp_path / "p.parquet"), "prompt", tokenizer_path=folder)
    datasets.Dataset.from_pandas(pd.DataFrame(ROWS), preserve_index=False).save_to_disk(str(tmp_path / "ds"))
    from_folder = load_prompts(str(tmp_path / "ds"), "prompt", tokenizer_path=folder)
    # Columnar formats give every row every column (null where a row had none): the same examples otherwise.
    assert _as_tuples(from_parquet) == _as_tuples(from_folder) == _as_tuples(from_jsonl)
    assert "messages" not in from_parquet[0].meta and "prompt" not in from_parquet[0].meta
    assert [e.source for e in from_parquet] == ["p.parquet:row 0", "p.parquet:row 1", "p.parquet:row 2"]
    assert [type(t) for t in from_parquet[2].prompt_ids] == [int] * 3

    pd.DataFrame([{"prompt_ids": [1, 2]}, {"prompt_ids": []}]).to_parquet(str(tmp_path / "bad.parquet"))
    with pytest.raises(DataError, match=r"bad\.parquet:row 1: empty prompt"):
        load_prompts(str(tmp_path / "bad.parquet"))
    (tmp_path / "junk.parquet").write_text("not parquet")
    with pytest.raises(DataError, match=r"junk\.parquet: not a readable Parquet file"):
        load_prompts(str(tmp_path / "junk.parquet"))


def test_numpy_values_pass_validation(tok, tmp_path):
    pytest.importorskip("numpy")
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_list([{"prompt_ids": [3, 4], "messages": None}, {"prompt_ids": None, "messages": CHAT}]) \
        .with_format("numpy").save_to_disk(str(tmp_path / "np"))
    examples = load_prompts(str(tmp_path / "np"), tokenizer_path=tok[0])
    assert examples[0].prompt_ids == [3, 4] and examples[1].prompt_ids == template_ids(tok[1], CHAT)


def test_overlong_error_truncate_skip(tok, tmp_path, monkeypatch, capsys):
    lines = [{"prompt_ids": [1, 2, 3]}, {"prompt_ids": [1, 2, 3, 4, 5, 6]}, {"prompt_ids": [9, 8, 7, 6, 5]}]
    path = write_lines(tmp_path / "p.jsonl", lines)
    with pytest.raises(DataError) as info:
        load_prompts(path, max_prompt_len=4)
    assert info.value.problems == ["p.jsonl:2: prompt of 6 tokens is longer than the limit of 4",
                                   "p.jsonl:3: prompt of 5 tokens is longer than the limit of 4"]

    truncated = load_prompts(path, max_prompt_len=4, overlong="truncate")
    assert [e.prompt_ids for e in truncated] == [[1, 2, 3], [3, 4, 5, 6], [8, 7, 6, 5]]  # the last tokens

    monkeypatch.setenv("RANK", "0")
    kept = load_prompts(path, max_prompt_len=4, overlong="skip")
    assert [(e.prompt_ids, e.source) for e in kept] == [([1, 2, 3], "p.jsonl:1")]
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "skipped 2 of 3 rows of" in err and "p.jsonl" in err and "max_prompt_len" in err
    monkeypatch.setenv("RANK", "1")
    load_prompts(path, max_prompt_len=4, overlong="skip")
    assert capsys.readouterr().err == ""  # only rank 0 says it
    all_skipped = r"p\.jsonl: no examples: all 3 rows were skipped as longer than max_prompt_len \(2 tokens\)"
    with pytest.raises(DataError, match=all_skipped):
        load_prompts(path, max_prompt_len=2, overlong="skip")
    bad = write_lines(tmp_path / "b.jsonl", [{"prompt_ids": list(range(9))}, {"prompt_ids": []}])
    with pytest.raises(DataError, match=r"b\.jsonl:2: empty prompt"):  # skipping never hides a bad line
        load_prompts(bad, max_prompt_len=4, overlong="skip")


def test_truncate_keeps_the_generation_prompt(tok, tmp_path):
    folder, tokenizer = tok
    full = template_ids(tokenizer, CHAT)
    path = write_lines(tmp_path / "p.jsonl", [{"messages": CHAT}])
    (example,) = load_prompts(path, tokenizer_path=folder, max_prompt_len=len(full) - 3, overlong="truncate")
    assert example.prompt_ids == full[3:] and tokenizer.decode(example.prompt_ids).endswith("<|im_start|>assistant\n")


def test_sft_chat_rows(tok, plain_tok, tmp_path):
    folder, tokenizer = tok
    chat = CHAT + [{"role": "assistant", "content": "the answer is four"}]
    path = write_lines(tmp_path / "s.jsonl", [{"messages": chat}, {"prompt": "hello", "response": "world"}])
    examples = load_sft_examples(path, max_len=128, tokenizer_path=folder)
    assert examples[0].prompt_ids == template_ids(tokenizer, CHAT)
    assert examples[0].response_ids == tokenizer("the answer is four", add_special_tokens=False)["input_ids"] + [
        tokenizer.eos_token_id]
    assert examples[1].prompt_ids == tokenizer("hello")["input_ids"]  # text prompts as before under auto
    templated = load_sft_examples(path, max_len=128, tokenizer_path=folder, chat_template=True)
    assert templated[1].prompt_ids == template_ids(tokenizer, [{"role": "user", "content": "hello"}])
    assert templated[1].response_ids == examples[1].response_ids

    bad = write_lines(tmp_path / "b.jsonl", [{"messages": CHAT}, {"messages": chat[-1:]}, {"messages": chat}])
    with pytest.raises(DataError) as info:
        load_sft_examples(bad, max_len=128, tokenizer_path=folder)
    assert [p.split(": ", 1)[0] for p in info.value.problems] == ["b.jsonl:1", "b.jsonl:2"]
    assert "must end with an assistant message" in info.value.problems[0]
    with pytest.raises(DataError, match=r"s\.jsonl:1: field 'messages' is a chat but data\.chat_template is false"):
        load_sft_examples(path, max_len=128, tokenizer_path=folder, chat_template=False)
    with pytest.raises(DataError, match=r"s\.jsonl:1: field 'messages' needs a tokenizer with a chat template"):
        load_sft_examples(path, max_len=128, tokenizer_path=plain_tok)


# A tool episode: the call, the tool's result, the answer after it.
EPISODE = CHAT + [{"role": "assistant", "content": "hello world"}, {"role": "tool", "content": "four"},
                  {"role": "assistant", "content": "the answer is four"}]


def test_sft_chat_trains_every_assistant_turn_in_its_context(tok, tmp_path):
    folder, tokenizer = tok
    path = write_lines(tmp_path / "s.jsonl", [{"messages": EPISODE}])
    (last,) = load_sft_examples(path, max_len=256, tokenizer_path=folder)
    (every,) = load_sft_examples(path, max_len=256, tokenizer_path=folder, assistant_turns="all")

    def reply(text):
        return tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]

    # last: every earlier turn is prompt, as before.
    assert last.prompt_ids == template_ids(tokenizer, EPISODE[:4]) and last.response_ids == reply(EPISODE[4]["content"])
    assert last.response_mask is None
    # all: the first reply follows the first context; the whole sequence ends as the last turn's does.
    assert every.prompt_ids == template_ids(tokenizer, CHAT)
    assert every.prompt_ids + every.response_ids == last.prompt_ids + last.response_ids
    trained = [t for t, m in zip(every.response_ids, every.response_mask, strict=True) if m]
    read = [t for t, m in zip(every.response_ids, every.response_mask, strict=True) if not m]
    assert trained == reply("hello world") + reply("the answer is four")
    assert tokenizer.decode(read) == "\n<|im_start|>tool\nfour<|im_end|>\n<|im_start|>assistant\n"
    assert every.response_mask[:len(reply("hello world"))] == [1] * len(reply("hello world"))
    # One assistant turn: the same example either way.
    single = write_lines(tmp_path / "one.jsonl", [{"messages": EPISODE[:3]}])
    assert load_sft_examples(single, max_len=256, tokenizer_path=folder, assistant_turns="all") == \
        load_sft_examples(single, max_len=256, tokenizer_path=folder)


def test_sft_chat_turns_refuse_a_template_that_rewrites_earlier_turns(tmp_path):
    # Like templates that drop past reasoning: an earlier assistant turn renders differently as context.
    rewriting = TEMPLATE.replace("{{ m['content'] }}", "{{ m['content'] if m['role'] != 'assistant' or loop.last "
                                                       "else '...' }}")
    folder = tmp_path / "tok"
    _tokenizer(rewriting).save_pretrained(folder)
    path = write_lines(tmp_path / "s.jsonl", [{"messages": EPISODE}, {"messages": EPISODE[:3]}])
    with pytest.raises(DataError) as info:
        load_sft_examples(path, max_len=256, tokenizer_path=str(folder), assistant_turns="all")
    assert len(info.value.problems) == 1 and info.value.problems[0].startswith("s.jsonl:1: the chat template renders "
                                                                               "the turns before message 4 differently")
    assert "set data.assistant_turns to last" in info.value.problems[0]
    assert len(load_sft_examples(path, max_len=256, tokenizer_path=str(folder))) == 2
    with pytest.raises(ValueError, match="assistant_turns must be one of last, all, got 'every'"):
        load_sft_examples(path, max_len=256, tokenizer_path=str(folder), assistant_turns="every")


def test_preference_pairs_in_trls_conversational_form(tok, tmp_path):
    folder, tokenizer = tok
    good, bad = ({"role": "assistant", "content": "the answer is four"},
                 {"role": "assistant", "content": "hello world"})

    def reply(message):
        return tokenizer(message["content"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]

    rows = [{"prompt": CHAT, "chosen": [good], "rejected": [bad]},  # explicit prompt
            {"chosen": CHAT + [good], "rejected": CHAT + [bad]},  # implicit: whole conversations
            {"prompt": CHAT[1]["content"], "chosen": [good], "rejected": [bad]}]  # a text prompt: one user message
    explicit, implicit, text = load_pairwise_examples(write_lines(tmp_path / "p.jsonl", rows), 256,
                                                      tokenizer_path=folder)
    # Scored as RL scores a completion: the reply and EOS after the template's generation prompt.
    assert explicit.prompt_ids + explicit.chosen_ids == template_ids(tokenizer, CHAT) + reply(good)
    assert explicit.prompt_ids + explicit.rejected_ids == template_ids(tokenizer, CHAT) + reply(bad)
    assert explicit.prompt_ids == template_ids(tokenizer, CHAT)  # the tokens both sides share
    assert implicit == explicit
    assert text.prompt_ids + text.chosen_ids == template_ids(tokenizer, CHAT[1:]) + reply(good)

    lines = [{"prompt": CHAT, "chosen": [good], "rejected": "hello world"}, {"chosen": [good], "rejected": [bad]}]
    with pytest.raises(DataError) as info:
        load_pairwise_examples(write_lines(tmp_path / "b.jsonl", lines), 256, tokenizer_path=folder)
    assert info.value.problems == [
        "b.jsonl:1: field 'rejected' must be a chat like the other side's, got 'hello world'",
        "b.jsonl:2: field 'chosen' must end with an assistant message (the response) after at least one other "
        "message, got roles ['assistant']"]


def test_classification_rows_may_be_chats(tok, tmp_path):
    folder, tokenizer = tok
    answered = CHAT + [{"role": "assistant", "content": "the answer is four"}]
    path = write_lines(tmp_path / "c.jsonl", [{"messages": answered, "label": 1}, {"text": CHAT, "label": 0},
                                               {"text": "hello world", "label": 1}])
    reply, asked, plain = load_classification_examples(path, 256, 2, tokenizer_path=folder)
    assert reply.input_ids == template_ids(tokenizer, CHAT) + tokenizer(
        "the answer is four", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    # A chat that ends with the user: the template as it is, no generation prompt.
    assert asked.input_ids == template_ids(tokenizer, CHAT, generation_prompt=False)
    assert tokenizer.decode(asked.input_ids).endswith("what is two plus two<|im_end|>\n")
    assert (reply.label, asked.label, plain.label) == (1, 0, 1)
    assert plain.input_ids == tokenizer("hello world")["input_ids"]


def test_required_columns():
    def plain(prompts, completions, completion_ids, answer, **kwargs):
        pass

    def keyword_only(prompts, completions, *, answer, tests, lang="py"):
        pass

    def defaults(prompts, completions, answer=None, *args, **kwargs):
        pass

    class Scorer:
        def __call__(self, prompts, completions, completion_ids, ground_truth, **columns):
            pass

    assert required_columns(plain) == ["answer"]
    assert required_columns(keyword_only) == ["answer", "tests"]
    assert required_columns(defaults) == []
    assert required_columns(Scorer()) == ["ground_truth"]
    assert required_columns(lambda prompts, completions, **kw: None) == []


def test_check_columns_names_each_row(tmp_path):
    path = write_lines(tmp_path / "p.jsonl", [{"prompt_ids": [1], "answer": "4"}, {"prompt_ids": [2]},
                                             {"prompt_ids": [3], "answer": None},
                                             {"prompt_ids": [4], "meta": {"answer": 1}}])
    examples = load_prompts(path)
    check_columns(examples, {"accuracy": []})
    with pytest.raises(DataError) as info:
        check_columns(examples, {"accuracy": ["answer"], "fmt": []})
    # a null answer is a column the function receives (as None); only a row without it is bad
    assert info.value.problems == ["p.jsonl:2: reward function 'accuracy' needs column 'answer', which this row lacks"]
    with pytest.raises(DataError) as info:
        check_columns(examples, {"code": ["tests"]})
    assert len(info.value.problems) == 4 and "(4 bad lines in all)" in str(info.value)


def test_config_fields(tmp_path):
    from helpers.model_folders import fake_model_folder

    from fastrlhf.config import ConfigError, parse_config

    fake_model_folder(tmp_path / "model")
    prompts = write_lines(tmp_path / "p.jsonl", [{"prompt_ids": [1]}])

    def train(reward=None, **data):
        return {"algorithm": "grpo", "output_dir": str(tmp_path / "out"), "model": {"path": str(tmp_path / "model")},
                "reward": reward or {"function": "length"}, "data": {"prompts": prompts, **data},
                "rollout": {"n": 4}, "trainer": {"max_steps": 1, "prompts_per_step": 4, "minibatch_size": 8}}

    config = parse_config(train(), on_gpu=False)
    assert config.data.chat_template == "auto" and config.data.overlong == "error"
    assert config.data.strict_columns is False and config.reward.format == "trl"
    for value in (True, False, "auto"):
        got = parse_config(train(chat_template=value), on_gpu=False).data.chat_template
        assert got == value and type(got) is type(value)
    assert parse_config(train(overlong="skip"), on_gpu=False).data.overlong == "skip"
    assert parse_config(train(strict_columns=True), on_gpu=False).data.strict_columns is True
    with pytest.raises(ConfigError, match="data.chat_template"):
        parse_config(train(chat_template="yes"), on_gpu=False)
    with pytest.raises(ConfigError, match="data.overlong"):
        parse_config(train(overlong="drop"), on_gpu=False)
    with pytest.raises(ConfigError, match="data.strict_columns: expected true or false, got 'yes'"):
        parse_config(train(strict_columns="yes"), on_gpu=False)

    functions = [{"function": "my_rewards:fn"}]
    assert parse_config(train({"functions": functions, "format": "text"}), on_gpu=False).reward.format == "text"
    with pytest.raises(ConfigError, match=r"reward\.format: expected one of 'trl' \| 'text', got 'chat'"):
        parse_config(train({"functions": functions, "format": "chat"}), on_gpu=False)
    with pytest.raises(ConfigError) as info:  # a setting that would change nothing
        parse_config(train({"function": "length", "format": "text"}), on_gpu=False)
    assert str(info.value).startswith("reward.format: text is the form of what reward.functions receive")

    sft = {"output_dir": str(tmp_path / "out"), "model": {"path": str(tmp_path / "model")},
           "data": {"path": prompts, "chat_template": True}, "trainer": {"max_steps": 1}}
    assert parse_config(sft, "sft", on_gpu=False).data.chat_template is True
