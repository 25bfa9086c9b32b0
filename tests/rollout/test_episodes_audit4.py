"""Audit 4 of tool calls and environments: a tool that never returns costs a bounded number of threads (before: one
thread per call, for the rest of the run: 200 timed-out calls left 201 threads), a call into an episode's
environment whose last call is still stuck is not started alongside it, an environment's ``get_reward()`` runs under
``rollout.tool_timeout_s`` as its ``reset()`` does (before: one that hung hung every rank), and a tool's thread runs
on its rank's CUDA device (before: on the first GPU, CUDA's current device being per thread)."""

from __future__ import annotations

import json
import threading

import pytest

from fastrlhf.rollout import SamplingConfig
from fastrlhf.rollout import tools as T
from fastrlhf.rollout.episodes import EpisodeRunner
from fastrlhf.rollout.tools import OK, TIMEOUT, ToolCall, load_toolbox, run_tool_call
from tests.helpers.episodes4_environments import HangsOnReward, HangsOnTool, cuda_device_here
from tests.helpers.tool_fixtures import ScriptedEngine

HANGS_ON_TOOL = "tests.helpers.episodes4_environments:HangsOnTool"
HANGS_ON_REWARD = "tests.helpers.episodes4_environments:HangsOnReward"


@pytest.fixture
def stuck(monkeypatch):
    """A registry of stuck calls of this test's own (earlier tests' timed-out calls may still run), and every hang
    released at the end, so that no thread outlives the test."""
    monkeypatch.setattr(T, "_stuck", [], raising=False)
    gate = threading.Event()
    yield gate
    gate.set()
    for cls in (HangsOnTool, HangsOnReward):
        cls.release.set()
    for thread, *_ in list(T._stuck):
        thread.join(30)
    for cls in (HangsOnTool, HangsOnReward):
        cls.release.clear()


def tool_threads() -> int:
    return sum(t.name == "fastrlhf-tool" and t.is_alive() for t in threading.enumerate())


def call(name, **arguments) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


# ---------------------------------------------------------------- a tool that never returns


def test_a_tool_that_never_returns_leaves_a_bounded_number_of_threads(stuck, monkeypatch):
    """Before: each of the 40 calls left its thread behind (40 threads, and 201 for 200 calls). Now the first
    MAX_STUCK_CALLS calls time out as before; the later ones are answered without running, saying why."""
    monkeypatch.setattr(T, "MAX_STUCK_CALLS", 4, raising=False)

    def hang(x: int) -> str:
        stuck.wait()
        return "woke"

    before = tool_threads()
    outcomes = [run_tool_call(ToolCall("hang", {"x": i}), {"hang": hang}, 0.01) for i in range(40)]
    assert tool_threads() - before == 4
    assert [o for _, o in outcomes] == [TIMEOUT] * 4 + ["refused"] * 36
    assert outcomes[0][0] == "Error: hang did not return within 0.01 s"
    assert outcomes[4][0] == (
        "Error: hang was not called: 4 tool calls ran past 0.01 s (rollout.tool_timeout_s) and have not returned"
    )
    stuck.set()  # they return: calls run again
    for thread, *_ in list(T._stuck):
        thread.join(30)
    assert run_tool_call(ToolCall("hang", {"x": 0}), {"hang": hang}, 5.0) == ("woke", OK)


def test_an_environment_whose_call_is_stuck_is_not_called_again_while_it_runs(stuck, tokenizer):
    """Before: the episode's second call started a thread of its own on the same instance, alongside the stuck
    one (an environment is not thread-safe: each episode's calls are meant to run in order), and waited out the
    timeout again: the instance saw 2 calls and the rank 2 stuck threads per episode. Now the second call is
    refused at once, counted as a timeout, and the run says so once."""
    toolbox = load_toolbox([], HANGS_ON_TOOL, timeout_s=0.05)
    q = "Poke it."
    said = []
    turns = [call("hang", x=1), call("hang", x=2), "Done."]
    runner = EpisodeRunner(ScriptedEngine(tokenizer, {q: turns}), toolbox, tokenizer, 4, say=said.append)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": q}], tools=toolbox.schemas, tokenize=False, add_generation_prompt=True
    )
    prompt = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    (completions,) = runner.generate([prompt], SamplingConfig(n=2, max_new_tokens=300, seed=3))
    for c in completions:
        results = [m["content"] for m in c.extra["messages"] if m["role"] == "tool"]
        assert results == [
            "Error: hang did not return within 0.05 s",
            "Error: hang was not called: hang on this episode's environment ran past 0.05 s and has not returned",
        ]
        assert c.extra["environment"].calls == 1
    assert runner.metrics["tools/timeouts"] == 4.0 and runner.metrics["tools/calls"] == 4.0
    assert len(T.stuck_calls()) == 2  # one per episode, not one per call
    assert len([s for s in said if "refused" in s]) == 1 and "\n" not in said[-1]


def test_a_stuck_environment_refuses_its_own_calls_only(stuck):
    """Another episode's instance, and a plain tool of the same episode, still run."""
    toolbox = load_toolbox(["tests.helpers.tool_fixtures:add"], HANGS_ON_TOOL, timeout_s=0.05)
    first, _ = toolbox.new_environment({})
    second, _ = toolbox.new_environment({})
    tools = toolbox.bound(first)
    assert run_tool_call(ToolCall("hang", {"x": 1}), tools, 0.05, first)[1] == TIMEOUT
    assert run_tool_call(ToolCall("hang", {"x": 2}), tools, 0.05, first)[1] == "refused"
    assert run_tool_call(ToolCall("add", {"a": 2, "b": 4}), tools, 5.0, first) == ("6", OK)  # not the hang's 0.05 s
    HangsOnTool.release.set()  # the other instance's call returns at once
    assert run_tool_call(ToolCall("hang", {"x": 3}), toolbox.bound(second), 5.0, second) == ("woke", OK)
    assert (first.calls, second.calls) == (1, 1)


# ---------------------------------------------------------------- get_reward under the timeout


def test_a_get_reward_that_hangs_fails_the_step_in_one_line_naming_the_class_and_the_method(stuck):
    """Before: ``environment_scores`` waited for it for good (here: until the helper's safety net, then scored
    it 1.0). Now a RewardFunctionError (a StepFailed: the last good step is kept, ``--resume`` retries it) after
    the ``rollout.tool_timeout_s`` the instance was made under."""
    from fastrlhf.engine.guards import AgreedStepFailure
    from fastrlhf.rl.reward_results import RewardFunctionError, environment_scores

    toolbox = load_toolbox([], HANGS_ON_REWARD, timeout_s=2.0)  # the quick one's thread must start within it
    quick, _ = toolbox.new_environment({"hangs": False})
    hangs, _ = toolbox.new_environment({"hangs": True})
    values, applicable = environment_scores("HangsOnReward", [quick, None])
    assert values.tolist() == [1.0, 0.0] and applicable.tolist() == [True, False]
    with pytest.raises(RewardFunctionError) as info:
        environment_scores("HangsOnReward", [quick, hangs])
    said = (
        "reward function 'HangsOnReward.get_reward' did not return within 2 s (rollout.tool_timeout_s) for "
        "completion 1 of a batch of 2"
    )
    assert str(info.value) == said and info.value.exit_code == 1 and info.value.local
    assert isinstance(info.value, AgreedStepFailure)


def test_get_reward_still_raises_as_a_reward_function_does(stuck):
    from fastrlhf.rl.reward_results import RewardFunctionError, environment_scores

    class Broken(HangsOnReward):
        def get_reward(self) -> float:
            raise KeyError("score")

    class NoToolboxMadeIt(Broken):
        pass

    made, _ = T.Toolbox(environment=Broken, timeout_s=1.0).new_environment({})
    for environment in (made, NoToolboxMadeIt()):  # on a thread under the toolbox's timeout; called as it is
        with pytest.raises(RewardFunctionError) as info:
            environment_scores("Broken", [environment])
        assert (
            info.value.summary == "reward function 'Broken.get_reward' raised KeyError for completion 0 of a "
            "batch of 1: 'score'"
        )
        assert 'raise KeyError("score")' in info.value.user_traceback  # the user's frame, from the call's thread


def test_a_get_reward_that_hangs_on_one_rank_ends_every_rank_alike(stuck):
    """Before: rank 1 hung in get_reward (here: until the helper's safety net) and rank 0 waited for it in the
    reward agreement; the run hung for as long as the grader did."""
    from tests.helpers.episode_ranks import assert_every_rank_ended_alike, reward_rank

    said = (
        "reward function 'HangsOnReward.get_reward' did not return within 3 s (rollout.tool_timeout_s) for "
        "completion 0 of a batch of 1 on rank 1"
    )
    assert_every_rank_ended_alike(reward_rank, "RewardFunctionError", said)


# ---------------------------------------------------------------- the CUDA device of a call's thread


def test_a_tool_runs_on_its_callers_cuda_device(stuck, monkeypatch, tokenizer):
    """CUDA's current device is per thread: a new thread starts on device 0, so on rank 3 of 8 (device 3 set by
    the launcher) a tool, reset() or get_reward() computing on "cuda" put its tensors on the first GPU, every
    rank's. Checked with torch.cuda's device calls stubbed as CUDA keeps them (per thread; no GPU on CPU CI)."""
    import torch

    current = {threading.get_ident(): 3}  # this thread: the rank's device; any other: 0 until it sets its own
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current.get(threading.get_ident(), 0))
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: current.__setitem__(threading.get_ident(), d))

    assert run_tool_call(ToolCall("here", {"x": 0}), {"here": cuda_device_here}, 5.0) == ("3", OK)
    toolbox = load_toolbox(["tests.helpers.episodes4_environments:cuda_device_here"], timeout_s=5.0)
    q = "Where?"
    runner = EpisodeRunner(
        ScriptedEngine(tokenizer, {q: [call("cuda_device_here", x=1), "Done."]}), toolbox, tokenizer, 4, say=None
    )
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": q}], tools=toolbox.schemas, tokenize=False, add_generation_prompt=True
    )
    prompt = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    (completions,) = runner.generate([prompt], SamplingConfig(n=2, max_new_tokens=300, seed=3))
    for c in completions:  # each episode's calls run from a thread of the round's pool: on the rank's device too
        assert [m["content"] for m in c.extra["messages"] if m["role"] == "tool"] == ["3"]
