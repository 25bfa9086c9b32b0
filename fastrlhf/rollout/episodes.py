"""Multi-turn tool-use episodes on any rollout engine: the policy generates, calls tools, reads their
results and goes on, and the trainer learns from exactly the tokens it generated.

One loop (:class:`EpisodeRunner`) drives either engine (``rollout.engine: hf | vllm``) through its
batched ``generate``. Each round, every episode still running advances by one assistant turn in one
call; an episode whose turn has no tool call, that reached ``rollout.max_turns`` turns or that spent its
budget (``rollout.max_new_tokens`` generated tokens over all its turns, or the model's context) leaves the
batch. The first turn of a prompt's ``n`` episodes is one request with ``n`` samples (the prompt is
shared); a continued episode is resubmitted as token ids, prompt + everything so far, so vLLM's prefix
cache serves its history instead of recomputing it.

Exact tokens: an episode's completion is the concatenation of the policy's own token ids (never
re-tokenized text) and the tokenized turns between them (tool results through the chat template, and
the template's turn markers the policy did not generate), with ``Completion.mask`` 1 on the policy's
tokens only: the losses, KL, entropy and the logprob mismatch probe see nothing else, and GAE carries
across the masked middle (``fastrlhf.algorithms.advantages.compute_gae``). Nothing earlier is ever
re-rendered, so a chat template that rewrites history (not prefix-preserving: Qwen3's drops earlier
thinking) cannot change a token the policy was scored on; :class:`TurnTemplate` says so at start-up.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from fastrlhf.rollout.sampling import Completion, SamplingConfig
from fastrlhf.rollout.tools import ERROR, REFUSED, TIMEOUT, EnvironmentResetError, Toolbox, run_tool_call

__all__ = ["PREFIX_CACHE_HIT", "Episode", "EpisodeRunner", "TurnTemplate", "with_prefix_cache_hit"]

PREFIX_CACHED, RESUBMITTED, PREFIX_CACHE_HIT = ("tools/prefix_cached_tokens", "tools/resubmitted_tokens",
                                                "tools/prefix_cache_hit")


def with_prefix_cache_hit(metrics: dict) -> dict:
    """``metrics`` with ``tools/prefix_cache_hit`` (cached over resubmitted tokens) where it has resubmitted tokens:
    a ratio of sums, so the RL step takes it after summing the counts over the ranks, not as a mean of ratios."""
    if metrics.get(RESUBMITTED):
        metrics[PREFIX_CACHE_HIT] = metrics[PREFIX_CACHED] / metrics[RESUBMITTED]
    return metrics

def _on_rank() -> str:
    """``" on rank 3"`` where there are several ranks: an environment's failure is said on every rank."""
    from fastrlhf.distributed.ranks import rank, world_size

    return f" on rank {rank()}" if world_size() > 1 else ""


_REASONING_END = "</think>"  # Qwen3's and DeepSeek-R1's end of reasoning
_MARK_USER, _MARK_ASSISTANT, _MARK_TOOL = "fastrlhf-user-mark", "fastrlhf-assistant-mark", "fastrlhf-tool-mark"


def _content_without(text: str, calls: list) -> str:
    """A turn's text less the calls its message's ``tool_calls`` holds, as TRL's ``parse_response`` splits a turn
    (content, then tool_calls): a chat template renders ``tool_calls`` after the content, so a call left in both was
    rendered twice, and a reward reading the conversation saw it twice. Calls are looked for after the last
    ``</think>`` (where they are read), as written (``ToolCall.text``), else by their JSON alone (call tags that are
    special tokens are not in the decoded text); a malformed call stays, as the model wrote it."""
    head, end, said = text.rpartition(_REASONING_END)
    left = said
    for call in calls:
        written = next((w for w in (call.text, call.raw) if w and w in left), None)
        if written is not None:
            left = left.replace(written, "", 1)
    return head + end + (left.rstrip() if left != said else said)


class TurnTemplate:
    """The text a chat template puts between two assistant turns, read from the template itself.

    ``between(tool_messages)``: what follows an assistant message's content: its closing (``<|im_end|>\\n`` in
    ChatML; a turn that ended with the eos token has generated its first part), the tool turn(s) and the next
    assistant header, as the template renders them after an assistant message.

    ``between`` is read after the assistant's content in a conversation that goes on with a tool turn, never by
    cutting off a rendering where the assistant message is the last: a template may render the last assistant
    message differently (Qwen3's wraps it in an empty ``<think>`` block), and only what follows its content counts.

    ``template_kwargs`` go to every rendering (``enable_thinking=False`` for Qwen3): they must be those the prompts
    were rendered with, or later turns open differently from the first (Qwen3's non-thinking header ends with an
    empty ``<think>`` block: without it, the policy thinks from its second turn on). ``header`` is the text that
    opens a later assistant turn: :meth:`EpisodeRunner.generate` says once where a prompt does not end with it.
    """

    def __init__(self, tokenizer, tool_schemas: Sequence[dict] = (), say=print, template_kwargs: dict | None = None):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("tool use needs a tokenizer with a chat template (the model's path has none)")
        self.tokenizer, self.tools = tokenizer, list(tool_schemas) or None
        self.template_kwargs = dict(template_kwargs or {})
        self.base_messages = base = [{"role": "user", "content": _MARK_USER},
                                     {"role": "assistant", "content": _MARK_ASSISTANT}]
        if _MARK_ASSISTANT not in self.render(base):
            raise ValueError("the chat template does not render an assistant message's content as given")
        probe = self.render(base + [{"role": "tool", "name": "probe", "content": _MARK_TOOL}], True)
        if _MARK_ASSISTANT not in probe or _MARK_TOOL not in probe.split(_MARK_ASSISTANT, 1)[1]:
            raise ValueError("the chat template does not render a tool message after an assistant message's content: "
                             "the tool turn's tokens cannot be read from it")
        closed = self.render(base + [{"role": "tool", "name": "probe", "content": _MARK_TOOL}])
        self.header = probe[len(closed):] if probe.startswith(closed) else ""
        self.prefix_preserving = self._prefix_preserving()
        if not self.prefix_preserving and say is not None:
            say("rollout: the chat template is not prefix-preserving (re-rendering a conversation changes its "
                "earlier turns): episodes are built by token concatenation, as generated")

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        return self.tokenizer.apply_chat_template(messages, tools=self.tools, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt, **self.template_kwargs)

    def _prefix_preserving(self) -> bool:
        """Whether rendering a conversation with one more turn keeps the earlier text (TRL's check)."""
        call = {"type": "function", "function": {"name": "probe", "arguments": {"x": 1}}}
        first = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b", "tool_calls": [call]}]
        second = first + [{"role": "tool", "name": "probe", "content": "c"}, {"role": "assistant", "content": "d"}]
        try:
            return self.render(second).startswith(self.render(first))
        except Exception:  # noqa: BLE001 -- a template without tool_calls support: judged on plain turns
            return True

    def between(self, tool_messages: list[dict], ended_with: str = "") -> list[int]:
        """Token ids from the end of a generated assistant turn to the start of the next one: the rest of
        the turn's closing (``ended_with``: the text of the eos token the turn ended on, if any), the tool
        messages, and the next assistant header."""
        full = self.render(self.base_messages + tool_messages, True)
        text = full.split(_MARK_ASSISTANT, 1)[1]
        text = text[len(ended_with):] if ended_with and text.startswith(ended_with) else text
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])


@dataclass(eq=False)
class Episode:
    """One rollout of one prompt: its tokens so far and the conversation they are."""

    index: int  # in the step's episodes (prompt-major): its seeds derive from it
    group: int
    prompt: list[int]
    tools: dict
    environment: object = None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    messages: list[dict] = field(default_factory=list)
    turns: int = 0
    generated: int = 0
    calls: int = 0
    errors: int = 0
    timeouts: int = 0
    finish_reason: str | None = None
    stopped_by: str = ""

    def add(self, token_ids: list[int], logprobs: list[float] | None, generated: bool) -> None:
        self.token_ids += token_ids
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(token_ids)
        self.mask += [1 if generated else 0] * len(token_ids)

    def completion(self, row_prompt: list[int]) -> Completion:
        return Completion(self.token_ids, self.logprobs, self.finish_reason or "stop", mask=self.mask,
                          prompt_ids=self.prompt if self.prompt != row_prompt else None,
                          extra={"messages": self.messages, "turns": self.turns, "tool_calls": self.calls,
                                 "environment": self.environment, "stopped_by": self.stopped_by})


class EpisodeRunner:
    """``generate(prompts, sampling, metas)`` -> per prompt, ``sampling.n`` episode :class:`Completion` s.

    ``engine``: any :class:`fastrlhf.rollout.base.RolloutEngine`; ``toolbox``: the run's tools
    (:func:`fastrlhf.rollout.tools.load_toolbox`); ``tokenizer``: the policy's, with its chat template;
    ``max_turns``: assistant turns per episode. After each call :attr:`metrics` holds ``tools/calls``,
    ``tools/errors``, ``tools/timeouts`` (this call's totals), ``tools/turns`` (assistant turns per episode),
    ``tools/calls_per_episode`` and, with vLLM, ``tools/resubmitted_tokens`` (the continued episodes' histories
    sent again), ``tools/prefix_cached_tokens`` (those its prefix cache served, not recomputed) and, where some
    were sent, ``tools/prefix_cache_hit``: their ratio. ``chat_template_kwargs``: as the prompts were rendered with
    (:class:`TurnTemplate`).
    """

    def __init__(self, engine, toolbox: Toolbox, tokenizer, max_turns: int = 4, say=print,
                 chat_template_kwargs: dict | None = None):
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        self.engine, self.toolbox, self.tokenizer, self.max_turns = engine, toolbox, tokenizer, max_turns
        self.template = TurnTemplate(tokenizer, toolbox.schemas, say=say, template_kwargs=chat_template_kwargs)
        self.say, self.header_checked, self.refusal_said = say, False, False
        self.eos_texts = {i: tokenizer.convert_ids_to_tokens(i) for i in getattr(engine, "eos_token_ids", [])}
        self.turn_ends = dict(self.eos_texts)
        self.metrics: dict[str, float] = {}

    def start(self, prompts: list[list[int]], metas: Sequence[dict] | None, n: int) -> list[Episode]:
        """``n`` episodes per prompt, each with its own environment instance (reset with its row, under the tools'
        timeout: :meth:`fastrlhf.rollout.tools.Toolbox.new_environment`)."""
        episodes, where = [], _on_rank()
        for i, prompt in enumerate(prompts):
            meta = metas[i] if metas is not None else {}
            for _ in range(n):
                environment, extra = self.toolbox.new_environment(meta, f" (prompt {i} of the rollout batch{where})")
                episode_prompt = list(prompt) if extra is None else self._prompt_with(meta, extra, prompt)
                episodes.append(Episode(len(episodes), i, episode_prompt, self.toolbox.bound(environment),
                                        environment))
        return episodes

    def start_on_every_rank(self, prompts: list[list[int]], metas: Sequence[dict] | None, n: int) -> list[Episode]:
        """:meth:`start`, and an EnvironmentResetError on any rank raised on every rank, before the first turn: the
        ranks whose environments started went on into their next collective (a ZeRO-3 forward, the reward
        agreement) and waited there for the failed one until the timeout. A collective (every caller calls
        :meth:`generate` on every rank): one all-reduce of ``world`` floats per call where there is an environment,
        none without one (plain tool functions cannot fail to start)."""
        if self.toolbox.environment is None:
            return self.start(prompts, metas, n)
        from fastrlhf.distributed.comm import agree_on_failure

        return agree_on_failure(lambda: self.start(prompts, metas, n), EnvironmentResetError)

    def _prompt_with(self, meta, extra: str, prompt: list[int]) -> list[int]:
        """The row's prompt with ``extra`` appended to its last user message (TRL's ``reset`` contract)."""
        given = getattr(meta, "prompt", None)
        if not isinstance(given, list):
            # The same on every rank where every row's reset returns text; where only some do, on some ranks only.
            raise EnvironmentResetError("rollout.environment: reset() returned text to append to the last user "
                                        "message, but the prompt rows are not chats (give them as 'messages')",
                                        exit_code=2)
        messages = [dict(m) for m in given]
        last = max(i for i, m in enumerate(messages) if m.get("role") == "user")
        messages[last]["content"] = f"{messages[last].get('content', '')}{extra}"
        return list(self.tokenizer(self.template.render(messages, True), add_special_tokens=False)["input_ids"])

    def generate(self, prompts: list[list[int]], sampling: SamplingConfig, metas: Sequence[dict] | None = None
                 ) -> list[list[Completion]]:
        from dataclasses import replace

        self._check_header(prompts)
        episodes = self.start_on_every_rank(prompts, metas, sampling.n)
        # A turn ends on the model's eos or on one of rollout.stop_token_ids (an end-of-turn token the model's eos
        # list lacks): either is the start of the template's closing, generated, so not added again.
        stop_ids = list(sampling.stop_token_ids)
        self.turn_ends = {**self.eos_texts, **dict(zip(stop_ids, self.tokenizer.convert_ids_to_tokens(stop_ids),
                                                       strict=True))}
        n, budget, context = sampling.n, sampling.max_new_tokens, self.engine.max_model_len
        shared = all(e.prompt == prompts[e.group] for e in episodes)
        active = list(episodes)
        round_ = 0
        counts = getattr(self.engine, "prefix_cache_counts", None)  # vLLM's: [cached, prompt] tokens
        continued = [0, 0]
        while active:
            if round_ == 0 and shared and n > 1:  # one request per prompt, n samples: the prompt is shared
                outs = self.engine.generate(prompts, sampling)
                turns = [outs[e.group][k % n] for k, e in enumerate(active)]
            else:
                inputs = [e.prompt + e.token_ids for e in active]
                limits = [min(budget - e.generated, context - len(x)) for e, x in zip(active, inputs, strict=True)]
                before = list(counts) if counts is not None and round_ > 0 else None
                # Each episode's turn its own seed (vLLM seeds each request: one seed for all would draw the
                # same random numbers for episodes that share a history), the same again after a resume.
                seeds = None if sampling.seed is None else [
                    (sampling.seed + 7919 * round_ + 104729 * e.index) % (2**31) for e in active]
                outs = self.engine.generate(inputs, replace(sampling, n=1), limits=limits, seeds=seeds)
                if before is not None:
                    continued = [continued[0] + counts[0] - before[0], continued[1] + counts[1] - before[1]]
                turns = [o[0] for o in outs]
            calls = [self._take_turn(e, turn) for e, turn in zip(active, turns, strict=True)]
            results = self._run_calls(active, calls)
            active = [e for e, turn, result in zip(active, turns, results, strict=True)
                      if result is not None and self._go_on(e, turn, result, budget, context)]
            round_ += 1
        self.metrics = self._metrics(episodes)
        if counts is not None:  # whether or not an episode continued: the RL step sums the same keys on every rank
            self.metrics.update({PREFIX_CACHED: float(continued[0]), RESUBMITTED: float(continued[1])})
            with_prefix_cache_hit(self.metrics)
        return [[e.completion(prompts[i]) for e in episodes[i * n:(i + 1) * n]] for i in range(len(prompts))]

    def _check_header(self, prompts: list[list[int]]) -> None:
        """Say once where the first prompt does not open its assistant turn as the template opens the later ones
        (rendered with other chat template arguments, e.g. Qwen3's ``enable_thinking``): its episodes' turns would
        be conditioned on two different headers."""
        header = self.template.header
        if self.header_checked or not prompts or not header or self.say is None:
            return
        self.header_checked = True
        tail = self.tokenizer.decode(prompts[0][-4 * len(header):], skip_special_tokens=False)
        if not tail.endswith(header):
            self.say(f"rollout: the prompts end with {tail[-len(header) - 32:]!r}, but the chat template opens the "
                     f"assistant turns after a tool turn with {header!r}: render the prompts with the same chat "
                     f"template arguments (e.g. enable_thinking) as the episodes")

    def _take_turn(self, e: Episode, turn: Completion) -> list | None:
        """Append one generated turn; returns its tool calls where it calls tools and may go on, else None."""
        e.add(turn.token_ids, turn.logprobs, generated=True)
        e.turns += 1
        e.generated += len(turn.token_ids)
        text = self.tokenizer.decode(turn.token_ids, skip_special_tokens=True)
        calls = self.toolbox.parse(self._call_text(turn.token_ids))
        message = {"role": "assistant", "content": text}
        if calls:
            made = [c for c in calls if c.error is None]
            message["tool_calls"] = [c.as_message_call() for c in made]
            message["content"] = _content_without(text, made)
        e.messages.append(message)
        e.finish_reason = turn.finish_reason
        if not calls:
            e.stopped_by = "answer" if turn.finish_reason == "stop" else "budget"
            return None
        if turn.finish_reason == "length" or e.turns >= self.max_turns:
            e.finish_reason, e.stopped_by = "length", "budget" if turn.finish_reason == "length" else "max_turns"
            return None
        return calls

    def _run_calls(self, active: list[Episode], calls: list[list | None]) -> list[list[dict] | None]:
        """Each episode's tool messages (None where it ended). The episodes' calls run at the same time, one thread
        per episode (its own calls in order): one after another, a tool that times out on every call kept a rank
        busy episodes x calls x tool_timeout_s, past the other ranks' collective timeout."""
        from concurrent.futures import ThreadPoolExecutor

        from fastrlhf.rollout.tools import on_callers_device

        def run(e: Episode, episode_calls: list) -> list[dict]:
            return [{"role": "tool", "name": call.name or "unknown",
                     "content": self._outcome(e, *run_tool_call(call, e.tools, self.toolbox.timeout_s, e.environment))}
                    for call in episode_calls]

        jobs = [(e, c) for e, c in zip(active, calls, strict=True) if c is not None]
        if not jobs:
            return [None] * len(active)
        # On this rank's CUDA device, as each call's own thread then is (see on_callers_device).
        with ThreadPoolExecutor(max_workers=len(jobs), thread_name_prefix="fastrlhf-episode",
                                initializer=on_callers_device()) as pool:
            done = iter(list(pool.map(lambda job: run(*job), jobs)))
        return [next(done) if c is not None else None for c in calls]

    def _outcome(self, e: Episode, content: str, outcome: str) -> str:
        e.calls += 1
        e.errors += outcome == ERROR
        e.timeouts += outcome in (TIMEOUT, REFUSED)
        if outcome == REFUSED and not self.refusal_said and self.say is not None:
            # Once: the run goes on, every call of a tool that hangs for good now answered this way.
            self.refusal_said = True
            self.say(f"rollout: a tool call was refused ({content.removeprefix('Error: ')}): a timed-out call's "
                     f"thread cannot be stopped; give the tool a timeout of its own")
        return content

    def _go_on(self, e: Episode, turn: Completion, results: list[dict], budget: int, context: int) -> bool:
        """Append the tool turn after ``turn`` where the episode has budget and context left; returns whether it
        continues."""
        ended_with = self.turn_ends.get(turn.token_ids[-1], "") if turn.token_ids else ""
        between = self.template.between(results, ended_with)
        e.messages += results
        if e.generated >= budget or len(e.prompt) + len(e.token_ids) + len(between) >= context:
            e.finish_reason, e.stopped_by = "length", "budget"
            return False
        e.add(between, None, generated=False)
        return True

    def _call_text(self, token_ids: list[int]) -> str:
        """A turn's text as the tool-call parser reads it: special tokens kept (a tokenizer may make the call tags
        special tokens, as vLLM's chat server assumes whenever tools are given), but not the eos it ended on, nor
        its reasoning (up to the last ``</think>``: a call drafted while thinking is not made, as vLLM's chat server
        parses calls from the content its reasoning parser leaves)."""
        end = len(token_ids) - 1 if token_ids and token_ids[-1] in self.turn_ends else len(token_ids)
        return self.tokenizer.decode(token_ids[:end], skip_special_tokens=False).rsplit(_REASONING_END, 1)[-1]

    @staticmethod
    def _metrics(episodes: list[Episode]) -> dict[str, float]:
        count = max(len(episodes), 1)
        calls = sum(e.calls for e in episodes)
        return {"tools/calls": float(calls), "tools/errors": float(sum(e.errors for e in episodes)),
                "tools/timeouts": float(sum(e.timeouts for e in episodes)),
                "tools/turns": sum(e.turns for e in episodes) / count, "tools/calls_per_episode": calls / count}
