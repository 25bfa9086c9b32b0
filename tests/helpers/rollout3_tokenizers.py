"""A real fast tokenizer whose every token is one character, for stop-string tests (rollout audit 3)."""


def one_char_per_token_tokenizer(vocab_size: int = 256):
    """Printable ASCII, then CJK characters, one token each; eos is the second character."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = [chr(32 + i) for i in range(95)] + [chr(0x4E00 + i) for i in range(vocab_size - 95)]
    tok = Tokenizer(models.WordLevel({c: i for i, c in enumerate(chars)}, unk_token=chars[0]))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=chars[1])
