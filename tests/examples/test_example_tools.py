"""The tools example (examples/tools, `make tools`): the calculator (what it evaluates, what it refuses), the data (a
fixed held-out split disjoint from training; the tool arm's SFT rows, rendered by ``fastrlhf sft``'s own loader with
the calculator's schema, hold the exact tool-call text), the reward on text and on an episode's messages, the
pretraining's token layout (the rollout's exactly), and every stage of the runner for a few steps."""

import json

import pytest

from examples.tools import data as task_data
from examples.tools.calculator import calculator
from examples.tools.reward import correctness

CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "4821 * 7395"}}\n</tool_call>'


# ------------------------------------------------------------------------------------------- calculator


@pytest.mark.parametrize("expression,value", [("4821 * 7395", "35651295"), ("1234 + 8766", "10000"),
                                              ("1000 - 4321", "-3321"), ("(2 + 3) * 4", "20"), (" 8 / 2 ", "4"),
                                              ("7 / 2", "3.5"), ("-3 + 5", "2"), ("2 * (3 - (4 + 1))", "-4")])
def test_calculator_evaluates_integer_arithmetic(expression, value):
    assert calculator(expression) == value


@pytest.mark.parametrize("expression", ["__import__('os')", "__import__('os').system('true')", "x + 1", "abs(-3)",
                                        "2 ** 10", "1.5 * 2", "'a' * 3", "[1] * 3", "1; 2", "", "True + 1",
                                        "(lambda: 1)()"])
def test_calculator_refuses_anything_but_integers_and_four_operators(expression):
    with pytest.raises(ValueError, match="not an integer expression|cannot parse"):
        calculator(expression)


def test_calculator_division_by_zero_raises():
    with pytest.raises((ZeroDivisionError, ValueError)):
        calculator("1 / (2 - 2)")


def test_calculator_schema_is_read_from_its_docstring():
    from transformers.utils import get_json_schema

    schema = get_json_schema(calculator)["function"]
    assert schema["name"] == "calculator"
    assert schema["parameters"]["required"] == ["expression"]
    assert schema["parameters"]["properties"]["expression"]["type"] == "string"
    assert schema["parameters"]["properties"]["expression"]["description"]


# ------------------------------------------------------------------------------------------------- data


def _numbers(question: str) -> tuple[int, int]:
    a, b = (int(x) for x in question.replace("?", " ").replace(".", " ").split() if x.isdigit())
    return a, b


def test_held_out_split_is_fixed_products_and_disjoint_from_training_for_every_seed():
    val = task_data.validation_problems()
    assert len(val) == 200 and val == task_data.validation_problems()
    questions = [task_data.question(*p) for p in val]
    assert len(set(questions)) == 200
    pairs = {_numbers(q) for q in questions}
    for seed in (0, 1):
        train = task_data.train_problems(3000, seed)
        assert not {task_data.question(*p) for p in train} & set(questions)
        assert not {(a, b) for a, _, b, _ in train} & pairs
        assert all(1000 <= a <= 9999 and 1000 <= b <= 9999 for a, _, b, _ in train)
        sevens = [len(str(a * b)) == 7 for a, op, b, _ in train if op == "*"]
        assert abs(sum(sevens) / len(sevens) - task_data.SEVEN_DIGIT_SHARE) < 0.05  # uniform draws give 17%


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    from fastrlhf.modeling.tiny_chat import build_chat_tokenizer

    out = tmp_path_factory.mktemp("tools_example")
    paths = task_data.write_data(str(out / "data"), seed=0, pretrain_size=50, sft_size=40, rl_size=30)
    tokenizer = build_chat_tokenizer([*task_data.corpus_text(0, 200)], vocab_size=512, tool_tokens=True)
    tokenizer.save_pretrained(out / "tok")
    rows = {name: [json.loads(line) for line in open(path)] for name, path in paths.items()}
    return paths, rows, tokenizer, str(out / "tok")


def test_tool_call_text_is_the_episode_format():
    assert task_data.tool_call_text(4821, "*", 7395) == CALL
    assert task_data.answer_text(35651295) == "The answer is 35651295."


def _operator(question: str) -> str:
    for op, words in (("*", (" * ", "times", "multipl")), ("+", (" + ", "plus")), ("-", (" - ", "minus"))):
        if any(w in question for w in words):
            return op
    raise AssertionError(question)


def test_rl_and_validation_rows_carry_the_answer(written):
    _, rows, _, _ = written
    for name in ("rl", "val"):
        for row in rows[name]:
            assert [m["role"] for m in row["messages"]] == ["user"]
            question = row["messages"][0]["content"]
            a, b = _numbers(question)
            assert row["answer"] == str({"*": a * b, "+": a + b, "-": a - b}[_operator(question)])
    assert len(rows["val"]) == 200 and all(_operator(r["messages"][0]["content"]) == "*" for r in rows["val"])


def test_tool_sft_rows_render_through_the_template_with_the_exact_call(written):
    from transformers.utils import get_json_schema

    from fastrlhf.data import load_sft_examples

    paths, rows, tokenizer, tok_path = written
    schemas = [get_json_schema(calculator)]
    examples = load_sft_examples(paths["sft-tool"], 2048, tokenizer_path=tok_path, chat_template=True, tools=schemas)
    assert len(examples) == len(rows["sft-tool"])
    calls = answers = 0
    for row, example in zip(rows["sft-tool"], examples, strict=True):
        messages = row["messages"]
        assert all("tool_calls" not in m for m in messages)  # plain content: the template renders what is generated
        prompt = tokenizer.decode(example.prompt_ids)
        response = tokenizer.decode(example.response_ids)
        assert prompt.startswith("<|im_start|>system\n# Tools") and '"name": "calculator"' in prompt
        assert prompt.endswith("<|im_start|>assistant\n") and response.endswith("<|im_end|>")
        assert response[:-len("<|im_end|>")] == messages[-1]["content"]
        if messages[-1]["content"].startswith("<tool_call>"):  # row A: the call
            calls += 1
            a, b = _numbers(messages[0]["content"])
            op = json.loads(messages[-1]["content"].split("\n")[1])["arguments"]["expression"].split()[1]
            assert messages[-1]["content"] == task_data.tool_call_text(a, op, b)
        elif len(messages) == 4:  # row B: the answer after the result
            answers += 1
            result = calculator(json.loads(messages[1]["content"].split("\n")[1])["arguments"]["expression"])
            assert messages[2] == {"role": "tool", "name": "calculator", "content": result}
            assert prompt.endswith(f"{messages[1]['content']}<|im_end|>\n<|im_start|>user\n<tool_response>\n{result}"
                                   "\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
            assert messages[-1]["content"] == f"The answer is {result}."
    assert calls and calls == answers
    # The whole episode through the template holds the call as one token each side.
    episode = next(r["messages"] for r in rows["sft-tool"] if len(r["messages"]) == 4)
    text = tokenizer.apply_chat_template(episode, tools=schemas, tokenize=False)
    assert f"<|im_start|>assistant\n{episode[1]['content']}<|im_end|>\n" in text
    assert tokenizer.tokenize("<tool_call>")[0] == "<tool_call>" and len(tokenizer.tokenize("</tool_call>")) == 1


def test_tool_episodes_train_the_call_and_the_answer_in_one_sequence(written):
    """data.assistant_turns: all on Qwen2.5's own template (tools listed, the result as a <tool_response> turn): the
    call and the answer are trained, the tool's turn between them is read, and the sequence is the one the
    template gives the whole episode."""
    from transformers.utils import get_json_schema

    from fastrlhf.data import load_sft_examples

    paths, rows, tokenizer, tok_path = written
    schemas = [get_json_schema(calculator)]
    kwargs = dict(tokenizer_path=tok_path, chat_template=True, tools=schemas)
    last = load_sft_examples(paths["sft-tool"], 2048, **kwargs)
    every = load_sft_examples(paths["sft-tool"], 2048, assistant_turns="all", **kwargs)
    episodes = 0
    for row, one, both in zip(rows["sft-tool"], last, every, strict=True):
        assert one.prompt_ids + one.response_ids == both.prompt_ids + both.response_ids
        if len(row["messages"]) != 4:
            assert both == one
            continue
        episodes += 1
        trained = tokenizer.decode([t for t, m in zip(both.response_ids, both.response_mask, strict=True) if m])
        read = tokenizer.decode([t for t, m in zip(both.response_ids, both.response_mask, strict=True) if not m])
        assert trained == f"{row['messages'][1]['content']}<|im_end|>{row['messages'][3]['content']}<|im_end|>"
        assert read == f"\n<|im_start|>user\n<tool_response>\n{row['messages'][2]['content']}\n</tool_response>" \
                       "<|im_end|>\n<|im_start|>assistant\n"
    assert episodes


def test_no_tool_sft_rows_answer_at_once_without_tools(written):
    paths, rows, tokenizer, tok_path = written
    from fastrlhf.data import load_sft_examples

    examples = load_sft_examples(paths["sft-direct"], 512, tokenizer_path=tok_path, chat_template=True)
    for row, example in zip(rows["sft-direct"], examples, strict=True):
        assert [m["role"] for m in row["messages"]] == ["user", "assistant"]
        assert row["messages"][1]["content"].startswith("The answer is ")
        assert tokenizer.decode(example.prompt_ids).startswith("<|im_start|>user\n")


# ----------------------------------------------------------------------------------------------- reward


def test_correctness_on_text_and_on_an_episodes_messages():
    episode = [{"role": "assistant", "content": CALL}, {"role": "tool", "name": "calculator", "content": "35651295"},
               {"role": "assistant", "content": "The answer is 35651295."}]
    wrong = [*episode[:2], {"role": "assistant", "content": "The answer is 35651296."}]
    unanswered = episode[:2]  # the tool's result is not the policy's answer
    stated_by_tool = [episode[0], {"role": "tool", "name": "calculator", "content": "The answer is 35651295."}]
    got = correctness(None, ["The answer is 35651295.", "The answer is 12.", "35651295", episode, wrong, unanswered,
                             stated_by_tool, [{"role": "assistant", "content": "The answer is 35651295."}]],
                      None, ["35651295"] * 8)
    assert got == [1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0]
    assert correctness(None, [episode], None, [None]) == [None]


def test_some_tool_arm_demonstrations_answer_at_once_for_two_phrasings(written):
    """What GRPO has to fix: for "How much is a multiplied by b?" and "What do you get when you multiply a by b?"
    some demonstrations answer without the calculator; for every other phrasing none does."""
    _, rows, _, _ = written
    sft = [r["messages"] for r in rows["sft-tool"]]
    at_once = [m for m in sft if len(m) == 2 and m[1]["content"].startswith("The answer is")]
    assert 0 < len(at_once) < len(sft) / 2
    phrasings = tuple(task_data.PHRASINGS["*"][k].split("{")[0] for k in (2, 3))
    assert all(m[0]["content"].startswith(phrasings) for m in at_once)
    assert [task_data.uses_tool(p) for p in task_data.validation_problems()[:50]].count(False) > 0


def test_pretraining_episodes_are_token_for_token_what_the_rollout_builds(tmp_path):
    """The stand-in trains on the episode layout the trainer later scores: same ids, loss on the same tokens."""
    from transformers import AutoTokenizer

    from examples.tools.model import make_initial_model
    from examples.tools.pretrain import episode_tokens
    from fastrlhf.rollout import SamplingConfig
    from fastrlhf.rollout.episodes import EpisodeRunner
    from fastrlhf.rollout.tools import load_toolbox
    from tests.helpers.tool_fixtures import ScriptedEngine

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
    assert direct["after"]["called"] == 0 and 0 <= tool["after"]["called"] <= 4
    text = (out / "report.md").read_text()
    assert "| 0 | tool |" in text and "| 0 | direct |" in text and "Sample episodes" in text


def test_the_report_separates_calling_the_tool_from_copying_its_result(tmp_path):
    """``accuracy_when_called``: of the validation episodes that called the calculator, the share answered right
    (the calculator is never wrong, so what it measures is the copy)."""
    from examples.tools.run import _eval_at

    (tmp_path / "eval").mkdir()
    records = [{"correct": 1.0, "tool_calls": 1}, {"correct": 0.0, "tool_calls": 1}, {"correct": 1.0, "tool_calls": 2},
               {"correct": 0.0, "tool_calls": 0}, {"correct": 0.0}]
    (tmp_path / "eval" / "step-3.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    summary = _eval_at(str(tmp_path), 3)
    assert summary["accuracy"] == pytest.approx(2 / 5)
    assert summary["called"] == 3 and summary["accuracy_when_called"] == pytest.approx(2 / 3)
    assert summary["tool_calls_per_episode"] == pytest.approx(4 / 5)
