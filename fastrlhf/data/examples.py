"""Rows -> validated token-id examples: RL prompts (ids, text or a chat through the chat template, their
other columns beside them), SFT examples, preference pairs and labelled sequences; the columns reward
functions need, checked before any model loads.
"""

from __future__ import annotations

import math
import os
import sys
from collections import Counter
from dataclasses import dataclass, field

from fastrlhf.data.overlong import overlong_skips, say_truncated, truncated
from fastrlhf.data.reading import (
    CHAT_FIELD,
    DataError,
    LazyTokenizer,
    _BadLine,
    _check_len,
    _check_text,
    _check_vocab,
    _collect,
    _short,
    _Skip,
    _tokens,
)

__all__ = [
    "ASSISTANT_TURNS_CHOICES", "CHAT_TEMPLATE_CHOICES", "OVERLONG_CHOICES", "Columns", "PromptExample", "SFTExample",
    "PairExample", "ClassificationExample", "load_prompts", "load_sft_examples", "load_pairwise_examples",
    "load_classification_examples", "check_columns", "uneven_columns", "report_uneven_columns"
]


CHAT_TEMPLATE_CHOICES = (True, False, "auto")


OVERLONG_CHOICES = ("error", "truncate", "skip")


ASSISTANT_TURNS_CHOICES = ("last", "all")


class Columns(dict):
    """A prompt row's columns (every field but the prompt): what reward functions receive as ``meta`` or
    keyword arguments and what validation files record. :attr:`prompt` is the row's prompt as given: its
    text, its messages, or None for token ids. It rides beside the columns, not among them, so that a
    reward in TRL's format can read it while every reader of the columns sees only the columns."""

    def __init__(self, columns=(), prompt: str | list[dict] | None = None):
        super().__init__(columns)
        self.prompt = prompt


@dataclass
class PromptExample:
    prompt_ids: list[int]
    meta: dict = field(default_factory=Columns)  # a Columns from load_prompts
    source: str = ""  # where the row is: "file:line" or "folder:row N" (for messages naming it)


@dataclass
class SFTExample:
    prompt_ids: list[int]
    response_ids: list[int]
    # 1 on the response tokens the loss trains, 0 on those it only reads (the user and tool turns between a
    # chat's assistant turns, data.assistant_turns: all); None: all of them
    response_mask: list[int] | None = None


@dataclass
class PairExample:
    prompt_ids: list[int]
    chosen_ids: list[int]
    rejected_ids: list[int]
    margin: float = 0.0  # how far chosen must score above rejected (TRL's ``margin`` column)


@dataclass
class ClassificationExample:
    input_ids: list[int]
    label: int


def _id_and_text_names(field_name: str) -> tuple[str, ...]:
    """``prompt_ids`` also accepts ``prompt`` (text) and vice versa."""
    if field_name.endswith("_ids"):
        return field_name, field_name[: -len("_ids")]
    return field_name, f"{field_name}_ids"


def _is_chat(value) -> bool:
    return isinstance(value, list) and any(isinstance(m, dict) for m in value)


def _chat(value, field_name: str) -> list[dict]:
    """A validated chat: a non-empty list of objects with text ``role`` and ``content``. Keys that are null
    (a column of a Parquet/``datasets`` struct that another row has) are left out, as if absent."""
    if not isinstance(value, list) or not value:
        raise _BadLine(f"field {field_name!r} must be a non-empty list of {{\"role\": text, \"content\": text}} "
                       f"objects, got {_short(value)}")
    messages = []
    for i, message in enumerate(value):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) \
                or not isinstance(message.get("content"), str):
            raise _BadLine(f"field {field_name!r}: message {i} must be an object with text 'role' and 'content', "
                           f"got {_short(message)}")
        _check_text(message["content"], f"{field_name!r}: message {i}'s content")
        messages.append({k: v for k, v in message.items() if v is not None})
    return messages


def _prompt(row: dict, names: tuple[str, ...], tokenizer: LazyTokenizer, vocab_size: int | None,
            chat_template: bool | str) -> tuple[list[int], str | list[dict] | None]:
    """``(ids, given)`` of a row's prompt: the first present field of ``names`` + ``messages``; ids as given,
    text tokenized (``chat_template: true``: as one user message through the template), a chat through the
    template. ``given``: the text or the validated messages (None for token ids)."""
    fields = tuple(dict.fromkeys((*names, CHAT_FIELD)))
    for name in fields:
        if name in row and row[name] is not None:
            value = row[name]
            break
    else:
        raise _BadLine(f"missing field {' or '.join(repr(n) for n in fields)}")
    if name == CHAT_FIELD or _is_chat(value):
        messages = _chat(value, name)
        _check_template_on(chat_template, name)
        ids, given = tokenizer.chat_ids(messages, name), messages
    elif isinstance(value, str) and chat_template is True:
        _check_text(value, repr(name))
        ids = tokenizer.chat_ids([{"role": "user", "content": value}], name, why=" (data.chat_template is true)") \
            if value else []
        given = value
    else:
        ids = _tokens({name: value}, (name,), "prompt", tokenizer, vocab_size, special=True)
        return ids, value if isinstance(value, str) else None
    if not ids:
        raise _BadLine("empty prompt")
    _check_vocab(ids, vocab_size, "prompt")
    return ids, given


def _check_template_on(chat_template: bool | str, name: str) -> None:
    """A bad line for a chat in field ``name`` where ``data.chat_template`` is false: nothing may render it."""
    if chat_template is False:
        raise _BadLine(f"field {name!r} is a chat but data.chat_template is false; set data.chat_template to true or "
                       "auto")


def _check_choices(chat_template, overlong=None):
    if chat_template not in CHAT_TEMPLATE_CHOICES or type(chat_template) not in (bool, str):
        raise ValueError(f"chat_template must be true, false or 'auto', got {chat_template!r}")
    if overlong is not None and overlong not in OVERLONG_CHOICES:
        raise ValueError(f"overlong must be one of {', '.join(OVERLONG_CHOICES)}, got {overlong!r}")


def load_prompts(path: str, prompt_field: str = "prompt_ids", max_prompt_len: int | None = None,
                 vocab_size: int | None = None, tokenizer_path: str | None = None, *,
                 chat_template: bool | str = "auto", overlong: str = "error",
                 tools: list[dict] | None = None, chat_template_kwargs: dict | None = None) -> list[PromptExample]:
    """RL prompts, one per row: ``{"prompt_ids": [...]}``, ``{"prompt": "text"}`` or ``{"messages": [{"role",
    "content"}, ...]}`` (the prompt field's names come from ``prompt_field``; a chat in it works too).

    ``chat_template`` (``data.chat_template``): a chat is always put through the tokenizer's chat template
    with the generation prompt (``auto``: a bad line when the tokenizer has no template; ``false``: a chat
    is a bad line); ``true`` also puts text through it as one user message, ``auto``/``false`` tokenize
    text as it is. Token ids are used as given.

    ``overlong`` (``data.overlong``), for a prompt longer than ``max_prompt_len`` tokens: ``error`` (a bad
    line), ``truncate`` (keep its last ``max_prompt_len`` tokens, so a template's generation prompt stays) or
    ``skip`` (leave the row out; rank 0 prints how many; all left out is an error).

    Every other column of a row (``answer``, ``data_source``...) travels in the example's ``meta`` (a
    :class:`Columns`, which also holds the prompt as given), so reward functions receive it; a key in
    ``meta`` itself wins over a column of the same name. ``source`` is the row's ``file:line``. ``tools``: the
    JSON schemas the chat template lists in each chat prompt (``rollout.tools``); ``chat_template_kwargs``: the
    template's own variables (``data.chat_template_kwargs``, e.g. Qwen3's ``enable_thinking``).
    """
    _check_choices(chat_template, overlong)
    tokenizer = LazyTokenizer(tokenizer_path, tools, chat_template_kwargs)
    names = _id_and_text_names(prompt_field)

    def parse(row: dict, where: str) -> PromptExample:
        ids, given = _prompt(row, names, tokenizer, vocab_size, chat_template)
        meta = row.get("meta", {})
        if meta is None:
            meta = {}
        if not isinstance(meta, dict):
            raise _BadLine(f"field 'meta' must be an object, got {_short(meta)}")
        if max_prompt_len is not None and len(ids) > max_prompt_len:
            if overlong == "truncate":
                ids = ids[-max_prompt_len:]
            elif overlong == "skip":
                raise _Skip
            else:
                _check_len(ids, max_prompt_len, "prompt")
        columns = {k: v for k, v in row.items() if k not in names and k not in ("meta", CHAT_FIELD)}
        return PromptExample(ids, Columns({**columns, **meta}, given), where)

    return _collect(path, parse, skipped_as=f"longer than max_prompt_len ({max_prompt_len} tokens)")


def _assistant_turns(messages: list[dict], tokenizer: LazyTokenizer, vocab_size: int | None,
                     turns: str, field_name: str = CHAT_FIELD) -> SFTExample:
    """A chat's SFT example: each trained assistant turn is its content's tokens plus EOS after the template
    of the turns before it, with the generation prompt (``last``: only the final turn, every earlier one is
    prompt). With ``all``, the template of each later context must start with the tokens built so far, so
    that every turn is trained in the context the template gives it; a template that rewrites earlier turns
    (one that drops past reasoning) is a bad line rather than a silent mismatch."""
    if len(messages) < 2 or messages[-1]["role"] != "assistant":
        raise _BadLine(f"field {field_name!r} must end with an assistant message (the response) after at "
                       f"least one other message, got roles {[m['role'] for m in messages]}")
    trained = [len(messages) - 1] if turns == "last" else \
        [i for i, m in enumerate(messages) if m["role"] == "assistant" and i > 0]
    for i in trained:
        if messages[i].get("tool_calls"):  # the template renders them, the trained reply (content + EOS) would not
            raise _BadLine(f"field {field_name!r}: assistant message {i} has 'tool_calls', which would not be "
                           "trained (a trained turn is its 'content' plus EOS): write the call into its content in "
                           "the model's own format (e.g. <tool_call>...</tool_call>)")
    ids: list[int] = []
    mask: list[int] = []
    for i in trained:
        context = tokenizer.chat_ids(messages[:i], field_name)
        _check_vocab(context, vocab_size, "prompt")
        if context[:len(ids)] != ids:
            raise _BadLine(_not_a_prefix(context, ids, tokenizer, i))
        reply = _tokens({"response": messages[i]["content"]}, ("response",),
                        "response" if i == len(messages) - 1 else f"assistant message {i}", tokenizer,
                        vocab_size, special=False, append_eos=True)
        mask += [0] * (len(context) - len(ids)) + [1] * len(reply)
        ids = context + reply
    start = mask.index(1)
    return SFTExample(ids[:start], ids[start:], None if all(mask[start:]) else mask[start:])


def _not_a_prefix(context: list[int], ids: list[int], tokenizer: LazyTokenizer, i: int) -> str:
    """Why the template of the turns before message ``i`` does not start with the sequence built so far."""
    k = next((k for k, (a, b) in enumerate(zip(context, ids, strict=False)) if a != b), min(len(context), len(ids)))
    eos = tokenizer.eos_token_id
    if k == len(ids) - 1 and ids[k] == eos and k < len(context):
        # A base model's tokenizer: its EOS (<|endoftext|>) is not the template's end of turn (<|im_end|>)
        name = tokenizer.get().convert_ids_to_tokens
        return (f"the chat template ends an assistant turn with {name(context[k])!r}, not with the tokenizer's EOS "
                f"{name(eos)!r} that each trained turn ends with, so the turns cannot be trained in one sequence; "
                "set data.assistant_turns to last, or use a tokenizer whose EOS is the template's end of turn")
    return (f"the chat template renders the turns before message {i} differently from how it rendered them as the "
            "earlier turns' context, so they cannot be trained in one sequence; set data.assistant_turns to last")


def load_sft_examples(path: str, max_len: int, max_prompt_len: int | None = None,
                      vocab_size: int | None = None, tokenizer_path: str | None = None, *,
                      chat_template: bool | str = "auto", tools: list[dict] | None = None,
                      assistant_turns: str = "last", chat_template_kwargs: dict | None = None,
                      overlong: str = "error") -> list[SFTExample]:
    """SFT pairs: ``{"prompt_ids"/"prompt", "response_ids"/"response"}`` rows (TRL's ``completion`` for the
    response: text, ids, or the assistant turn(s) after a ``prompt`` chat), ``{"messages": [..., {"role":
    "assistant", "content": ...}]}`` rows, or TRL's language-modelling ``{"text": ...}`` rows (every token trains).

    A chat's prompt is the template of all its messages but the last, with the generation prompt; its
    response is the last (assistant) message's text, tokenized without special tokens, plus EOS (as a text
    response). ``assistant_turns: all`` (``data.assistant_turns``) trains every assistant turn after the
    first message the same way, each in the context of the turns before it; the turns between them are read,
    not trained (the example's ``response_mask``). ``chat_template``, ``tools`` and ``chat_template_kwargs`` as in
    :func:`load_prompts`. ``overlong`` (``data.overlong``): an example over ``max_len`` or ``max_prompt_len`` is a
    bad line (``error``), left out (``skip``, counted; as TRL's reward trainer filters its pairs), or cut
    (``truncate``, counted: see :func:`fastrlhf.data.overlong.truncated`).
    """
    _check_choices(chat_template)
    if assistant_turns not in ASSISTANT_TURNS_CHOICES:
        raise ValueError(f"assistant_turns must be one of {', '.join(ASSISTANT_TURNS_CHOICES)}, "
                         f"got {assistant_turns!r}")
    skip = overlong_skips(overlong, ("error", "skip", "truncate"))
    tokenizer = LazyTokenizer(tokenizer_path, tools, chat_template_kwargs)
    cut_rows = []

    def parse(row: dict, where: str) -> SFTExample:
        no_response = all(row.get(k) is None for k in ("response_ids", "response"))
        if no_response and _is_chat(row.get("completion")):
            example = _assistant_turns(_prompt_and_completion(row, chat_template), tokenizer, vocab_size,
                                       assistant_turns)
        # A chat unless a response is given beside it: a prompt column alone does not make the row a pair, as in
        # HuggingFaceH4/ultrachat_200k, whose rows repeat the chat's first user turn in a text ``prompt``
        elif row.get(CHAT_FIELD) is not None and no_response:
            messages = _chat(row[CHAT_FIELD], CHAT_FIELD)
            _check_template_on(chat_template, CHAT_FIELD)
            example = _assistant_turns(messages, tokenizer, vocab_size, assistant_turns)
        elif row.get("text") is not None and all(row.get(k) is None for k in (*SFT_FIELDS, CHAT_FIELD)):
            example = _language_modelling(row, tokenizer, vocab_size)
        else:
            prompt, _ = _prompt(row, ("prompt_ids", "prompt"), tokenizer, vocab_size, chat_template)
            response = _tokens(row, ("response_ids", "response", "completion"), "response", tokenizer, vocab_size,
                               special=False, append_eos=True)
            example = SFTExample(prompt, response)
        if overlong == "truncate":
            cut = truncated(example.prompt_ids, example.response_ids, example.response_mask, max_len, max_prompt_len)
            if cut is None:
                raise _Skip
            if cut[0] is not example.prompt_ids or cut[1] is not example.response_ids:
                cut_rows.append(where)
            return SFTExample(*cut)
        _check_len(example.prompt_ids, max_prompt_len, "prompt", skip)
        _check_len(example.prompt_ids + example.response_ids, max_len, "prompt + response", skip)
        return example

    over = f"longer than data.max_len ({max_len} tokens)" + (
        f" or with a prompt over data.max_prompt_len ({max_prompt_len})" if max_prompt_len is not None else "")
    examples = _collect(path, parse, skipped_as="left with no response token within data.max_len"
                        if overlong == "truncate" else over)
    say_truncated(path, len(cut_rows), len(examples), max_len, max_prompt_len)
    return examples


def _language_modelling(row: dict, tokenizer: LazyTokenizer, vocab_size: int | None) -> SFTExample:
    """TRL's language-modelling row (``text``, its default ``dataset_text_field``): every token after the first
    trains (the first has none before it to be predicted from), the text tokenized with the tokenizer's special
    tokens (a BOS where it adds one) and EOS appended, as TRL's SFTTrainer does; no chat template."""
    ids = _tokens(row, ("text",), "text", tokenizer, vocab_size, special=True, append_eos=True)
    if len(ids) < 2:
        raise _BadLine("field 'text' holds fewer than 2 tokens: nothing to train")
    return SFTExample(ids[:1], ids[1:])


# An SFT row's fields besides a chat: a pair as fastrlhf names it, or as TRL's prompt-completion datasets do
SFT_FIELDS = ("prompt_ids", "prompt", "response_ids", "response", "completion")


def _prompt_and_completion(row: dict, chat_template: bool | str) -> list[dict]:
    """TRL's conversational prompt-completion row as one chat: the ``prompt`` turns (text: one user message), then
    the ``completion`` turns, which hold the trained assistant turn(s)."""
    _check_template_on(chat_template, "completion")
    prompt = row.get("prompt")
    if prompt is None:
        raise _BadLine("field 'completion' is a chat without its 'prompt' (a chat, or text as one user message)")
    if isinstance(prompt, str):
        prompt = [{"role": "user", "content": prompt}]
    elif not _is_chat(prompt):
        raise _BadLine(f"field 'prompt' must be a chat or text beside a 'completion' chat, got {_short(prompt)}")
    return _chat(prompt, "prompt") + _chat(row["completion"], "completion")


def _scored_chat(messages: list[dict], tokenizer: LazyTokenizer, vocab_size: int | None, field_name: str) -> list[int]:
    """A chat as a reward model scores it: ending with an assistant turn, that turn's content plus EOS after the
    template of the turns before it with the generation prompt (the tokens a policy's completion ends with in RL,
    so that training and scoring see the same last token); ending with another role, the template as it is."""
    if messages[-1]["role"] == "assistant":
        example = _assistant_turns(messages, tokenizer, vocab_size, "last", field_name)
        return example.prompt_ids + example.response_ids
    ids = tokenizer.chat_ids(messages, field_name, generation_prompt=False)
    _check_vocab(ids, vocab_size, field_name)
    return ids


def _pair_of_chats(row: dict, tokenizer: LazyTokenizer, vocab_size: int | None) -> PairExample:
    """A pair in TRL's conversational form: ``chosen`` and ``rejected`` chats, each a whole conversation (which may
    start with a ``prompt`` given beside it) or the reply to a ``prompt`` (a chat, or text as one user message). The
    pair's prompt is the tokens both share."""
    prompt = row.get("prompt")
    if isinstance(prompt, str):
        prompt = [{"role": "user", "content": prompt}]
    prompt = _chat(prompt, "prompt") if prompt is not None else []
    chats = {}
    for name in ("chosen", "rejected"):
        if not _is_chat(row.get(name)):
            raise _BadLine(f"field {name!r} must be a chat like the other side's, got {_short(row.get(name))}")
        chats[name] = _chat(row[name], name)
    # A whole conversation that already opens with the prompt (HuggingFaceH4/ultrafeedback_binarized: a text prompt
    # beside [user, assistant] chats) is not prefixed with it again: the reward model would score the prompt twice
    sides = [_scored_chat(chat if _starts_with(chat, prompt) else prompt + chat, tokenizer, vocab_size, name)
             for name, chat in chats.items()]
    chosen, rejected = sides
    shared = 0
    while shared < min(len(chosen), len(rejected)) - 1 and chosen[shared] == rejected[shared]:
        shared += 1
    return PairExample(chosen[:shared], chosen[shared:], rejected[shared:])


def _starts_with(chat: list[dict], prompt: list[dict]) -> bool:
    """Whether ``chat`` opens with the ``prompt`` messages (their roles and contents)."""
    return len(chat) > len(prompt) and all((m["role"], m["content"]) == (p["role"], p["content"])
                                           for m, p in zip(chat, prompt, strict=False))


def _margin(row: dict) -> float:
    """A pair's ``margin`` column (absent or null: 0), a finite number."""
    margin = row.get("margin")
    if margin is None:
        return 0.0
    if isinstance(margin, bool) or not isinstance(margin, (int, float)) or not math.isfinite(margin):
        raise _BadLine(f"field 'margin' must be a finite number, got {_short(margin)}")
    return float(margin)


def load_pairwise_examples(path: str, max_len: int, vocab_size: int | None = None, tokenizer_path: str | None = None,
                           *, chat_template_kwargs: dict | None = None, overlong: str = "error") -> list[PairExample]:
    """Preference pairs: ``{"prompt", "chosen", "rejected"}`` (text, which gets EOS as a response does, or ``*_ids``
    token lists, as given; prompt optional), or TRL's conversational form: ``chosen`` and ``rejected`` chats (whole
    conversations, or replies to a ``prompt`` chat), through the tokenizer's chat template as :func:`_scored_chat`
    renders them. An optional ``margin`` (a number, as TRL's) goes into the loss: -logsigmoid(chosen - rejected -
    margin). ``chat_template_kwargs``: the template's own variables, as in :func:`load_prompts`; ``overlong`` as in
    :func:`load_sft_examples`."""
    skip = overlong_skips(overlong)
    tokenizer = LazyTokenizer(tokenizer_path, template_kwargs=chat_template_kwargs)

    def parse(row: dict, where: str) -> PairExample:
        if _is_chat(row.get("chosen")) or _is_chat(row.get("rejected")):
            pair = _pair_of_chats(row, tokenizer, vocab_size)
            prompt, chosen, rejected = pair.prompt_ids, pair.chosen_ids, pair.rejected_ids
        else:
            prompt = _tokens(row, ("prompt_ids", "prompt"), "prompt", tokenizer, vocab_size, special=True,
                             required=False)
            # Text ends with EOS, as a chat's reply (and TRL's text pairs) does: the RL step scores a completion at
            # its EOS, a token the head would never have been trained on
            chosen = _tokens(row, ("chosen_ids", "chosen"), "chosen", tokenizer, vocab_size, special=not prompt,
                             append_eos=True)
            rejected = _tokens(row, ("rejected_ids", "rejected"), "rejected", tokenizer, vocab_size,
                               special=not prompt, append_eos=True)
        _check_len(prompt + chosen, max_len, "prompt + chosen", skip)
        _check_len(prompt + rejected, max_len, "prompt + rejected", skip)
        return PairExample(prompt, chosen, rejected, _margin(row))

    return _collect(path, parse, skipped_as=f"longer than data.max_len ({max_len} tokens)")


def load_classification_examples(path: str, max_len: int, num_labels: int, vocab_size: int | None = None,
                                 tokenizer_path: str | None = None, *,
                                 chat_template_kwargs: dict | None = None,
                                 overlong: str = "error") -> list[ClassificationExample]:
    """Labelled sequences: ``{"text"/"input_ids"/"messages", "label"}`` lines, label in [0, num_labels); a chat
    through the tokenizer's chat template as :func:`_scored_chat` renders it (``chat_template_kwargs`` as in
    :func:`load_prompts`, ``overlong`` as in :func:`load_sft_examples`)."""
    skip = overlong_skips(overlong)
    tokenizer = LazyTokenizer(tokenizer_path, template_kwargs=chat_template_kwargs)

    def parse(row: dict, where: str) -> ClassificationExample:
        chat = next((name for name in ("text", CHAT_FIELD) if _is_chat(row.get(name))), None)
        if chat is not None:
            ids = _scored_chat(_chat(row[chat], chat), tokenizer, vocab_size, chat)
        else:
            ids = _tokens(row, ("input_ids", "text"), "text", tokenizer, vocab_size, special=True)
        if "label" not in row:
            raise _BadLine("missing field 'label'")
        label = row["label"]
        if isinstance(label, bool) or not isinstance(label, int) or not 0 <= label < num_labels:
            raise _BadLine(f"label must be an integer in [0, {num_labels}), got {_short(label)}")
        _check_len(ids, max_len, "text", skip)
        return ClassificationExample(ids, label)

    return _collect(path, parse, skipped_as=f"longer than data.max_len ({max_len} tokens)")


def check_columns(examples: list[PromptExample], required: dict[str, list[str]]) -> None:
    """Every column that a reward function needs (``{function name: [column, ...]}``, from
    ``fastrlhf.rl.rewards.required_columns``) is a key of every prompt's ``meta`` (a null value counts as
    present: the function is then called with None for that row); else a DataError naming each row."""
    problems = []
    for example in examples:
        for name, columns in required.items():
            for column in columns:
                if column not in example.meta:
                    problems.append(f"{example.source or '(unknown row)'}: reward function {name!r} needs column "
                                    f"{column!r}, which this row lacks")
    if problems:
        raise DataError(problems)


def uneven_columns(examples: list[PromptExample]) -> list[str]:
    """One line per column that some rows have and others lack, naming it, how many rows lack it and the
    first of them. Such a row reaches a reward function as None for that column, as a ``datasets``
    column filled with nulls would: a column name mistyped in some rows shows only as a flat reward curve.
    (In Parquet and ``datasets`` folders every row has every column, null or not: none is uneven there.)"""
    have = Counter(column for example in examples for column in example.meta)
    lines = []
    for column, count in have.items():
        if count < len(examples):
            first = next(e.source or "(unknown row)" for e in examples if column not in e.meta)
            lines.append(f"column {column!r} is missing from {len(examples) - count} of {len(examples)} rows, "
                         f"first at {first}")
    return lines


def report_uneven_columns(examples: list[PromptExample], strict: bool = False) -> None:
    """:func:`uneven_columns` as one warning line each on rank 0, or with ``strict`` (``data.strict_columns``)
    as a DataError."""
    uneven = uneven_columns(examples)
    if uneven and strict:
        raise DataError([f"{line} (data.strict_columns is true)" for line in uneven])
    if os.environ.get("RANK", "0") == "0":
        for line in uneven:
            print(f"warning: data: {line} (data.strict_columns: true makes this an error)", file=sys.stderr,
                  flush=True)
