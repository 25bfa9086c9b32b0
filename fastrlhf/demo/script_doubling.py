"""The demo task: double a four-digit number and answer in the script the prompt asks for.

A prompt is ``S`` + prefix + ``:`` + a number from 1000 to 9999 + ``x2=``; the prefix is ``数字``
(answer in digits), ``小写`` (lower-case Chinese numerals) or ``大写`` (upper-case, financial
numerals). The correct completion is twice the number, digit by digit in that script, then ``E``:
``S小写:2018x2=`` -> ``四〇三六E``. Pretraining uses the prefix ``__`` with a random script, so a
pretrained model doubles correctly but picks the script at random; RL has to fix that choice.

Every character is one token. The tokenizer is a real Hugging Face tokenizer (built with the
``tokenizers`` library), saved beside the model so transformers and vLLM load the folder as-is.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from dataclasses import dataclass

PAD, BOS, EOS = "P", "S", "E"
DIGITS = "0123456789"
SCRIPTS = {
    "digits": DIGITS,
    "lower": "〇一二三四五六七八九",
    "upper": "零壹贰叁肆伍陆柒捌玖",
}
PREFIXES = {"digits": "数字", "lower": "小写", "upper": "大写"}
UNPREFIXED = "__"
# Token ids follow this order (the seed tutorial's), so ids are stable across runs and machines.
VOCAB = PAD + BOS + EOS + DIGITS + SCRIPTS["lower"] + SCRIPTS["upper"] + "数字大写小:=_x"
TOKEN_ID = {ch: i for i, ch in enumerate(VOCAB)}
PAD_ID, BOS_ID, EOS_ID = TOKEN_ID[PAD], TOKEN_ID[BOS], TOKEN_ID[EOS]

_PROMPT = re.compile(r"^S(数字|小写|大写|__):(\d{4})x2=$")


@dataclass(frozen=True)
class Example:
    prompt: str  # e.g. "S小写:2018x2="
    completion: str  # e.g. "四〇三六E"
    script: str  # key of SCRIPTS


def encode(text: str) -> list[int]:
    try:
        return [TOKEN_ID[ch] for ch in text]
    except KeyError as err:
        raise ValueError(f"character {err.args[0]!r} is not in the script-doubling vocabulary") from None


def decode(ids: Sequence[int]) -> str:
    return "".join(VOCAB[i] if 0 <= i < len(VOCAB) else "?" for i in ids)


def answer(number: int, script: str) -> str:
    """Twice ``number`` written digit by digit in ``script``, then EOS."""
    return "".join(SCRIPTS[script][int(d)] for d in str(2 * number)) + EOS


def make_example(rng: random.Random, prefixed: bool, script: str | None = None) -> Example:
    number = rng.randint(1000, 9999)
    script = script or rng.choice(list(SCRIPTS))
    prefix = PREFIXES[script] if prefixed else UNPREFIXED
    return Example(f"{BOS}{prefix}:{number}x2=", answer(number, script), script)


def requested_script(prompt: str) -> str | None:
    """The script a prefixed prompt asks for (a key of SCRIPTS); None for an unprefixed or malformed one."""
    match = _PROMPT.match(prompt)
    if match is None or match.group(1) == UNPREFIXED:
        return None
    return next(s for s, p in PREFIXES.items() if p == match.group(1))


def expected_completion(prompt: str) -> str | None:
    """The correct completion of a prefixed prompt; None for an unprefixed or malformed one."""
    script = requested_script(prompt)
    return None if script is None else answer(int(_PROMPT.match(prompt).group(2)), script)


def reward(prompt_ids: Sequence[int], completion_ids: Sequence[int], meta: dict | None = None) -> float:
    """Rule reward: 1.0 for an exact match (answer in the requested script, then EOS, nothing more), else 0.0.

    Reads token ids, not text, so special tokens (EOS) count exactly as generated.
    """
    expected = expected_completion(decode(prompt_ids))
    return float(expected is not None and decode(completion_ids) == expected)


def completion_script(completion: str) -> str | None:
    """The script a completion's answer is written in, if all its characters share one."""
    body = completion[:-1] if completion.endswith(EOS) else completion
    for script, chars in SCRIPTS.items():
        if body and all(ch in chars for ch in body):
            return script
    return None


def build_tokenizer():
    """A character-level ``PreTrainedTokenizerFast`` over VOCAB with S/E/P as bos/eos/pad."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel(vocab=dict(TOKEN_ID), unk_token=PAD))
    # Every character is its own token: split on each character and keep it.
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()  # WordLevel would join tokens with spaces
    return PreTrainedTokenizerFast(tokenizer_object=core, bos_token=BOS, eos_token=EOS, pad_token=PAD,
                                   unk_token=PAD, clean_up_tokenization_spaces=False)
