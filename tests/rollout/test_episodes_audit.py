"""Audit of the multi-turn episode loop: real chat templates (Qwen3's), the exact tokens between turns and the
limits an episode runs under."""

from __future__ import annotations

import copy
import json

from fastrlhf.rollout import SamplingConfig
from fastrlhf.rollout.episodes import EpisodeRunner
from fastrlhf.rollout.tools import load_toolbox
from tests.helpers.tool_fixtures import ScriptedEngine

H = "tests.helpers.tool_fixtures"


def call(name, **arguments) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def ids(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def episode(tokenizer, script, max_new_tokens=200, max_turns=4, max_model_len=1024, n=1):
    toolbox = load_toolbox([f"{H}:add"])
    engine = ScriptedEngine(tokenizer, script, max_model_len)
    runner = EpisodeRunner(engine, toolbox, tokenizer, max_turns, say=None)
    prompts = [
        ids(
            tokenizer,
            tokenizer.apply_chat_template(
                [{"role": "user", "content": q}], tools=toolbox.schemas, tokenize=False, add_generation_prompt=True
            ),
        )
        for q in script
    ]
    sampling = SamplingConfig(n=n, temperature=1.0, max_new_tokens=max_new_tokens, seed=3)
    return runner.generate(prompts, sampling), runner, engine, prompts


def test_a_qwen3_template_runs_episodes_and_the_turns_between_are_its_tool_turn(qwen3):
    """Qwen3's template renders the last assistant message with an empty think block and an earlier one without:
    reading the tool turn by cutting the conversation where the assistant was last refused it at start-up."""
    q = "What is 2 plus 4?"
    first, last = call("add", a=2, b=4), "The answer is 6."
    (episodes,), runner, _, (prompt,) = episode(qwen3, {q: [first, last]})
    c, eos = episodes[0], qwen3.eos_token_id
    between = ids(qwen3, "\n<|im_start|>user\n<tool_response>\n6\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    assert c.token_ids == ids(qwen3, first) + [eos] + between + ids(qwen3, last) + [eos]
    assert c.mask == [1] * (len(ids(qwen3, first)) + 1) + [0] * len(between) + [1] * (len(ids(qwen3, last)) + 1)
    assert not runner.template.prefix_preserving and c.finish_reason == "stop" and c.extra["turns"] == 2


def test_a_call_whose_tags_are_special_tokens_is_still_run(tokenizer):
    """A tokenizer may make ``<tool_call>``/``</tool_call>`` special tokens; the turn was parsed from text decoded
    without them, so the call was never seen: the episode ended after its first turn as if it had answered."""
    t = copy.deepcopy(tokenizer)
    t.add_special_tokens({"additional_special_tokens": ["<tool_call>", "</tool_call>"]})
    q = "What is 2 plus 4?"
    (episodes,), runner, _, _ = episode(t, {q: [call("add", a=2, b=4), "The answer is 6."]})
    c = episodes[0]
    assert c.extra["turns"] == 2 and c.extra["tool_calls"] == 1 and runner.metrics["tools/errors"] == 0.0
    assert c.extra["messages"][1] == {"role": "tool", "name": "add", "content": "6"}


class StopTokenEngine(ScriptedEngine):
    """The scripted policy on a model whose eos is ``<|endoftext|>``: its turns end at ``<|im_end|>`` because the
    run lists it in ``rollout.stop_token_ids`` (a base model trained on ChatML, an old Llama-3 generation config)."""

    def __init__(self, tokenizer, script):
        super().__init__(tokenizer, script)
        self.im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.eos_token_ids = [tokenizer.convert_tokens_to_ids("<|endoftext|>")]

    def _turn(self, prompt, cap):
        turn = super()._turn(prompt, cap)
        turn.token_ids[-1] = self.im_end
        return turn


def test_a_turn_ended_by_a_stop_token_id_does_not_get_its_end_of_turn_token_twice(tokenizer):
    """The tokens between turns start with the rest of the template's closing after the token the turn ended on;
    that was only looked for among the model's eos ids, so a turn stopped by ``<|im_end|>`` as a stop token id was
    followed by a second ``<|im_end|>`` the template never writes, and the policy's next turn was conditioned on it."""
    toolbox = load_toolbox([f"{H}:add"])
    q = "What is 2 plus 4?"
    first, last = call("add", a=2, b=4), "The answer is 6."
    engine = StopTokenEngine(tokenizer, {q: [first, last]})
    runner = EpisodeRunner(engine, toolbox, tokenizer, 4, say=None)
    prompt = ids(
        tokenizer,
        tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], tools=toolbox.schemas, tokenize=False, add_generation_prompt=True
        ),
    )
    sampling = SamplingConfig(max_new_tokens=200, seed=3, stop_token_ids=(engine.im_end,))
    ((c,),) = runner.generate([prompt], sampling)
    conversation = [
        {"role": "user", "content": q},
        {"role": "assistant", "content": first},
        {"role": "tool", "name": "add", "content": "6"},
        {"role": "assistant", "content": last},
    ]
    rendered = tokenizer.apply_chat_template(conversation, tools=toolbox.schemas, tokenize=False)
    assert tokenizer.decode(prompt + c.token_ids, skip_special_tokens=False) == rendered.rstrip("\n")
    assert c.token_ids.count(engine.im_end) == 3 and sum(c.mask) == len(ids(tokenizer, first + last)) + 2


def test_tools_that_time_out_in_many_episodes_hold_the_round_for_one_timeout_per_call_not_per_episode(tokenizer):
    """Tool calls ran one episode after another: a tool that times out every call kept a rank busy for
    episodes x calls x tool_timeout_s (64 episodes x 2 calls x 5 s x 4 turns: 43 min, past the other ranks' 30 min
    collective timeout). Each episode's calls now run beside the others'."""
    import time

    toolbox = load_toolbox([f"{H}:sleepy"], timeout_s=0.5)
    q = "Sleep please."
    twice = call("sleepy", seconds=30) * 2
    runner = EpisodeRunner(ScriptedEngine(tokenizer, {q: [twice, "Done."]}), toolbox, tokenizer, 4, say=None)
    prompt = ids(
        tokenizer,
        tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], tools=toolbox.schemas, tokenize=False, add_generation_prompt=True
        ),
    )
    start = time.monotonic()
    (samples,) = runner.generate([prompt], SamplingConfig(n=8, max_new_tokens=200, seed=1))
    elapsed = time.monotonic() - start
    assert runner.metrics["tools/timeouts"] == 16.0 and all(c.extra["turns"] == 2 for c in samples)
    assert elapsed < 3.0, f"8 episodes x 2 timed-out calls of 0.5 s took {elapsed:.1f} s"
    # Each episode's tool messages are its own calls', in order.
    assert all([m["role"] for m in c.extra["messages"]] == ["assistant", "tool", "tool", "assistant"] for c in samples)


def test_an_async_tool_is_awaited_and_times_out_like_any_other():
    """TRL takes ``async def`` tools; one was called without being awaited, so every call was the error "returned
    coroutine, expected str" (and a "never awaited" warning), whatever the policy asked."""
    from fastrlhf.rollout.tools import ERROR, OK, TIMEOUT, ToolCall, run_tool_call

    tools = load_toolbox(["tests.helpers.episodes_tools:add_async", "tests.helpers.episodes_tools:sleepy_async"])
    bound = tools.bound(None)
    assert run_tool_call(ToolCall("add_async", {"a": 2, "b": 4}), bound, 2.0) == ("6", OK)
    assert run_tool_call(ToolCall("sleepy_async", {"seconds": 30}), bound, 0.2)[1] == TIMEOUT
    assert run_tool_call(ToolCall("add_async", {"a": 2}), bound, 2.0)[1] == ERROR
