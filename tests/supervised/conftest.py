import pytest


@pytest.fixture(scope="module")
def chat_tokenizer(tmp_path_factory):
    """``(folder, tokenizer)``: the tiny chat model's tokenizer (Qwen2.5's chat template), saved once per module."""
    from fastrlhf.modeling.tiny_chat import build_chat_tokenizer

    folder = tmp_path_factory.mktemp("tok")
    tokenizer = build_chat_tokenizer()
    tokenizer.save_pretrained(folder)
    return str(folder), tokenizer
