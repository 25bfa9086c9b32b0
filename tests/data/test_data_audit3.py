"""Audit 3 of fastrlhf.data: data that differs between nodes, and the edges of reading rows."""

import json
import os
import socket
import sys

import pytest

from fastrlhf.data import DataError, check_same_data, load_prompts, reading
from fastrlhf.distributed import comm
from tests.helpers.launch import start_group, wait_groups


def write_lines(path, lines):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return str(path)


def fake_world(monkeypatch, others):
    """A world of ``1 + len(others)`` ranks where this is rank 0 and rank r+1 loaded ``others[r]``."""
    monkeypatch.setattr(comm, "is_distributed", lambda: True)

    def gather(data):
        return [data] + [json.dumps({"loaded": o, "where": f"rank {r + 1}"}).encode() for r, o in enumerate(others)]

    monkeypatch.setattr(comm, "gather_bytes", gather)


def loaded_by(*paths):
    """What another rank that loaded ``paths`` would post (and nothing left behind for this one)."""
    reading._LOADED.clear()
    for path in paths:
        load_prompts(path)
    loaded = [list(entry) for entry in reading._LOADED]
    reading._LOADED.clear()
    return loaded


def test_same_data_on_every_rank_passes(tmp_path, monkeypatch):
    path = write_lines(tmp_path / "prompts.jsonl", [{"prompt_ids": [1, 2]}, {"prompt_ids": [3]}])
    mine = loaded_by(path)
    # A blank line moves the rows' line numbers but not what they train on
    same = loaded_by(write_lines(tmp_path / "b" / "prompts.jsonl", ["", {"prompt_ids": [1, 2]}, {"prompt_ids": [3]}]))
    fake_world(monkeypatch, [mine, same])
    load_prompts(path)
    check_same_data()
    assert reading._LOADED == []  # checked once


@pytest.mark.parametrize(
    "other_rows",
    [
        [{"prompt_ids": [1, 2]}],  # a partial copy: fewer rows
        [{"prompt_ids": [1, 2]}, {"prompt_ids": [4]}],  # another version: as many rows, one differs
        [{"prompt_ids": [1, 2]}, {"prompt_ids": [3], "answer": "7"}],  # a column differs (rewards read it)
    ],
)
def test_data_that_differs_between_ranks_fails_naming_the_file_and_ranks(tmp_path, monkeypatch, other_rows):
    other = loaded_by(write_lines(tmp_path / "node1" / "prompts.jsonl", other_rows))
    path = write_lines(tmp_path / "prompts.jsonl", [{"prompt_ids": [1, 2]}, {"prompt_ids": [3]}])
    fake_world(monkeypatch, [other, other])
    load_prompts(path)
    with pytest.raises(DataError) as info:
        check_same_data()
    message = str(info.value)
    assert comm.is_agreed(info.value)  # every rank raised it alike: the command line says it once
    assert len(message.splitlines()) == 1, message
    assert message.startswith("prompts.jsonl: the ranks loaded different data:"), message
    assert "on rank 0 (first: rank 0" in message and "on ranks 1-2 (first: rank 1)" in message, message
    assert f"{len(other_rows)} examples" in message


def test_one_process_needs_no_agreement(tmp_path):
    path = write_lines(tmp_path / "prompts.jsonl", [{"prompt_ids": [1, 2]}])
    load_prompts(path)
    check_same_data()  # no process group: nothing to compare, nothing gathered
    assert reading._LOADED == []


def test_two_gloo_ranks_with_different_copies_stop_as_the_group_starts(tmp_path):
    """Each rank reads its own copy (a node's disk); rank 1's copy lacks a row. Before: both ranks trained,
    drawing different orders ([3, 0, 5, 1] and [1, 0, 3, 2]) over different rows."""
    paths = [
        write_lines(tmp_path / f"node{r}" / "prompts.jsonl", [{"prompt_ids": [i + 1]} for i in range(n)])
        for r, n in enumerate((6, 5))
    ]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    logs = [tmp_path / f"rank{r}.log" for r in range(2)]
    procs = [
        start_group(
            [sys.executable, "-m", "tests.helpers.data3_rank", paths[r]],
            logs[r],
            env={
                **os.environ,
                "RANK": str(r),
                "WORLD_SIZE": "2",
                "LOCAL_RANK": str(r),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
            },
        )
        for r in range(2)
    ]
    codes = wait_groups(procs, timeout=240, logs=logs)
    outs = [log.read_text() for log in logs]
    assert codes == [2, 2], outs
    for out in outs:
        assert "data error: prompts.jsonl: the ranks loaded different data: 6 examples" in out, out
        assert "on rank 1 (first: rank 1 on node 0" in out, out


def errors_of(load, *args, **kwargs) -> list[str]:
    with pytest.raises(DataError) as info:
        load(*args, **kwargs)
    return info.value.problems


def test_a_json_array_file_is_read_with_each_rows_line(tmp_path):
    """Before: a pretty-printed JSON array (alpaca-style .json, which ``datasets`` reads) was 10+ bad lines of
    'invalid JSON', none saying why."""
    path = tmp_path / "prompts.json"
    path.write_text("\n" + json.dumps([{"prompt_ids": [1, 2], "answer": "3"}, {"prompt_ids": [4]}], indent=2))
    examples = load_prompts(str(path))
    assert [(e.prompt_ids, e.source) for e in examples] == [([1, 2], "prompts.json:3"), ([4], "prompts.json:10")]
    assert examples[0].meta == {"answer": "3"}


@pytest.mark.parametrize(
    "text, problems",
    [
        (
            '[{"prompt_ids": [1]},\n5,\n{"prompt": 7}]',
            [
                "x.json:2: expected a JSON object, got int",
                "x.json:3: field 'prompt' must be text or a list of token ids, got 7",
            ],
        ),
        ('[{"prompt_ids": [1]},\n{"prompt_ids": [2', ["x.json:2: invalid JSON (Expecting ',' delimiter at column 18)"]),
        ('[{"prompt_ids": [1]},\n]', ["x.json:2: invalid JSON (Expecting value at column 1)"]),
        (
            '[{"prompt_ids": [1]}]\n\n{"prompt_ids": [2]}\n',
            ["x.json:3: invalid JSON (more after the array's closing ']')"],
        ),
        (
            '[{"prompt_ids": [1]},\n{"prompt_ids": [2], "prompt_ids": [3]}]',
            ["x.json:2: key 'prompt_ids' appears twice in one object"],
        ),
    ],
)
def test_a_bad_json_array_names_the_line(tmp_path, text, problems):
    path = tmp_path / "x.json"
    path.write_text(text)
    assert errors_of(load_prompts, str(path)) == problems


def test_a_key_given_twice_is_a_bad_line_not_the_last_silently(tmp_path):
    """Before: json kept the last ``prompt_ids`` ([2, 3]) without a word."""
    path = tmp_path / "p.jsonl"
    path.write_text(
        '{"prompt_ids": [1]}\n{"prompt_ids": [1], "prompt_ids": [2, 3]}\n'
        '{"messages": [{"role": "user", "role": "system", "content": "x"}]}\n'
    )
    assert errors_of(load_prompts, str(path)) == [
        "p.jsonl:2: key 'prompt_ids' appears twice in one object",
        "p.jsonl:3: key 'role' appears twice in one object",
    ]


def test_a_byte_order_mark_is_not_part_of_the_first_row(tmp_path):
    """Before: p.jsonl:1: invalid JSON (Unexpected UTF-8 BOM ...), for a file Windows tools write."""
    path = tmp_path / "p.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + b'{"prompt_ids": [1]}\r\n{"prompt_ids": [2]}\r\n')
    assert [e.prompt_ids for e in load_prompts(str(path))] == [[1], [2]]


@pytest.mark.parametrize("name, kind", [("p.csv", "CSV"), ("p.jsonl.gz", "a compressed file")])
def test_files_that_are_not_json_are_one_line(tmp_path, name, kind):
    """Before: one 'invalid JSON' per line of the file."""
    path = tmp_path / name
    path.write_text("prompt,answer\nhello,1\nworld,2\n")
    assert errors_of(load_prompts, str(path)) == [
        f"{name}: {kind} is not read as data: give JSONL (one JSON object per line), a JSON array of objects, "
        "a .parquet file or a datasets folder"
    ]


def test_parquet_with_a_column_twice_is_an_error(tmp_path):
    """Before: the second ``prompt_ids`` column won: the row trained on [3], not [1, 2]."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    path = str(tmp_path / "dup.parquet")
    pq.write_table(
        pa.Table.from_arrays([pa.array([[1, 2]]), pa.array([[3]])], names=["prompt_ids", "prompt_ids"]), path
    )
    assert errors_of(load_prompts, path) == ["dup.parquet: column 'prompt_ids' appears 2 times"]


def test_a_damaged_parquet_page_is_a_data_error(tmp_path):
    """Before: OSError (Couldn't deserialize thrift ...) as a traceback, naming no file."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    path = str(tmp_path / "t.parquet")
    pq.write_table(pa.table({"prompt_ids": [[i, i + 1] for i in range(5000)]}), path, row_group_size=1000)
    offset = pq.ParquetFile(path).metadata.row_group(3).column(0).data_page_offset
    data = bytearray(open(path, "rb").read())
    data[offset + 20 : offset + 200] = b"\xab" * 180
    open(path, "wb").write(bytes(data))
    (problem,) = errors_of(load_prompts, path)
    assert problem.startswith("t.parquet: not readable Parquet from row "), problem


def test_a_folder_of_data_files_names_them(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    os.makedirs(tmp_path / "gsm8k" / "main")
    pq.write_table(pa.table({"prompt_ids": [[1]]}), str(tmp_path / "gsm8k" / "main" / "train-00000-of-00001.parquet"))
    (problem,) = errors_of(load_prompts, str(tmp_path / "gsm8k"))
    assert problem.startswith("gsm8k: not a datasets folder saved with save_to_disk"), problem
    assert problem.endswith("; it holds data files (main/train-00000-of-00001.parquet): give one file's path")


@pytest.fixture(scope="module")
def chat_tokenizers(tmp_path_factory):
    pytest.importorskip("tokenizers")
    pytest.importorskip("transformers")
    from tests.helpers.data3_tokenizers import save_tokenizer

    root = tmp_path_factory.mktemp("data3_tok")
    return save_tokenizer(root / "instruct"), save_tokenizer(root / "base", eos="<|endoftext|>")


def test_a_trained_turn_with_tool_calls_is_a_bad_line(tmp_path, chat_tokenizers):
    """Before: the response trained was 'calling the weather tool<|im_end|>': the call the template renders
    (<tool_call>weather</tool_call>) was dropped without a word."""
    from fastrlhf.data import load_sft_examples

    call = [{"type": "function", "function": {"name": "weather", "arguments": {}}}]
    path = write_lines(
        str(tmp_path / "sft.jsonl"),
        [
            {
                "messages": [
                    {"role": "user", "content": "what is two plus two"},
                    {"role": "assistant", "content": "calling the weather tool", "tool_calls": call},
                ]
            }
        ],
    )
    assert errors_of(load_sft_examples, path, 512, tokenizer_path=chat_tokenizers[0]) == [
        "sft.jsonl:1: field 'messages': assistant message 1 has 'tool_calls', which would not be trained (a trained "
        "turn is its 'content' plus EOS): write the call into its content in the model's own format (e.g. "
        "<tool_call>...</tool_call>)"
    ]


def test_all_turns_with_a_base_tokenizers_eos_says_so(tmp_path, chat_tokenizers):
    """Before: 'the chat template renders the turns before message 3 differently ...', for a template that
    renders them the same: the trained turns end with EOS <|endoftext|>, the template's with <|im_end|>."""
    from fastrlhf.data import load_sft_examples

    path = write_lines(
        str(tmp_path / "sft.jsonl"),
        [
            {
                "messages": [
                    {"role": "user", "content": "hello world"},
                    {"role": "assistant", "content": "it is sunny"},
                    {"role": "user", "content": "what is two plus two"},
                    {"role": "assistant", "content": "the answer is four"},
                ]
            }
        ],
    )
    (problem,) = errors_of(load_sft_examples, path, 512, tokenizer_path=chat_tokenizers[1], assistant_turns="all")
    assert "ends an assistant turn with '<|im_end|>', not with the tokenizer's EOS '<|endoftext|>'" in problem
    assert len(load_sft_examples(path, 512, tokenizer_path=chat_tokenizers[0], assistant_turns="all")) == 1


@pytest.mark.parametrize("command", ["train", "sft"])
def test_chat_template_kwargs_reach_the_template(tmp_path, command):
    """data.chat_template_kwargs (Qwen3's enable_thinking): prompts written as messages always got the template's
    default (thinking), so a non-thinking run could only give pre-rendered prompts."""
    from fastrlhf.data import load_sft_examples
    from fastrlhf.modeling.tiny_chat import build_chat_tokenizer
    from tests.helpers.episodes_templates import QWEN3

    tokenizer = build_chat_tokenizer()
    tokenizer.chat_template = QWEN3
    tokenizer.save_pretrained(tmp_path / "tok")
    user = {"role": "user", "content": "hi"}
    path = write_lines(tmp_path / "d.jsonl", [{"messages": [user] if command == "train" else
                                              [user, {"role": "assistant", "content": "ok"}]}])

    def prompt(**kwargs):
        if command == "train":
            return load_prompts(path, tokenizer_path=str(tmp_path / "tok"), **kwargs)[0].prompt_ids
        return load_sft_examples(path, 512, tokenizer_path=str(tmp_path / "tok"), **kwargs)[0].prompt_ids

    thinking, plain = prompt(), prompt(chat_template_kwargs={"enable_thinking": False})
    reading._LOADED.clear()
    assert tokenizer.decode(plain).endswith("<think>\n\n</think>\n\n")
    assert not tokenizer.decode(thinking).endswith("</think>\n\n")
