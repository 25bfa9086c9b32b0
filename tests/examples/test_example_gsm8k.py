"""examples/gpu/gsm8k.py: GSM8K's layout (question, answer ending in "#### N") converted to the chat rows the
GPU examples read, on hand-written GSM8K-style lines as JSONL and Parquet; its reward on text; and the GPU
configs naming it."""

import glob
import json
import os

import pytest
import torch
import yaml
from helpers.paths import ROOT

from examples.gpu.gsm8k import INSTRUCTION, convert, correctness, final_answer, main

GSM8K = [
    {"question": "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
                 "How many clips did Natalia sell altogether in April and May?",
     "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips "
               "altogether in April and May.\n#### 72"},
    {"question": "A house costs $1,000 and a garden $200 more. What do both cost?",
     "answer": "The garden costs 1000+200 = <<1000+200=1200>>1200.\nBoth cost 1000+1200 = 2200.\n#### 2,200"},
    {"question": "  It is 3 degrees and falls by 5. What is it now?  ", "answer": "3-5 = -2\n#### -2"},
]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def read_jsonl(path):
    return [json.loads(line) for line in open(path)]


def test_jsonl_rows_become_chats_with_their_final_number_as_the_answer(tmp_path):
    source = write_jsonl(tmp_path / "train.jsonl", GSM8K)
    assert convert(source, str(tmp_path / "out" / "gsm8k_train.jsonl")) == 3
    rows = read_jsonl(tmp_path / "out" / "gsm8k_train.jsonl")
    assert rows[0] == {"messages": [{"role": "user", "content": GSM8K[0]["question"] + " " + INSTRUCTION}],
                       "answer": "72"}
    assert [r["answer"] for r in rows] == ["72", "2200", "-2"]
    assert rows[2]["messages"][0]["content"] == "It is 3 degrees and falls by 5. What is it now? " + INSTRUCTION
    convert(source, str(tmp_path / "bare.jsonl"), instruction="")
    assert read_jsonl(tmp_path / "bare.jsonl")[0]["messages"][0]["content"] == GSM8K[0]["question"]


def test_parquet_gives_the_jsonl_rows(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    # GSM8K's Parquet files hold these two columns; an extra one is ignored.
    pq.write_table(pa.Table.from_pylist([{**r, "id": i} for i, r in enumerate(GSM8K)]), str(tmp_path / "t.parquet"))
    convert(str(tmp_path / "t.parquet"), str(tmp_path / "from_parquet.jsonl"))
    convert(write_jsonl(tmp_path / "t.jsonl", GSM8K), str(tmp_path / "from_jsonl.jsonl"))
    assert read_jsonl(tmp_path / "from_parquet.jsonl") == read_jsonl(tmp_path / "from_jsonl.jsonl")

    pq.write_table(pa.Table.from_pylist([{"question": "q", "solution": "#### 1"}]), str(tmp_path / "other.parquet"))
    with pytest.raises(ValueError, match=r"^other\.parquet: no column 'answer' \(has question, solution\)$"):
        convert(str(tmp_path / "other.parquet"), str(tmp_path / "x.jsonl"))


def test_bad_rows_are_named_one_line_each_exit_2_and_nothing_is_written(tmp_path, capsys):
    lines = [json.dumps(GSM8K[0]), json.dumps({"question": "No mark?", "answer": "It is 4."}), "",
             json.dumps({"question": "", "answer": "#### 4"}), "{not json", json.dumps({"question": "q",
                                                                                      "answer": "#### four"})]
    (tmp_path / "train.jsonl").write_text("\n".join(lines) + "\n")
    out = tmp_path / "gsm8k_train.jsonl"
    assert main([str(tmp_path / "train.jsonl"), str(out)]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "error: train.jsonl:2: 'answer' must be a solution ending in '#### <number>', got 'It is 4.'",
        "error: train.jsonl:4: 'question' must be non-empty text, got ''",
        "error: train.jsonl:5: invalid JSON (Expecting property name enclosed in double quotes at column 2)",
        "error: train.jsonl:6: 'answer' has no number after its last '####': ' four'"]
    assert not out.exists() and not (tmp_path / "gsm8k_train.jsonl.tmp").exists()
    assert main([str(tmp_path / "missing.jsonl"), str(out)]) == 2
    assert "missing.jsonl: No such file or directory" in capsys.readouterr().err
    assert main([write_jsonl(tmp_path / "ok.jsonl", GSM8K), str(out)]) == 0
    assert capsys.readouterr().out == f"wrote 3 prompts to {out}\n" and len(read_jsonl(out)) == 3


def test_final_answer_reads_the_last_mark_else_a_stated_answer():
    assert final_answer("48/2 = 24\n48+24 = 72\n#### 72") == 72
    assert final_answer("#### 5 was a guess. #### $1,200.") == 1200  # the last mark
    assert final_answer("So the answer is 18.") == 18  # no mark: the stated answer
    assert final_answer("It costs 18 dollars.") is None  # neither: no answer
    assert final_answer("#### eighteen. The answer is 18.") is None  # a mark without a number is no answer
    assert final_answer("#### -3.50") == -3.5
    assert final_answer(None) is None


def test_correctness_on_either_form_of_completion():
    texts = ["48+24 = 72\n#### 72", "#### 73", "The answer is 72.", "I think 72", "#### 2,200"]
    answers = ["72", "72", "72", "72", "2200"]
    expected = [1.0, 0.0, 1.0, 0.0, 1.0]
    chats = [[{"role": "assistant", "content": t}] for t in texts]
    prompts = [[{"role": "user", "content": "q"}]] * len(texts)
    assert correctness(prompts, chats, answers, completion_ids=[[1]] * 5) == expected
    assert correctness(["q"] * 5, texts, answers) == expected
    assert correctness(["q", "q"], ["#### 1", "#### 1"], [None, "n/a"]) == [None, None]  # no answer to check


def test_converted_rows_score_through_the_trainers_data_and_reward_path(tmp_path):
    """The converter's file read by load_prompts (the chat template, the answer column), completions
    decoded and scored by the reward in the trainer's default format."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from fastrlhf.data import load_prompts
    from fastrlhf.rl.experience import build_experience
    from fastrlhf.rl.rewards import RewardScorer, TextReward
    from fastrlhf.rollout import Completion

    words = ["<unk>", "<im>", "</im>", "####", "72", "73", "2200", "so"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")
    tokenizer.chat_template = "{% for m in messages %}<im> {{ m['content'] }} </im> {% endfor %}<im>"
    tokenizer.save_pretrained(tmp_path / "tok")
    convert(write_jsonl(tmp_path / "train.jsonl", GSM8K[:2]), str(tmp_path / "rows.jsonl"))

    examples = load_prompts(str(tmp_path / "rows.jsonl"), tokenizer_path=str(tmp_path / "tok"), chat_template="auto")
    assert [e.meta for e in examples] == [{"answer": "72"}, {"answer": "2200"}]
    completions = [[Completion([7, 3, 4], [0.0] * 3, "stop"), Completion([3, 5], [0.0] * 2, "stop")],
                   [Completion([3, 6], [0.0] * 2, "stop"), Completion([7], [0.0], "stop")]]
    prompts = [e.prompt_ids for e in examples]
    rows = [(e.prompt_ids, c.token_ids, e.meta) for e, samples in zip(examples, completions, strict=True)
            for c in samples]
    scorer = RewardScorer(text_rewards=[TextReward("correctness", correctness)], tokenizer=tokenizer)
    scores = scorer(build_experience(prompts, completions, 0), *map(list, zip(*rows, strict=True)))
    torch.testing.assert_close(scores, torch.tensor([1.0, 0.0, 1.0, 0.0]))  # "so #### 72", "#### 2200"


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(ROOT, "examples", "gpu", "*.yaml"))),
                         ids=os.path.basename)
def test_gpu_examples_read_chat_rows_and_score_with_this_reward(path):
    from fastrlhf.rl.rewards import resolve_reward_function

    config = yaml.safe_load(open(path))
    assert config["data"]["chat_template"] == "auto" and config["data"]["prompts"] == "data/gsm8k_train.jsonl"
    assert [resolve_reward_function(f["function"]) for f in config["reward"]["functions"]] == [correctness]
    assert "function" not in config["reward"]  # no token-id reward (match_answer and its answer_ids)
