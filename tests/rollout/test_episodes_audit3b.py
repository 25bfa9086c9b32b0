"""Audit 3b of the episode loop: an environment that fails to start on one rank stops every rank alike, in one line
(before: the other ranks went on into their next collective and waited there), and an assistant message states
its tool calls once, in ``tool_calls`` (before: its ``content`` kept them too, so the chat template rendered them
twice)."""

from __future__ import annotations

import copy
import json

import pytest

from fastrlhf.rollout import SamplingConfig
from fastrlhf.rollout.episodes import EpisodeRunner
from fastrlhf.rollout.tools import EnvironmentResetError, load_toolbox
from tests.helpers.episode_ranks import FAILS_TO_START as ENVIRONMENT
from tests.helpers.tool_fixtures import ScriptedEngine

ADD = "tests.helpers.tool_fixtures:add"


def ids(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def call(name, **arguments) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def chat_prompt(tokenizer, toolbox, question: str) -> list[int]:
    return ids(
        tokenizer,
        tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], tools=toolbox.schemas, tokenize=False, add_generation_prompt=True
        ),
    )


def episode(tokenizer, turns: list[str], tools=(ADD,), environment=None, metas=None, n=1):
    toolbox = load_toolbox(list(tools), environment, timeout_s=2.0)
    q = "What is 2 plus 4?"
    runner = EpisodeRunner(ScriptedEngine(tokenizer, {q: turns}), toolbox, tokenizer, 4, say=None)
    prompt = chat_prompt(tokenizer, toolbox, q)
    (completions,) = runner.generate([prompt], SamplingConfig(n=n, max_new_tokens=300, seed=3), metas)
    return completions, toolbox, q, prompt


# ---------------------------------------------------------------- an environment that fails to start


def test_an_environment_that_fails_to_start_on_one_rank_stops_every_rank_alike_in_one_line():
    """Rank 1's reset raised and rank 1 alone stopped; rank 0 went on into the next collective and ended on a
    'Connection closed by peer' from gloo (or, where the failed rank lingers, the collective timeout), and no
    checkpoint of the last good step was kept (the error was no StepFailed)."""
    from tests.helpers.episode_ranks import assert_every_rank_ended_alike, episode_rank

    said = (
        "rollout.environment: FailsWhenAsked reset() raised ConnectionError: the sandbox refused the connection "
        "(prompt 0 of the rollout batch on rank 1)"
    )
    assert_every_rank_ended_alike(episode_rank, "EnvironmentResetError", said)


def test_a_reset_failure_is_a_step_failure_so_the_loop_keeps_the_last_good_step(tokenizer):
    """A RuntimeError before: ``fastrlhf.engine.loop.run_steps`` keeps the last good step's checkpoint, and the
    trainer rewinds the step's prompts for --resume, for a StepFailed only; a reset that failed at step 2 of a run
    saving every 10 steps lost step 1 (checked with ``fastrlhf train``: no checkpoint before, ``step-1`` now)."""
    from fastrlhf.engine.guards import StepFailed

    with pytest.raises(StepFailed) as info:
        episode(tokenizer, ["Done."], tools=(), environment=ENVIRONMENT, metas=[{"fail": True}])
    assert isinstance(info.value, EnvironmentResetError) and info.value.exit_code == 1 and info.value.local
    assert info.value.summary == str(info.value) and "FailsWhenAsked reset() raised ConnectionError" in str(info.value)


def test_the_agreement_is_one_small_collective_per_rollout_with_an_environment_and_none_without(tokenizer, monkeypatch):
    """Its cost: one all-reduce of ``world`` floats per generate call (not per turn or per episode) where there
    is an environment; none with plain tool functions, which cannot fail to start."""
    from fastrlhf.distributed import comm

    sent = []
    monkeypatch.setattr(comm, "is_distributed", lambda: True)
    monkeypatch.setattr(comm, "reduce_floats", lambda values, op="sum": sent.append(list(values)) or list(values))
    turns = [call("add", a=2, b=4), call("add", a=1, b=1), "The answer is 6."]
    completions, *_ = episode(tokenizer, turns, n=2)
    assert sent == [] and completions[0].extra["turns"] == 3
    completions, *_ = episode(tokenizer, turns, environment=ENVIRONMENT, n=2)
    assert sent == [[0.0]] and [c.extra["turns"] for c in completions] == [3, 3]


def test_reset_text_for_a_row_that_is_not_a_chat_fails_the_step_alike_as_a_data_mistake(tokenizer):
    """A reset that returns text for rows given as token ids raised a ValueError: not agreed (a reset may return
    text for some rows only, so on some ranks only) and no StepFailed. Now an EnvironmentResetError, exit code 2:
    wrong as written, --resume would fail the same way."""
    with pytest.raises(EnvironmentResetError) as info:
        episode(tokenizer, ["Done."], tools=(), environment="tests.helpers.tool_fixtures:Counter", metas=[{}])
    assert info.value.exit_code == 2 and "are not chats" in info.value.summary and "\n" not in str(info.value)


# ---------------------------------------------------------------- an assistant message's tool calls, once


def rerendered(tokenizer, toolbox, q: str, prompt: list[int], completion) -> tuple[str, str]:
    """(the conversation as the reward functions receive it, rendered by the chat template; the tokens generated)"""
    conversation = [{"role": "user", "content": q}] + completion.extra["messages"]
    text = tokenizer.apply_chat_template(conversation, tools=toolbox.schemas, tokenize=False)
    return text.rstrip("\n"), tokenizer.decode(prompt + completion.token_ids, skip_special_tokens=False)


def test_an_assistant_message_states_its_tool_call_once_as_trl_parses_a_turn(tokenizer):
    """TRL's parse_response: content is what the model said besides its calls, tool_calls holds them. The content
    kept the <tool_call> block too, so the template rendered the call twice."""
    first = "I will add them.\n" + call("add", a=2, b=4) + "\n" + call("add", a=1, b=2)
    (c,), toolbox, q, prompt = episode(tokenizer, [first, "The answer is 6."])
    message = c.extra["messages"][0]
    assert message["content"] == "I will add them."
    assert [t["function"] for t in message["tool_calls"]] == [
        {"name": "add", "arguments": {"a": 2, "b": 4}},
        {"name": "add", "arguments": {"a": 1, "b": 2}},
    ]
    text, generated = rerendered(tokenizer, toolbox, q, prompt, c)
    assert text == generated and text.count('"arguments": {"a": 2, "b": 4}') == 1


def test_a_malformed_call_stays_in_the_content_and_a_turn_of_calls_alone_has_empty_content(tokenizer):
    broken = '<tool_call>\n{"name": "add", "arguments": \n</tool_call>'
    (c,), *_ = episode(tokenizer, [call("add", a=2, b=4), f"Retry.\n{broken}", "The answer is 6."])
    made, malformed = c.extra["messages"][0], c.extra["messages"][2]
    assert made["content"] == "" and len(made["tool_calls"]) == 1
    assert malformed["content"] == f"Retry.\n{broken}" and malformed["tool_calls"] == []


def test_a_call_drafted_while_thinking_stays_in_the_content_the_one_made_after_does_not(tokenizer):
    made = call("add", a=2, b=4)
    turn = f"<think>\nmaybe {made}\n</think>\n\n{made}"
    (c,), *_ = episode(tokenizer, [turn, "The answer is 6."])
    message = c.extra["messages"][0]
    assert message["content"] == f"<think>\nmaybe {made}\n</think>" and len(message["tool_calls"]) == 1


def test_call_tags_that_are_special_tokens_leave_the_content_too(tokenizer):
    """A tokenizer may make <tool_call> a special token: the content (decoded without special tokens) has the
    call's JSON without its tags, and loses that."""
    special = copy.deepcopy(tokenizer)
    special.add_special_tokens({"additional_special_tokens": ["<tool_call>", "</tool_call>"]})
    assert "<tool_call>" not in special.decode(ids(special, call("add", a=2, b=4)), skip_special_tokens=True)
    (c,), *_ = episode(special, ["I will add.\n" + call("add", a=2, b=4), "The answer is 6."])
    message = c.extra["messages"][0]
    assert message["content"] == "I will add." and len(message["tool_calls"]) == 1
