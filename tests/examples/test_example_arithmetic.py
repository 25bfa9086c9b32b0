"""The arithmetic example's pieces (examples/arithmetic): the problem generator and its split, the
reward functions, the tokenizer's chat template, the model's config. Fast: no training."""

import json
import re

import pytest

from examples.arithmetic import data as task_data
from examples.arithmetic import model as task_model
from examples.arithmetic.reward import correctness, extract_answer, format_reward

# ----------------------------------------------------------------------------------------------- data


def _recompute(question: str, kind: str) -> int:
    """The answer of a question from its own numbers (independently of ``solve``)."""
    nums = [int(x) for x in re.findall(r"\d+", question)]
    return {"add": lambda a, b: a + b, "sub": lambda a, b: a - b, "mul": lambda a, b: a * b,
            "add_sub": lambda a, b, c: a + b - c, "mul_add": lambda a, b, c: a * b + c}[kind](*nums)


def _kind_of(question: str) -> str:
    """The kind of a question, from its template."""
    for kind, templates in task_data.TEMPLATES.items():
        for template in templates:
            pattern = re.escape(template).replace(r"\{item\}", "[a-z]+")
            pattern = re.sub(r"\\\{[nm]\\\}", "[A-Z][a-z]+", pattern)
            pattern = re.sub(r"\\\{[abc]\\\}", r"\\d+", pattern)
            if re.fullmatch(pattern, question):
                return kind
    raise AssertionError(question)


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    out = tmp_path_factory.mktemp("arith")
    paths = task_data.write_data(str(out), seed=3, sft_size=400, rl_size=300)
    rows = {name: [json.loads(line) for line in open(path)] for name, path in paths.items()}
    return paths, rows


def test_validation_split_is_fixed_distinct_and_covers_every_kind():
    val = task_data.validation_problems()
    assert val == task_data.validation_problems()  # whatever the run's seed
    assert len({p["question"] for p in val}) == len(val) == 200
    kinds = [p["kind"] for p in val]
    assert set(kinds) == set(task_data.KINDS)
    assert sum(k in task_data.TWO_STEP for k in kinds) == 100


def test_files_hold_correct_answers_and_no_validation_question_in_training(written):
    _, rows = written
    questions, two_step_keys = task_data.held_out(task_data.validation_problems())
    assert {r["messages"][0]["content"] for r in rows["val"]} == questions
    for row in rows["rl"] + rows["sft"]:
        assert row["messages"][0]["content"] not in questions
    for row in rows["rl"]:  # two-step validation numbers are never asked in training, in any words
        nums = tuple(int(x) for x in re.findall(r"\d+", row["messages"][0]["content"]))
        assert row["kind"] not in task_data.TWO_STEP or (row["kind"], *nums) not in two_step_keys
    for row in rows["rl"] + rows["val"]:
        (user,) = row["messages"]
        assert user["role"] == "user" and set(row) == {"messages", "answer", "kind"}
        assert int(row["answer"]) == _recompute(user["content"], row["kind"]) >= 0
    bare = strict = 0
    for row in rows["sft"]:
        user, assistant = row["messages"]
        assert (user["role"], assistant["role"]) == ("user", "assistant")
        text = assistant["content"]
        equations = re.findall(r"(\d+) ([-+*]) (\d+) = (\d+)", text)
        for a, op, b, c in equations:  # every worked step is right
            assert int(c) == {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]
        closing = re.search(r"(?:The answer is (\d+)\.|That makes (\d+) [a-z]+\.)$", text)
        assert closing, text
        stated = closing.group(1) or closing.group(2)
        assert int(stated) == _recompute(user["content"], _kind_of(user["content"]))
        if equations:
            assert equations[-1][3] == stated
        bare += not equations
        strict += closing.group(1) is not None
    n = len(rows["sft"])
    assert 0 < bare < n and 0 < strict < n  # some answers are bare, some close loosely, as in real SFT data


def test_the_same_seed_writes_the_same_files(tmp_path, written):
    paths, _ = written
    again = task_data.write_data(str(tmp_path), seed=3, sft_size=400, rl_size=300)
    for name in paths:
        assert open(paths[name]).read() == open(again[name]).read()


# ----------------------------------------------------------------------------------------------- reward


def test_extract_answer_reads_only_a_stated_answer():
    assert extract_answer("7 + 5 = 12. The answer is 12.") == 12
    assert extract_answer("3 * 4 = 12. 12 - 5 = 7. The answer is 7") == 7
    assert extract_answer("the answer is: 1,200 apples") == 1200
    assert extract_answer("The answer is 5. No, the answer is 6.") == 6  # the last statement
    assert extract_answer("7 + 5 = 12. That makes 12 apples.") is None  # strict: no statement, no answer
    assert extract_answer("7 + 5 = 13") is None
    assert extract_answer("The answer is -3.") == -3
    assert extract_answer("no idea") is None
    assert extract_answer("") is None


def as_chat(texts):
    """The example's rows are chats: the trainer's default reward.format hands completions over like this."""
    return [[{"role": "assistant", "content": t}] for t in texts]


def test_correctness_has_trl_signature_and_none_for_rows_without_an_answer():
    completions = ["7 + 5 = 12. The answer is 12.", "7 + 5 = 13. The answer is 13.", "I do not know",
                   "The answer is 12.", "The answer is 0.", "7 + 5 = 12. That makes 12 apples."]
    prompts = [[{"role": "user", "content": "Tom has 7 apples and buys 5 more. How many now?"}]] * 6
    for given in (as_chat(completions), completions):  # TRL's conversational form, or plain text
        out = correctness(prompts=prompts, completions=given, completion_ids=[[1]] * 6,
                          answer=["12", "12", "12", None, "0", "12"], kind=["add"] * 6)
        assert out == [1.0, 0.0, 0.0, None, 1.0, 0.0]  # an answer of 0 is an answer; a loose closing is not
    assert correctness(None, ["The answer is 4."], None, ["not a number"]) == [None]


def test_format_reward_wants_the_closing_statement_and_nothing_after():
    completions = ["1 + 1 = 2. The answer is 2.", "1 + 1 = 2.", "The answer is 2. And 3", "The answer is 2.\n"]
    for given in (as_chat(completions), completions):
        assert format_reward(["p"] * 4, given, [[1]] * 4) == [1.0, 0.0, 0.0, 1.0]


def test_reward_specs_resolve_through_the_trainer():
    from fastrlhf.rl.rewards import resolve_reward_function

    assert resolve_reward_function("examples.arithmetic.reward:correctness") is correctness
    assert resolve_reward_function("examples.arithmetic.reward:format_reward") is format_reward


# ----------------------------------------------------------------------------------------------- tokenizer + model


@pytest.fixture(scope="module")
def tokenizer():
    return task_model.build_tokenizer(task_data.corpus_text(size=300))


def test_tokenizer_chat_template_round_trip(tokenizer):
    assert [tokenizer.convert_tokens_to_ids(t) for t in task_model.SPECIAL_TOKENS] == [0, 1, 2]
    assert (tokenizer.pad_token, tokenizer.eos_token) == ("<|endoftext|>", "<|im_end|>")
    chat = [{"role": "user", "content": "Tom has 17 apples and buys 5 more. How many apples does Tom have now?"},
            {"role": "assistant", "content": "17 + 5 = 22. The answer is 22."}]
    text = tokenizer.apply_chat_template(chat, tokenize=False)
    assert text == ("<|im_start|>user\n" + chat[0]["content"] + "<|im_end|>\n<|im_start|>assistant\n"
                    + chat[1]["content"] + "<|im_end|>\n")
    prompt = tokenizer.apply_chat_template(chat[:1], tokenize=False, add_generation_prompt=True)
    assert text.startswith(prompt) and prompt.endswith("<|im_start|>assistant\n")
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text
    assert ids.count(tokenizer.eos_token_id) == 2 and ids.count(1) == 2
    assert tokenizer.decode(ids, skip_special_tokens=True).count("17 + 5 = 22") == 1
    assert max(ids) < len(tokenizer) <= 2000
    assert tokenizer.tokenize("1234") == ["1", "2", "3", "4"]  # Qwen2's split: digits one by one


def test_model_is_a_qwen2_with_the_real_vocabulary_tied_gqa_and_bias(tokenizer):
    # vLLM's own list (cpu_supported_head_sizes) needs a 20 s vllm import; this is its copy.
    from fastrlhf.rollout.vllm_adapter import CPU_SUPPORTED_HEAD_SIZES

    model = task_model.build_model(tokenizer, num_hidden_layers=1)
    config = model.config
    assert type(model).__name__ == "Qwen2ForCausalLM" and config.model_type == "qwen2"
    assert config.vocab_size == 151936 == model.get_input_embeddings().weight.shape[0]
    assert config.tie_word_embeddings
    assert model.get_output_embeddings().weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    assert config.num_key_value_heads < config.num_attention_heads
    head_dim = config.hidden_size // config.num_attention_heads
    assert head_dim in CPU_SUPPORTED_HEAD_SIZES
    attn = model.model.layers[0].self_attn
    assert attn.q_proj.bias is not None and attn.k_proj.bias is not None and attn.v_proj.bias is not None
    assert config.eos_token_id == model.generation_config.eos_token_id == tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert config.pad_token_id == tokenizer.pad_token_id


# ----------------------------------------------------------------------------------------------- end to end


@pytest.mark.slow
def test_the_runner_goes_end_to_end_and_reports(tmp_path):
    """Every stage of ``python -m examples.arithmetic.run`` for a few steps: data, tokenizer, model,
    pretraining, ``fastrlhf sft``, GRPO with rewards on text and validation, both evaluations and the
    report. (What it learns in full length is measured by ``make arithmetic``, not here.)"""
    from examples.arithmetic import run

    out = tmp_path / "arith"
    assert run.main(["--out", str(out), "--pretrain-steps", "4", "--no-progress", "--val-size", "6",
                     "--sft-set", "trainer.max_steps=1", "--grpo-set", "trainer.max_steps=1",
                     "--grpo-set", "trainer.prompts_per_step=2", "--grpo-set", "rollout.n=2",
                     "--grpo-set", "trainer.minibatch_size=4",
                     "--grpo-set", "rollout.max_new_tokens=4"]) == 0
    report = json.loads((out / "report.json").read_text())
    (entry,) = report["runs"].values()
    assert (entry["seed"], entry["engine"]) == (0, "hf")
    for result in (entry["before"], entry["after"]):
        assert result["n"] == 6 and 0.0 <= result["accuracy"] <= 1.0
    assert [e["step"] for e in entry["trainer_eval"]] == [0, 1]  # the trainer validated before and after
    assert entry["model"]["model_vocab"] == 151936
    assert (out / "seed0" / "grpo-hf" / "final" / "config.json").is_file()
    assert (out / "seed0" / "grpo-hf" / "eval" / "step-1.jsonl").is_file()
    assert "| 0 | hf |" in (out / "report.md").read_text()
