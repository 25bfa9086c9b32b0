"""The multi-turn episode loop (fastrlhf.rollout.episodes) on a scripted policy: exact tokens and masks, every
bad tool input, early finishers, max_turns, the token budget, TRL-style environments."""

from __future__ import annotations

import json

import pytest

from fastrlhf.rollout import SamplingConfig
from fastrlhf.rollout.episodes import PREFIX_CACHE_HIT, EpisodeRunner, TurnTemplate
from fastrlhf.rollout.tools import load_toolbox, parse_hermes
from tests.helpers.tool_fixtures import ScriptedEngine

H = "tests.helpers.tool_fixtures"


def call(name, **arguments) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


def prompt_ids(tokenizer, toolbox, question: str) -> list[int]:
    text = tokenizer.apply_chat_template([{"role": "user", "content": question}], tools=toolbox.schemas or None,
                                         tokenize=False, add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def run(tokenizer, script, tools=(f"{H}:add",), environment=None, n=1, max_new_tokens=200, max_turns=4,
        timeout=2.0, metas=None, max_model_len=1024):
    toolbox = load_toolbox(list(tools), environment, timeout_s=timeout)
    engine = ScriptedEngine(tokenizer, script, max_model_len)
    runner = EpisodeRunner(engine, toolbox, tokenizer, max_turns, say=None)
    prompts = [prompt_ids(tokenizer, toolbox, q) for q in script]
    sampling = SamplingConfig(n=n, temperature=1.0, max_new_tokens=max_new_tokens, seed=3)
    return runner.generate(prompts, sampling, metas), runner, engine, prompts


def test_an_episode_is_the_policys_own_tokens_and_the_template_turns_between_them(tokenizer):
    q = "What is 2 plus 4?"
    first, last = call("add", a=2, b=4), "The answer is 6."
    (episodes,), runner, _, (prompt,) = run(tokenizer, {q: [first, last]})
    c = episodes[0]
    ids = lambda text: list(tokenizer(text, add_special_tokens=False)["input_ids"])  # noqa: E731
    eos = tokenizer.eos_token_id
    # Built by hand: generated turn 1 + eos, the template's text up to the next assistant turn, turn 2 + eos.
    between = ids("\n<|im_start|>user\n<tool_response>\n6\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    expected = ids(first) + [eos] + between + ids(last) + [eos]
    assert c.token_ids == expected
    assert c.mask == [1] * (len(ids(first)) + 1) + [0] * len(between) + [1] * (len(ids(last)) + 1)
    assert [lp for lp, m in zip(c.logprobs, c.mask, strict=True) if m] == [-0.25] * sum(c.mask)
    assert all(lp == 0.0 for lp, m in zip(c.logprobs, c.mask, strict=True) if not m)
    # ... and it is exactly the conversation as the chat template renders it.
    conversation = [{"role": "user", "content": q}, {"role": "assistant", "content": first},
                    {"role": "tool", "name": "add", "content": "6"}, {"role": "assistant", "content": last}]
    rendered = tokenizer.apply_chat_template(conversation, tools=runner.toolbox.schemas, tokenize=False)
    assert tokenizer.decode(prompt + c.token_ids, skip_special_tokens=False) == rendered.rstrip("\n")
    assert c.finish_reason == "stop" and c.extra["turns"] == 2 and c.extra["tool_calls"] == 1
    assert c.extra["messages"][1] == {"role": "tool", "name": "add", "content": "6"}
    assert c.extra["messages"][0]["tool_calls"][0]["function"] == {"name": "add", "arguments": {"a": 2, "b": 4}}
    assert runner.metrics == {"tools/calls": 1.0, "tools/errors": 0.0, "tools/timeouts": 0.0, "tools/turns": 2.0,
                              "tools/calls_per_episode": 1.0}


BAD_CALLS = {
    "raises": (call("explode", x=1), "Error: explode raised RuntimeError: boom", "errors"),
    "bad json": ('<tool_call>\n{"name": "add", "arguments": {a: 1}}\n</tool_call>', "not valid JSON", "errors"),
    "unknown tool": (call("nope", a=1), "Error: unknown tool 'nope'", "errors"),
    "wrong arguments": (call("add", a=1, c=2), "Error: wrong arguments for add", "errors"),
    "hangs": (call("sleepy", seconds=30), "Error: sleepy did not return within 0.3 s", "timeouts"),
    "not a string": (call("number", x=5), "Error: number returned int, expected str: 5", "errors"),
}


@pytest.mark.parametrize("case", list(BAD_CALLS))
def test_bad_tool_input_becomes_a_tool_message_and_is_counted(tokenizer, case):
    text, says, counter = BAD_CALLS[case]
    tools = [f"{H}:{name}" for name in ("add", "explode", "sleepy", "number")]
    (episodes,), runner, _, _ = run(tokenizer, {"Q?": [text, "Sorry."]}, tools=tools, timeout=0.3)
    c = episodes[0]
    tool_message = c.extra["messages"][1]
    assert tool_message["role"] == "tool" and says in tool_message["content"]
    assert c.extra["turns"] == 2 and c.finish_reason == "stop"  # the episode went on after the error
    assert runner.metrics[f"tools/{counter}"] == 1.0 and runner.metrics["tools/calls"] == 1.0
    other = "timeouts" if counter == "errors" else "errors"
    assert runner.metrics[f"tools/{other}"] == 0.0


def test_finished_episodes_leave_the_batch_and_n_samples_share_the_first_request(tokenizer):
    script = {"A?": ["The answer is 1."], "B?": [call("add", a=1, b=1), call("add", a=2, b=2), "Done."]}
    (a, b), runner, engine, _ = run(tokenizer, script, n=2)
    assert [x["batch"] for x in engine.calls] == [2, 2, 2]  # round 0: 2 prompts x n=2; then B's 2 episodes
    assert [x["n"] for x in engine.calls] == [2, 1, 1]
    # Round 0 is the run's seeded request; then each episode's turn has a seed of its own.
    later = [s for x in engine.calls[1:] for s in x["seeds"]]
    assert engine.calls[0]["seeds"] is None and len(later) == len(set(later)) == 4
    assert [c.extra["turns"] for c in a] == [1, 1] and [c.extra["turns"] for c in b] == [3, 3]
    assert runner.metrics["tools/turns"] == 2.0 and runner.metrics["tools/calls"] == 4.0


def test_max_turns_ends_an_episode_that_keeps_calling(tokenizer):
    (episodes,), runner, engine, _ = run(tokenizer, {"Q?": [call("add", a=1, b=1)]}, max_turns=3)
    c = episodes[0]
    assert c.extra["turns"] == 3 and c.extra["tool_calls"] == 2  # the third turn's call is not run
    assert c.finish_reason == "length" and c.extra["stopped_by"] == "max_turns"
    assert sum(c.mask) == 3 * (len(tokenizer(call("add", a=1, b=1))["input_ids"]) + 1)
    assert len(engine.calls) == 3


def test_the_token_budget_counts_every_turn_and_caps_each_request(tokenizer):
    turn = call("add", a=1, b=1)
    per_turn = len(tokenizer(turn, add_special_tokens=False)["input_ids"]) + 1
    budget = 2 * per_turn + 3
    (episodes,), _, engine, _ = run(tokenizer, {"Q?": [turn, turn, "The answer is 2."]}, max_new_tokens=budget)
    c = episodes[0]
    assert sum(c.mask) == budget and c.finish_reason == "length" and c.extra["stopped_by"] == "budget"
    assert engine.calls[1]["limits"] == [budget - per_turn] and engine.calls[2]["limits"] == [3]


def test_the_models_context_ends_an_episode_before_it_overflows(tokenizer):
    turn = call("add", a=1, b=1)
    script = {"Q?": [turn, turn, turn, "x"]}
    toolbox = load_toolbox([f"{H}:add"])
    prompt = prompt_ids(tokenizer, toolbox, "Q?")
    context = len(prompt) + 60
    (episodes,), _, engine, _ = run(tokenizer, script, max_model_len=context)
    c = episodes[0]
    assert len(prompt) + len(c.token_ids) <= context and c.finish_reason == "length"
    later = engine.calls[1:]
    assert later and all(n + cap <= context for x in later for n, cap in zip(x["lengths"], x["limits"], strict=True))


def test_a_trl_environment_class_is_used_unchanged(tokenizer):
    from fastrlhf.data import Columns
    from fastrlhf.rl.rewards import RewardScorer

    q = "Count up."
    metas = [Columns({"start": 5}, [{"role": "user", "content": q}])]
    script = {q: [call("increment", by=2), call("increment", by=3), "Done."]}
    (episodes,), runner, _, (prompt,) = run(tokenizer, script, tools=(), environment=f"{H}:Counter", n=2,
                                            metas=metas)
    assert runner.toolbox.names == ["increment"]
    for c in episodes:
        text = tokenizer.decode(c.prompt_ids, skip_special_tokens=False)
        assert "Count up. (the counter starts at 5)" in text  # reset's string joins the last user message
        assert [m["content"] for m in c.extra["messages"] if m["role"] == "tool"] == ["7", "10"]
    assert episodes[0].extra["environment"] is not episodes[1].extra["environment"]  # one instance per episode
    scorer = RewardScorer(environment_reward="Counter")
    scores = scorer(None, [prompt] * 2, [c.token_ids for c in episodes], [{}] * 2,
                    environments=[c.extra["environment"] for c in episodes])
    assert scores.tolist() == [10.0, 10.0] and scorer.metrics["reward/Counter"] == 10.0


def test_text_rewards_receive_the_whole_conversation_as_trl_passes_it(tokenizer):
    from fastrlhf.data import Columns
    from fastrlhf.rl.rewards import RewardScorer, TextReward, completion_text

    seen = {}

    def reward(prompts, completions, completion_ids, **kw):
        seen["completions"] = completions
        return [float(completion_text(c) == "The answer is 6.") for c in completions]

    q = "What is 2 plus 4?"
    (episodes,), _, _, (prompt,) = run(tokenizer, {q: [call("add", a=2, b=4), "The answer is 6."]})
    c = episodes[0]
    scorer = RewardScorer(text_rewards=[TextReward("reward", reward)], tokenizer=tokenizer)
    meta = Columns({}, [{"role": "user", "content": q}])
    scores = scorer(None, [prompt], [c.token_ids], [meta], conversations=[c.extra["messages"]])
    assert scores.tolist() == [1.0]
    assert [m["role"] for m in seen["completions"][0]] == ["assistant", "tool", "assistant"]


def test_hermes_parser_reads_calls_and_says_what_is_wrong():
    text = 'a <tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call> b <tool_call>{"name": "g"'
    good, bad = parse_hermes(text)
    assert (good.name, good.arguments, good.error) == ("f", {"x": 1}, None)
    assert bad.error.startswith("the tool call is not valid JSON")
    assert parse_hermes("no call here") == []
    (s,) = parse_hermes('<tool_call>{"name": "f", "arguments": "{\\"x\\": 2}"}</tool_call>')
    assert s.arguments == {"x": 2}  # arguments given as a JSON string
    (t,) = parse_hermes('<tool_call>[1, 2]</tool_call>')
    assert "JSON object" in t.error


def test_a_tool_that_does_not_import_or_has_no_schema_is_refused_in_one_line():
    with pytest.raises(ValueError, match=r"^rollout.tools: cannot import module 'no_such_module'"):
        load_toolbox(["no_such_module:f"])
    with pytest.raises(ValueError, match=r"^rollout.tools: module 'tests.helpers.tool_fixtures' has no 'nope'"):
        load_toolbox([f"{H}:nope"])
    with pytest.raises(ValueError, match=r"^rollout.tools: tool 'ScriptedEngine'|is not a function"):
        load_toolbox([f"{H}:ScriptedEngine"])
    with pytest.raises(ValueError, match="rollout.tool_parser: unknown parser 'xml'"):
        load_toolbox([f"{H}:add"], parser="xml")


def test_a_template_that_rewrites_history_is_named_at_start_up(tokenizer):
    import copy

    t = copy.deepcopy(tokenizer)
    # An assistant turn followed by another renders without its tool calls (as Qwen3 drops old thinking).
    t.chat_template = t.chat_template.replace("{%- for tool_call in message.tool_calls %}",
                                              "{%- for tool_call in (message.tool_calls if loop.last else []) %}")
    said = []
    template = TurnTemplate(t, [], say=said.append)
    assert not template.prefix_preserving and len(said) == 1 and "not prefix-preserving" in said[0]
    assert TurnTemplate(tokenizer, [], say=said.append).prefix_preserving and len(said) == 1


class CachingEngine(ScriptedEngine):
    """The scripted policy behind a prefix cache that serves all but the last token of each prompt (as vLLM's
    counts say, ``[served, sent]``)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.prefix_cache_counts = [0, 0]

    def generate(self, prompts, sampling, limits=None, seeds=None):
        self.prefix_cache_counts[0] += sum(len(p) - 1 for p in prompts)
        self.prefix_cache_counts[1] += sum(len(p) for p in prompts)
        return super().generate(prompts, sampling, limits, seeds)


def test_the_prefix_cache_counts_are_reported_whether_or_not_an_episode_went_on(tokenizer):
    """The RL step sums every rank's metrics as one vector, so their keys may not depend on what a rank's episodes
    did: a rank whose episodes all answered at once had no ``tools/prefix_cache_hit`` and the ranks' vectors
    differed in length (gloo aborts; NCCL may hang or sum values under the wrong keys). The counts are always
    there; the ratio, taken from them, is left out of what the step sums."""
    toolbox = load_toolbox([f"{H}:add"])
    sampling = SamplingConfig(n=2, temperature=1.0, max_new_tokens=200, seed=3)
    metrics = []
    for script in ({"A?": ["The answer is 1."]}, {"B?": [call("add", a=1, b=1), "Done."]}):
        runner = EpisodeRunner(CachingEngine(tokenizer, script), toolbox, tokenizer, 4, say=None)
        runner.generate([prompt_ids(tokenizer, toolbox, q) for q in script], sampling)
        metrics.append(runner.metrics)
    answered, went_on = metrics
    assert set(answered) - {PREFIX_CACHE_HIT} == set(went_on) - {PREFIX_CACHE_HIT}
    assert answered["tools/resubmitted_tokens"] == 0.0 and PREFIX_CACHE_HIT not in answered
    sent = went_on["tools/resubmitted_tokens"]
    assert sent > 0 and went_on[PREFIX_CACHE_HIT] == went_on["tools/prefix_cached_tokens"] / sent == (sent - 2) / sent
