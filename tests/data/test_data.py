"""Data loading: every bad line reported with its number, before any training; resumable sampling."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fastrlhf.data import (
    DataError,
    EpochSampler,
    balanced_shard,
    load_classification_examples,
    load_pairwise_examples,
    load_prompts,
    load_sft_examples,
    shard,
)


def write_lines(path, lines):
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return str(path)


def test_prompts_ok(tmp_path):
    path = write_lines(tmp_path / "prompts.jsonl", [{"prompt_ids": [5, 6], "meta": {"answer": 3}}, "",
                                                     {"prompt_ids": [7]}])
    examples = load_prompts(path, max_prompt_len=4, vocab_size=10)
    assert [e.prompt_ids for e in examples] == [[5, 6], [7]]
    assert examples[0].meta == {"answer": 3} and examples[1].meta == {}


def test_a_cut_line_is_reported_at_its_own_end(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt_ids": [1, 2]}\n{"prompt_ids": [1, 2,\r\n')
    with pytest.raises(DataError) as info:
        load_prompts(str(path), max_prompt_len=8, vocab_size=50)
    assert info.value.problems == ["prompts.jsonl:2: invalid JSON (Expecting value at column 22)"]


def test_all_bad_lines_reported_with_numbers(tmp_path):
    lines = [
        {"prompt_ids": [1, 2]},             # 1 ok
        "{not json",                        # 2
        {"text": [1]},                      # 3 missing field
        {"prompt_ids": []},                 # 4 empty
        {"prompt_ids": list(range(9))},     # 5 too long
        {"prompt_ids": [3, 99]},            # 6 out of vocab
        {"prompt_ids": [1, "a"]},           # 7 wrong type
        [1, 2],                             # 8 not an object
        {"prompt_ids": [1], "meta": 5},     # 9 bad meta
    ]
    path = write_lines(tmp_path / "prompts.jsonl", lines)
    with pytest.raises(DataError) as info:
        load_prompts(path, max_prompt_len=8, vocab_size=50)
    problems = info.value.problems
    assert len(problems) == 8
    text = str(info.value)
    assert "prompts.jsonl:2: invalid JSON" in text
    assert "prompts.jsonl:3: missing field 'prompt_ids' or 'prompt'" in text
    assert "prompts.jsonl:4: empty prompt" in text
    assert "prompts.jsonl:5: prompt of 9 tokens is longer than the limit of 8" in text
    assert "prompts.jsonl:6: token id 99 in prompt is outside the vocabulary [0, 50)" in text
    assert "prompts.jsonl:7: field 'prompt_ids' must be text or a list of token ids" in text
    assert "prompts.jsonl:8: expected a JSON object" in text
    assert "prompts.jsonl:9: field 'meta' must be an object" in text


def test_many_bad_lines_are_summarised(tmp_path):
    path = write_lines(tmp_path / "p.jsonl", [{"prompt_ids": []}] * 25)
    with pytest.raises(DataError) as info:
        load_prompts(path)
    text = str(info.value)
    assert text.count("empty prompt") == 10 and "and 15 more bad lines (25 in all)" in text
    assert "p.jsonl:25: empty prompt" in info.value.problems[-1]


def test_text_without_tokenizer_is_a_bad_line(tmp_path):
    path = write_lines(tmp_path / "p.jsonl", [{"prompt": "hello"}])
    with pytest.raises(DataError, match=r"p\.jsonl:1: text field given but .* has no usable tokenizer"):
        load_prompts(path, tokenizer_path=str(tmp_path))


def test_text_prompts_use_the_model_tokenizer(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "[EOS]": 1, "hello": 2, "world": 3}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="[EOS]", unk_token="[UNK]").save_pretrained(tmp_path)
    path = write_lines(tmp_path / "p.jsonl", [{"prompt": "hello world"}])
    assert load_prompts(path, prompt_field="prompt", tokenizer_path=str(tmp_path))[0].prompt_ids == [2, 3]
    sft = write_lines(tmp_path / "s.jsonl", [{"prompt": "hello", "response": "world"}])
    example = load_sft_examples(sft, max_len=8, tokenizer_path=str(tmp_path))[0]
    assert example.prompt_ids == [2] and example.response_ids == [3, 1]  # response ends with EOS


def test_sft_pairs_and_classifier_validation(tmp_path):
    sft = write_lines(tmp_path / "sft.jsonl", [{"prompt_ids": [1], "response_ids": [2, 3]},
                                               {"prompt_ids": [1]},
                                               {"prompt_ids": [1, 2, 3], "response_ids": [4, 5, 6]}])
    with pytest.raises(DataError) as info:
        load_sft_examples(sft, max_len=5)
    assert info.value.problems == ["sft.jsonl:2: missing field 'response_ids' or 'response' or 'completion'",
                                   "sft.jsonl:3: prompt + response of 6 tokens is longer than the limit of 5"]

    pairs = write_lines(tmp_path / "pairs.jsonl", [{"prompt_ids": [1], "chosen_ids": [2], "rejected_ids": [3]},
                                                   {"chosen_ids": [2], "rejected_ids": []}])
    with pytest.raises(DataError, match=r"pairs\.jsonl:2: empty rejected"):
        load_pairwise_examples(pairs, max_len=8)

    cls = write_lines(tmp_path / "cls.jsonl", [{"input_ids": [1, 2], "label": 1}, {"input_ids": [1], "label": 2},
                                               {"input_ids": [1], "label": True}, {"input_ids": [1]}])
    with pytest.raises(DataError) as info:
        load_classification_examples(cls, max_len=8, num_labels=2)
    assert [p.split(":")[1] for p in info.value.problems] == ["2", "3", "4"]


@pytest.mark.parametrize("load, good", [
    (lambda p: load_prompts(p, vocab_size=10), b'{"prompt_ids": [1]}'),
    (lambda p: load_sft_examples(p, max_len=8), b'{"prompt_ids": [1], "response_ids": [2]}'),
    (lambda p: load_pairwise_examples(p, max_len=8), b'{"chosen_ids": [1], "rejected_ids": [2]}'),
    (lambda p: load_classification_examples(p, max_len=8, num_labels=2), b'{"input_ids": [1], "label": 0}'),
])
def test_a_line_that_is_not_utf8_is_a_bad_line_among_the_others(tmp_path, load, good):
    path = tmp_path / "d.jsonl"
    path.write_bytes(good + b'\n{"prompt": "caf\xe9", "x": "\xff"}\r\n{not json\n' + good + b"\n")
    with pytest.raises(DataError) as info:
        load(str(path))
    assert info.value.problems == ["d.jsonl:2: not valid UTF-8 (byte 0xe9 at column 16)",
                                   "d.jsonl:3: invalid JSON (Expecting property name enclosed in double quotes at "
                                   "column 2)"]


def test_empty_file_is_an_error(tmp_path):
    with pytest.raises(DataError, match="no examples"):
        load_prompts(write_lines(tmp_path / "e.jsonl", []))


def test_datasets_folder(tmp_path):
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_list([{"prompt_ids": [1, 2]}, {"prompt_ids": []}]).save_to_disk(str(tmp_path / "ds"))
    with pytest.raises(DataError, match=r"ds:row 1: empty prompt"):
        load_prompts(str(tmp_path / "ds"))
    datasets.Dataset.from_list([{"prompt_ids": [1, 2]}]).save_to_disk(str(tmp_path / "ok"))
    assert load_prompts(str(tmp_path / "ok"))[0].prompt_ids == [1, 2]


def test_sampler_covers_each_epoch_and_resumes_exactly():
    sampler = EpochSampler(10, seed=3)
    first = sampler.next_indices(4) + sampler.next_indices(6)
    assert sorted(first) == list(range(10))
    state = sampler.state_dict()
    expected = sampler.next_indices(7) + sampler.next_indices(7)
    resumed = EpochSampler(10, seed=3)
    resumed.load_state_dict(state)
    assert resumed.next_indices(7) + resumed.next_indices(7) == expected
    assert sorted(expected[:10]) == list(range(10))  # a full epoch, reshuffled
    with pytest.raises(ValueError, match="same data"):
        EpochSampler(11).load_state_dict(state)


def test_shard():
    assert shard(list(range(8)), 1, 2) == [4, 5, 6, 7]
    with pytest.raises(ValueError):
        shard([1, 2, 3], 0, 2)


def test_balanced_shard_evens_out_the_ranks_tokens():
    # Workload C's prompt set 2: a contiguous slice gives rank 0 both long prompts (469 tokens against 69).
    lengths = [236, 233, 30, 39]
    items = ["a", "b", "c", "d"]
    deal = [balanced_shard(items, lengths, r, 2) for r in range(2)]
    assert deal == [["a", "c"], ["b", "d"]]  # 266 and 272 tokens; sampled order kept within a rank
    assert balanced_shard(items, lengths, 0, 1) == items
    # Where the deal lowers nothing, the contiguous slices stay (equal lengths, or already even slices).
    assert [balanced_shard(items, [11] * 4, r, 2) for r in range(2)] == [["a", "b"], ["c", "d"]]
    assert [balanced_shard(items, [236, 30, 233, 39], r, 2) for r in range(2)] == [["a", "b"], ["c", "d"]]
    with pytest.raises(ValueError, match="split evenly"):
        balanced_shard(items[:3], lengths[:3], 0, 2)
    with pytest.raises(ValueError, match="lengths"):
        balanced_shard(items, lengths[:3], 0, 2)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 4).flatmap(lambda world: st.tuples(
    st.just(world), st.lists(st.integers(0, 500), min_size=world, max_size=6 * world).map(
        lambda xs: xs[:len(xs) - len(xs) % world]))))
def test_balanced_shard_is_an_even_partition(case):
    world, lengths = case
    items = list(range(len(lengths)))
    deal = [balanced_shard(items, lengths, r, world) for r in range(world)]
    assert sorted(i for part in deal for i in part) == items  # every item on exactly one rank
    assert {len(part) for part in deal} == {len(items) // world}
    assert all(part == sorted(part) for part in deal)
    sums = [sum(lengths[i] for i in part) for part in deal]
    per = len(items) // world
    assert max(sums) <= max(sum(lengths[r * per:(r + 1) * per]) for r in range(world))  # never worse than slices
    # Longest-first dealing: the fullest rank exceeds the mean by at most the longest item.
    assert max(sums) - sum(lengths) / world <= max(lengths)
