"""Fixtures of the episode tests: the tiny chat tokenizer (ChatML, tool-call tags) and its Qwen3-template copy."""

import copy

import pytest

from tests.helpers.episodes_templates import QWEN3


@pytest.fixture(scope="module")
def tokenizer():
    from fastrlhf.modeling.tiny_chat import build_chat_tokenizer

    return build_chat_tokenizer()


@pytest.fixture(scope="module")
def qwen3(tokenizer):
    t = copy.deepcopy(tokenizer)
    t.chat_template = QWEN3
    return t
