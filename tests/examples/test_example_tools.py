"""The tools example (examples/tools, `make tools`): the calculator, the data, the reward, the pretraining's token
layout (the rollout's exactly), and every stage of the runner for a few steps."""

import json

import pytest

from examples.tools import data as task_data
from examples.tools.calculator import calculator
from examples.tools.reward import correctness


def test_calculator_evaluates_integer_arithmetic_and_refuses_anything_else():
    assert calculator("4821 * 7395") == "35651295"
    assert calculator("(3 + 4) * 2 - -1") == "15"
    assert calculator("8 / 2") == "4" and calculator("7 / 2") == "3.5"
    for bad in ("__import__('os')", "2 ** 64", "1.5 * 2", "x + 1", "", "1; 2"):
        with pytest.raises(ValueError):
            calculator(bad)
    with pytest.raises(ZeroDivisionError):
        calculator("1 / 0")


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    out = tmp_path_factory.mktemp("tools_data")
    return task_data.write_data(str(out), seed=0, pretrain_size=300, sft_size=40, rl_size=60)


def _rows(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_validation_questions_are_fixed_products_that_no_training_row_asks(written):
    val = _rows(written["val"])
    assert len(val) == task_data.VAL_SIZE and val == _rows(written["val"])
    assert all(" * " in task_data.tool_call_text(*p[:3]) for p in task_data.validation_problems())
    asked = {r["messages"][0]["content"] for name in ("pretrain-tool", "sft-tool", "rl") for r in _rows(written[name])}
    assert not asked & {r["messages"][0]["content"] for r in val}
    for row in val:
        a, b = (int(x) for x in row["messages"][0]["content"].replace("?", " ").replace(".", " ").split()
                if x.isdigit())
        assert row["answer"] == str(a * b) and 1000 <= a <= 9999 and 1000 <= b <= 9999


def test_sft_rows_are_the_call_and_the_answer_after_the_result(written):
    rows = _rows(written["sft-tool"])
    first = next(i for i, r in enumerate(rows) if r["messages"][-1]["content"].startswith("<tool_call>"))
    call, answer = rows[first]["messages"], rows[first + 1]["messages"]
    assert [m["role"] for m in call] == ["user", "assistant"]
    assert [m["role"] for m in answer] == ["user", "assistant", "tool", "assistant"]
    assert call[1]["content"].startswith('<tool_call>\n{"name": "calculator", "arguments": {"expression": "')
    expression = json.loads(call[1]["content"].split("\n")[1])["arguments"]["expression"]
    assert answer[2]["content"] == calculator(expression)
    assert answer[3]["content"] == f"The answer is {answer[2]['content']}."
    assert all(len(r["messages"]) == 2 and "tool" not in r for r in _rows(written["sft-direct"]))
    # Some tool-arm demonstrations answer at once, for two of the four phrasings of a product only.
    at_once = [r["messages"] for r in rows if len(r["messages"]) == 2 and r["messages"][1]["content"].startswith("The")]
    assert 0 < len(at_once) < len(rows) / 2
    phrasings = {task_data.PHRASINGS["*"][k].split("{")[0] for k in (2, 3)}
    assert all(any(m[0]["content"].startswith(p) for p in phrasings) for m in at_once)


def test_correctness_reads_the_policys_last_turn_not_the_tools_result():
    episode = [{"role": "assistant", "content": "<tool_call>...</tool_call>"},
               {"role": "tool", "name": "calculator", "content": "The answer is 12."},
               {"role": "assistant", "content": "The answer is 13."}]
    assert correctness(None, [episode, episode[:2], "The answer is 12."], None, ["12", "12", "12"]) == [0.0, 0.0, 1.0]
    assert correctness(None, [episode], None, [None]) == [None]


def test_pretraining_episodes_are_token_for_token_what_the_rollout_builds(tmp_path):
    """The stand-in trains on the episode layout the trainer later scores: same ids, loss on the same tokens."""
    from examples.tools.model import make_initial_model
    from examples.tools.pretrain import episode_tokens
    from fastrlhf.rollout import SamplingConfig
    from fastrlhf.rollout.episodes import EpisodeRunner
    from fastrlhf.rollout.tools import load_toolbox
    from tests.helpers.tool_fixtures import ScriptedEngine
    from transformers import AutoTokenizer

    make_initial_model(str(tmp_path / "init"))
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "init")
    toolbox = load_toolbox([task_data.CALCULATOR])
    p = task_data.train_problems(1, 0)[0]
    chat = task_data.tool_episode(p)
    ids, mask = episode_tokens(tokenizer, chat, toolbox.schemas)
    question = chat[0]["content"]
    engine = ScriptedEngine(tokenizer, {question: [chat[1]["content"], chat[3]["content"]]})
    prompt = list(tokenizer(tokenizer.apply_chat_template(chat[:1], tools=toolbox.schemas, tokenize=False,
                                                          add_generation_prompt=True),
                            add_special_tokens=False)["input_ids"])
    (episode,), = EpisodeRunner(engine, toolbox, tokenizer, 3, say=None).generate([prompt], SamplingConfig())
    assert ids == prompt + episode.token_ids
    assert mask == [0] * len(prompt) + episode.mask
    assert episode.extra["messages"][1] == chat[2]  # the calculator really ran


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_runner_goes_end_to_end_and_reports(tmp_path):
    """Every stage of ``make tools`` for a few steps, both arms: data, model, pretraining, ``fastrlhf sft`` (with
    data.tools), GRPO on episodes (and single turns for the no-tool arm), the trainer's validations, the report.
    (What it learns at full length is measured by ``make tools``, not here.)"""
    from examples.tools import run

    out = tmp_path / "tools"
    assert run.main(["--out", str(out), "--pretrain-steps", "3", "--no-progress", "--val-size", "4",
                     "--sft-set", "trainer.max_steps=1", "--grpo-set", "trainer.max_steps=1",
                     "--grpo-set", "trainer.prompts_per_step=2", "--grpo-set", "rollout.n=2",
                     "--grpo-set", "trainer.minibatch_size=4", "--grpo-set", "eval.every=1",
                     "--grpo-set", "rollout.max_new_tokens=8"]) == 0
    report = json.loads((out / "report.json").read_text())
    tool, direct = report["runs"]
    assert (tool["arm"], direct["arm"]) == ("tool", "direct")
    for entry in (tool, direct):
        assert entry["before"]["questions"] == entry["after"]["questions"] == 4
        assert len(entry["samples"]) == 3
    assert tool["train_calls_per_episode"] and not direct["train_calls_per_episode"]
    text = (out / "report.md").read_text()
    assert "| 0 | tool |" in text and "| 0 | direct |" in text and "Sample episodes" in text
