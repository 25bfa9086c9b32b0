"""The tiny chat model (``python -m fastrlhf.modeling.tiny_chat OUT``): one command makes a Qwen2-shaped folder
with a tokenizer and a chat template that supports tools, which the Auto classes load and every example that
needs a tokenizer runs from; a hub id as a model path is refused with the command that downloads it."""

import glob
import json
import os
import re
import sys

import pytest
from helpers.launch import run_group
from helpers.paths import ROOT
from helpers.rl_runs import launch_env

from fastrlhf.modeling.tiny_chat import CHAT_TEMPLATE, TOOL_TOKENS, build_chat_tokenizer

CHAT = [{"role": "system", "content": "Answer with a number."}, {"role": "user", "content": "What is 2 + 3?"}]


def add(a: float, b: float) -> float:
    """Add two numbers.

    Args:
        a: the first number
        b: the second number
    """
    return a + b


@pytest.fixture(scope="module")
def tiny_chat(tmp_path_factory):
    """The folder the one command writes (a subprocess, as a user runs it)."""
    out = tmp_path_factory.mktemp("tiny") / "tiny-chat"
    code, log = run_group([sys.executable, "-m", "fastrlhf.modeling.tiny_chat", str(out)], timeout=300)
    assert code == 0, log
    assert f"model.path: {out}" in log.splitlines()[-1], log
    return str(out)


def test_one_command_makes_a_qwen2_chat_folder_that_the_auto_classes_load(tiny_chat):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_chat)
    model = AutoModelForCausalLM.from_pretrained(tiny_chat)
    config = model.config
    assert type(model).__name__ == "Qwen2ForCausalLM" and config.model_type == "qwen2"
    assert config.vocab_size == 151936 and config.tie_word_embeddings  # Qwen2's vocabulary rows, tied head
    assert config.num_key_value_heads < config.num_attention_heads  # GQA
    assert model.model.layers[0].self_attn.q_proj.bias is not None  # Qwen2's q/k/v biases
    assert config.hidden_size // config.num_attention_heads == 32  # a head size vLLM's CPU backend runs
    assert (tokenizer.pad_token, tokenizer.eos_token) == ("<|endoftext|>", "<|im_end|>")
    assert config.eos_token_id == model.generation_config.eos_token_id == tokenizer.eos_token_id
    assert tokenizer.chat_template == CHAT_TEMPLATE
    ids = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, return_dict=False)
    assert tokenizer.decode(ids) == ("<|im_start|>system\nAnswer with a number.<|im_end|>\n"
                                     "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n")
    assert max(ids) < len(tokenizer) <= config.vocab_size


def test_the_chat_template_renders_messages_with_and_without_tools():
    tokenizer = build_chat_tokenizer()
    plain = tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert "<tools>" not in plain and plain.endswith("<|im_start|>assistant\n")
    # Without a system message there is none (Qwen2.5 would add its default one): prompts stay short.
    assert tokenizer.apply_chat_template(CHAT[1:], tokenize=False) == "<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n"

    for tools in ([add], [{"type": "function", "function": {"name": "add", "description": "Add two numbers",
                                                           "parameters": {"type": "object", "properties": {}}}}]):
        text = tokenizer.apply_chat_template(CHAT, tools=tools, tokenize=False, add_generation_prompt=True)
        system = text.split("<|im_end|>")[0]
        assert system.startswith("<|im_start|>system\nAnswer with a number.\n\n# Tools")
        schema = json.loads(system.split("<tools>\n")[1].split("\n</tools>")[0])
        assert schema["function"]["name"] == "add" and "<tool_call>" in system
        assert text.endswith("<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n")

    calls = [{"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]
    turns = CHAT + [{"role": "assistant", "content": "", "tool_calls": calls}, {"role": "tool", "content": "5"},
                    {"role": "tool", "content": "ok"}, {"role": "assistant", "content": "The answer is 5."}]
    text = tokenizer.apply_chat_template(turns, tools=[add], tokenize=False)
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
            '<|im_end|>\n<|im_start|>user\n<tool_response>\n5\n</tool_response>\n<tool_response>\nok\n'
            '</tool_response><|im_end|>\n<|im_start|>assistant\nThe answer is 5.<|im_end|>\n') in text
    # A tool call is two single tokens that decoding keeps (a reward reads it); the text round-trips.
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(ids) == text
    call_ids = tokenizer.convert_tokens_to_ids(TOOL_TOKENS)
    assert [ids.count(i) for i in call_ids] == [3, 3]  # twice in the system turn's format lines, once in the call
    assert "<tool_call>" in tokenizer.decode(ids, skip_special_tokens=True)


HUB_LINE = ("config error: model.path: Qwen/Qwen2.5-0.5B-Instruct is not a local folder, and fastrlhf reads models "
            "from local folders only (no model hub): download it first with `hf download Qwen/Qwen2.5-0.5B-Instruct "
            "--local-dir models/Qwen2.5-0.5B-Instruct` (huggingface-cli download on huggingface_hub < 1.0), then set "
            f"model.path: models/Qwen2.5-0.5B-Instruct; no folder {ROOT}/Qwen/Qwen2.5-0.5B-Instruct exists either")


def test_a_hub_id_is_refused_in_one_line_naming_the_download_command(tiny_chat, tmp_path):
    code, out = run_group([sys.executable, "-m", "fastrlhf", "train", "--config", "examples/grpo.yaml",
                           "--set", "model.path=Qwen/Qwen2.5-0.5B-Instruct", "--set", f"output_dir={tmp_path}/run"],
                          timeout=120)
    assert code == 2, out
    assert out.strip().splitlines()[-1] == HUB_LINE, out

    from fastrlhf.config import ConfigError, parse_config

    def error(**raw):
        base = {"algorithm": "grpo", "output_dir": "run", "model": {"path": tiny_chat},
                "reward": {"function": "length"}, "data": {"prompts": "prompts.jsonl"}, "trainer": {"max_steps": 1}}
        with pytest.raises(ConfigError) as info:
            parse_config({**base, **raw}, "train", base_dir=str(tmp_path))
        return str(info.value)

    (tmp_path / "prompts.jsonl").write_text('{"prompt_ids": [5, 6]}\n')
    # Every model key. A missing folder whose parent is here is only missing ("runs" is here, "Qwen" is not).
    assert error(reference={"path": "org/m"}).startswith("reference.path: org/m is not a local folder")
    assert "`hf download org/m --local-dir models/m`" in error(reward={"model_path": "org/m"})
    (tmp_path / "runs").mkdir()
    assert error(model={"path": "runs/nope"}) == "model.path: path does not exist: runs/nope"


def gsm8k_rows(path) -> str:
    """Four GSM8K-style lines converted to the GPU examples' chat rows (examples/gpu/gsm8k.py)."""
    from examples.gpu.gsm8k import convert

    lines = [{"question": f"Tom has {a} apples and buys {b} more. How many now?", "answer": f"{a}+{b}={a + b}\n#### "
              f"{a + b}"} for a, b in [(2, 3), (7, 5), (4, 4), (9, 1)]]
    raw = path.with_suffix(".raw.jsonl")
    raw.write_text("".join(json.dumps(line) + "\n" for line in lines))
    convert(str(raw), str(path))
    return str(path)


def cpu_try() -> list[str]:
    """The ``--set`` overrides docs/gpu.md gives for a first CPU run of a GPU example (model.path aside)."""
    text = open(os.path.join(ROOT, "docs", "gpu.md")).read().replace("\\\n", " ")
    (command,) = [line for line in text.splitlines() if line.startswith("fastrlhf train --config examples/gpu/")]
    return [s for s in re.findall(r"--set (\S+)", command) if not s.startswith("model.path=")]


@pytest.mark.slow
@pytest.mark.parametrize("example", sorted(glob.glob(os.path.join(ROOT, "examples", "gpu", "*.yaml"))),
                         ids=os.path.basename)
def test_every_example_that_needs_a_tokenizer_runs_from_the_tiny_chat_model(example, tiny_chat, tmp_path):
    """The GPU examples (chat rows, a reward on text; PPO also a reward model) for one step on the CPU, their
    model the tiny chat one; examples/arithmetic makes its own with the same builders."""
    overrides = [f"model.path={tiny_chat}", f"data.prompts={gsm8k_rows(tmp_path / 'rows.jsonl')}",
                 f"output_dir={tmp_path / 'run'}", *cpu_try()]
    if "ppo" in os.path.basename(example):  # a reward model is a *ForSequenceClassification: the tiny one's backbone
        from transformers import AutoModelForSequenceClassification

        AutoModelForSequenceClassification.from_pretrained(tiny_chat, num_labels=1).save_pretrained(tmp_path / "rm")
        overrides.append(f"reward.model_path={tmp_path / 'rm'}")
    argv = [sys.executable, "-m", "fastrlhf", "train", "--config", example]
    code, out = run_group([*argv, *(w for o in overrides for w in ("--set", o))], timeout=400,
                          env={k: v for k, v in launch_env().items() if k != "OMP_NUM_THREADS"})
    assert code == 0, out[-4000:]
    assert "Chat template warmup failed" not in out  # vLLM's start without a tokenizer, silenced
    metrics = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert [m["step"] for m in metrics] == [1] and "reward/correctness" in metrics[0]
    assert os.path.exists(tmp_path / "run" / "final" / "tokenizer.json")
