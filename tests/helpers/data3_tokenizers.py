"""Small byte-level BPE tokenizers with a ChatML template, saved to folders, for the data audit's tests."""

CORPUS = [
    "what is two plus two",
    "the answer is four",
    "you are a helpful assistant",
    "hello world",
    "calling the weather tool",
    "it is sunny",
]

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
    "{% if m.get('tool_calls') %}{% for c in m['tool_calls'] %}<tool_call>{{ c['function']['name'] }}"
    "</tool_call>{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def save_tokenizer(folder, template: str | None = CHATML, eos: str = "<|im_end|>") -> str:
    """A tokenizer with ``template`` and EOS ``eos`` (``<|endoftext|>``: a base model's, whose template ends
    turns with ``<|im_end|>`` all the same), saved in ``folder``."""
    import tokenizers
    from tokenizers import decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 5, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>", eos_token=eos)
    fast.chat_template = template
    fast.save_pretrained(folder)
    return str(folder)
