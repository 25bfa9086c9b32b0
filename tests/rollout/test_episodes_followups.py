"""Follow-ups to the episode audit: an environment's reset runs under the tools' timeout, and later turns open with
the header the prompts were rendered with (Qwen3's ``enable_thinking``)."""

from __future__ import annotations

import json
import time

import pytest

from fastrlhf.rollout import SamplingConfig
from fastrlhf.rollout.episodes import EpisodeRunner
from fastrlhf.rollout.tools import load_toolbox
from tests.helpers.tool_fixtures import ScriptedEngine

ENVS = "tests.helpers.episodes3_environments"


def ids(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def call(name, **arguments) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def chat_prompt(tokenizer, toolbox, question: str, **kwargs) -> list[int]:
    messages = [{"role": "user", "content": question}]
    return ids(
        tokenizer,
        tokenizer.apply_chat_template(
            messages, tools=toolbox.schemas, tokenize=False, add_generation_prompt=True, **kwargs
        ),
    )


@pytest.mark.parametrize(
    "environment, said",
    [("HangingReset", "reset() did not return within 0.5 s"), ("FailingReset", "reset() raised KeyError: 'task_id'")],
)
def test_an_environment_reset_that_hangs_or_raises_fails_the_rollout_in_one_line_naming_it(
    tokenizer, environment, said
):
    """reset() ran with no timeout: one that hung (a sandbox that never came up) hung the rollout, and every other
    rank in its next collective; one that raised gave a bare KeyError naming neither the environment nor the row."""
    from fastrlhf.rollout.tools import EnvironmentResetError

    toolbox = load_toolbox([], f"{ENVS}:{environment}", timeout_s=0.5)
    q = "Poke it."
    runner = EpisodeRunner(ScriptedEngine(tokenizer, {q: ["Done."]}), toolbox, tokenizer, 4, say=None)
    start = time.monotonic()
    with pytest.raises(EnvironmentResetError) as info:
        runner.generate([chat_prompt(tokenizer, toolbox, q)], SamplingConfig(n=2, max_new_tokens=50, seed=1))
    assert time.monotonic() - start < 5.0
    message = str(info.value)
    assert message.startswith(f"rollout.environment: {environment} {said}") and "prompt 0" in message
    assert "\n" not in message and ("rollout.tool_timeout_s" in message) == (environment == "HangingReset")


def test_an_environment_that_resets_in_time_still_appends_its_text(tokenizer):
    toolbox = load_toolbox([], "tests.helpers.tool_fixtures:Counter", timeout_s=2.0)
    environment, extra = toolbox.new_environment({"start": 4})
    assert extra == " (the counter starts at 4)" and environment.increment(1) == "5"
    assert load_toolbox(["tests.helpers.tool_fixtures:add"]).new_environment({"start": 4}) == (None, None)


def test_qwen3_without_thinking_opens_every_turn_with_the_empty_think_block_as_its_first(qwen3):
    """The turns after a tool turn were rendered without the prompt's chat template arguments: with Qwen3's
    ``enable_thinking=False`` the first turn opened ``<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n`` and the
    later ones ``<|im_start|>assistant\\n``, so the policy was trained thinking from its second turn on. Each later
    turn now opens exactly as the template's own generation prompt for the conversation so far."""
    toolbox = load_toolbox(["tests.helpers.tool_fixtures:add"])
    q = "What is 2 plus 4?"
    first, last = call("add", a=2, b=4), "The answer is 6."
    kwargs = {"enable_thinking": False}
    prompt = chat_prompt(qwen3, toolbox, q, **kwargs)
    said: list[str] = []
    runner = EpisodeRunner(
        ScriptedEngine(qwen3, {q: [first, last]}), toolbox, qwen3, 4, say=said.append, chat_template_kwargs=kwargs
    )
    ((c,),) = runner.generate([prompt], SamplingConfig(max_new_tokens=200, seed=1))
    conversation = [
        {"role": "user", "content": q},
        {"role": "assistant", "content": first},
        {"role": "tool", "name": "add", "content": "6"},
    ]
    before_last = qwen3.apply_chat_template(
        conversation, tools=toolbox.schemas, tokenize=False, add_generation_prompt=True, **kwargs
    )
    text = qwen3.decode(prompt + c.token_ids, skip_special_tokens=False)
    # Turn 1 keeps its empty think block (the prompt's): the template drops it on re-rendering, tokens do not.
    tool_turn_and_header = before_last.split(first, 1)[1]
    assert text == qwen3.decode(prompt, skip_special_tokens=False) + first + tool_turn_and_header + last + "<|im_end|>"
    assert text.count("<|im_start|>assistant\n<think>\n\n</think>\n\n") == 2
    assert not any("chat template arguments" in line for line in said)


def test_prompts_rendered_with_other_template_arguments_are_reported_once(qwen3):
    """Prompts rendered without thinking (token-id rows, or a data pipeline that passed enable_thinking) and an
    episode runner that was not told: said once, naming the two headers."""
    toolbox = load_toolbox(["tests.helpers.tool_fixtures:add"])
    q = "What is 2 plus 4?"
    prompt = chat_prompt(qwen3, toolbox, q, enable_thinking=False)
    said: list[str] = []
    runner = EpisodeRunner(ScriptedEngine(qwen3, {q: ["The answer is 6."]}), toolbox, qwen3, 4, say=said.append)
    for _ in range(2):
        runner.generate([prompt], SamplingConfig(max_new_tokens=50, seed=1))
    warnings = [line for line in said if "chat template arguments" in line]
    assert len(warnings) == 1 and "'<|im_start|>assistant\\n'" in warnings[0] and "</think>" in warnings[0]
    # Prompts rendered as the episodes are: nothing said.
    said.clear()
    runner = EpisodeRunner(ScriptedEngine(qwen3, {q: ["The answer is 6."]}), toolbox, qwen3, 4, say=said.append)
    runner.generate([chat_prompt(qwen3, toolbox, q)], SamplingConfig(max_new_tokens=50, seed=1))
    assert not any("chat template arguments" in line for line in said)


def test_a_tool_call_drafted_while_thinking_is_not_made_one_after_thinking_is(qwen3):
    """Calls were parsed from the whole turn, reasoning included: a Qwen3 turn that drafted a call in its ``<think>``
    block and then answered got a tool response and a second turn it never asked for. vLLM's chat server (reasoning
    parser, then tool parser on the content) makes no call there, so the policy was trained on another protocol."""
    toolbox = load_toolbox(["tests.helpers.tool_fixtures:add"])
    q = "What is 2 plus 4?"
    drafted = f"<think>\nI could write {call('add', a=2, b=4)} but 2 + 4 is easy.\n</think>\n\nThe answer is 6."
    made = f"<think>\nLet me add.\n</think>\n\n{call('add', a=2, b=4)}"
    for first, turns, calls in [(drafted, 1, 0), (made, 2, 1)]:
        runner = EpisodeRunner(ScriptedEngine(qwen3, {q: [first, "The answer is 6."]}), toolbox, qwen3, 4, say=None)
        ((c,),) = runner.generate([chat_prompt(qwen3, toolbox, q)], SamplingConfig(max_new_tokens=300, seed=1))
        assert (c.extra["turns"], c.extra["tool_calls"], c.extra["stopped_by"]) == (turns, calls, "answer")
