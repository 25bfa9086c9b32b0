"""A tiny chat model made here in one command, no model hub: a Qwen2-architecture model from random init
(GQA, q/k/v biases, tied embeddings, Qwen2's 151,936-row vocabulary) and a byte-level BPE tokenizer
trained on the spot with ``tokenizers`` (Qwen2's pre-tokenizer split, ChatML special tokens and
Qwen2.5's chat template, tools and ``<tool_call>`` included), saved together as one Hugging Face folder
that ``AutoModelForCausalLM`` and ``AutoTokenizer`` load:

    python -m fastrlhf.modeling.tiny_chat runs/tiny-chat

It reads ``messages`` rows, text rewards and chat SFT data as a Qwen2.5-Instruct folder does, through
the same code paths (only the weights are random). The arithmetic example (examples/arithmetic/model.py)
builds its model with :func:`build_chat_tokenizer` and :func:`build_chat_model` on its own corpus.

- Tokenizer: ``<|endoftext|>`` (pad, id 0), ``<|im_start|>`` (1), ``<|im_end|>`` (eos, 2), then the
  BPE vocabulary; :data:`TOOL_TOKENS` (``<tool_call>``, ``</tool_call>``) are added as single tokens
  that decoding keeps (not special, as in Qwen2.5), so a reward can read a tool call.
- Chat template (:data:`CHAT_TEMPLATE`): Qwen2.5's, without its default system message (prompts stay
  short): ``apply_chat_template(messages, tools=[...])`` lists the tools' JSON schemas in the system
  turn, an assistant turn's ``tool_calls`` become ``<tool_call>{...}</tool_call>`` blocks, ``tool``
  turns become ``<tool_response>`` blocks in a user turn.
- Model: 2 layers, hidden 128, 4 query heads over 2 key/value heads (head size 32, which vLLM's CPU
  backend runs), about 20M parameters, 19.4M of them the embedding.
"""

from __future__ import annotations

import argparse
import os
import shutil

__all__ = ["QWEN2_VOCAB_SIZE", "QWEN2_SPLIT", "SPECIAL_TOKENS", "TOOL_TOKENS", "CHAT_TEMPLATE", "TINY_CHAT_SHAPE",
           "CORPUS", "build_chat_tokenizer", "build_chat_model", "save_chat_model", "save_tiny_chat", "main"]

QWEN2_VOCAB_SIZE = 151936
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2
TOOL_TOKENS = ["<tool_call>", "</tool_call>"]
TINY_CHAT_SHAPE = dict(hidden_size=128, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, max_position_embeddings=1024)
# Qwen2's pre-tokenizer split: contractions, letters with one leading non-letter, single digits,
# punctuation runs, newlines, spaces.
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
               r"|\s+(?!\S)|\s+")
_TOOLS_INTRO = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided "
                "with function signatures within <tools></tools> XML tags:\n<tools>")
_TOOLS_OUTRO = ("\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
                "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
                "<args-json-object>}\n</tool_call>")
# Qwen2.5-Instruct's template, less its default system message: without tools or tool turns it renders
# plain ChatML, '<|im_start|>{role}\n{content}<|im_end|>\n' per message.
CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{- " + repr(_TOOLS_INTRO) + " }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- " + repr(_TOOLS_OUTRO) + " + '<|im_end|>\\n' }}"
    "{%- elif messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) or "
    "(message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>' + message.role }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + tool_call.name + '\", \"arguments\": ' }}"
    "{%- if tool_call.arguments is string %}{{- tool_call.arguments }}{%- else %}{{- tool_call.arguments | tojson }}"
    "{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or (messages[loop.index0 - 1].role != 'tool') %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or (messages[loop.index0 + 1].role != 'tool') %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# What the tokenizer of the tiny chat model is trained on: short chats, numbers, JSON and the template's
# own text, so that prompts of the README's and docs' examples take few tokens.
CORPUS = [
    "system\nuser\nassistant\ntool\n", _TOOLS_INTRO + _TOOLS_OUTRO,
    "You are a helpful assistant. Answer with a number. Let's think step by step.",
    "Tom has 7 apples and buys 5 more. How many apples does Tom have now? 7 + 5 = 12. The answer is 12.",
    "What is 2 + 3? The answer is 5. What is 9 - 4? The answer is 5. What is 6 x 7? The answer is 42.",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May.",
    '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}',
    '{"type": "function", "function": {"name": "add", "description": "Add two numbers", "parameters": '
    '{"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}, "required": ["a", "b"]}}}',
    "The weather in Paris is sunny, 21 degrees. Thank you! Hello, how can I help you today?",
    "The quick brown fox jumps over the lazy dog. A reward of 1.0 for a correct answer, 0.0 otherwise.",
]


def build_chat_tokenizer(texts=CORPUS, vocab_size: int = 1024, model_max_length: int = 1024,
                         tool_tokens: bool = True):
    """A ``PreTrainedTokenizerFast``: byte-level BPE of at most ``vocab_size`` entries trained on ``texts``
    (any text still tokenizes: the 256 byte symbols are in the vocabulary), the ChatML special tokens at
    ids 0-2, :data:`CHAT_TEMPLATE`, and with ``tool_tokens`` the :data:`TOOL_TOKENS` after the vocabulary."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    # The chat markup ("user", "assistant", newlines) is text the model reads too.
    tok.train_from_iterator([*texts, "user\nassistant\n"], trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                        unk_token=None, bos_token=None, additional_special_tokens=["<|im_start|>"],
                                        chat_template=CHAT_TEMPLATE, model_max_length=model_max_length,
                                        clean_up_tokenization_spaces=False)
    if tool_tokens:
        tokenizer.add_tokens(TOOL_TOKENS)
    return tokenizer


def build_chat_model(tokenizer, seed: int = 0, vocab_rows: int = QWEN2_VOCAB_SIZE, **shape):
    """A random-init ``Qwen2ForCausalLM`` of :data:`TINY_CHAT_SHAPE` (``shape`` overrides it) with
    ``vocab_rows`` embedding rows (tied, the tokenizer using the first ``len(tokenizer)``, as a real Qwen2
    leaves its padded rows unused) and the tokenizer's eos/pad."""
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    if vocab_rows < len(tokenizer):
        raise ValueError(f"vocab_rows must hold the tokenizer's {len(tokenizer)} tokens, got {vocab_rows}")
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    config = Qwen2Config(vocab_size=vocab_rows, tie_word_embeddings=True, bos_token_id=None, eos_token_id=eos,
                         pad_token_id=pad, **{**TINY_CHAT_SHAPE, **shape})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=pad, bos_token_id=None)
    return model


def save_chat_model(out_dir: str | os.PathLike, model, tokenizer) -> dict:
    """``save_pretrained`` model and tokenizer into ``out_dir`` (written beside it, then renamed into place,
    replacing a previous one); returns a summary.

    Replaced as ``export_hf`` replaces ``final/`` (``fastrlhf.modeling.loading._replace_folder``): a kill at any
    moment leaves a whole model in ``out_dir``, or (between its two renames) in ``out_dir.old``, which the next call
    puts back first."""
    from fastrlhf.modeling.loading import _replace_folder

    out_dir = os.fspath(out_dir).rstrip(os.sep)
    tmp, old = f"{out_dir}.tmp", f"{out_dir}.old"
    if os.path.isdir(old) and not os.path.exists(out_dir):
        os.rename(old, out_dir)
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    _replace_folder(tmp, out_dir)
    return {"parameters": sum(p.numel() for p in model.parameters()),
            "embedding_parameters": model.get_input_embeddings().weight.numel(),
            "tokenizer_vocab": len(tokenizer), "model_vocab": model.config.vocab_size}


def save_tiny_chat(out_dir: str | os.PathLike, seed: int = 0, vocab_rows: int = QWEN2_VOCAB_SIZE, **shape) -> dict:
    """The tiny chat model (tokenizer trained on :data:`CORPUS`) saved into ``out_dir``; returns a summary."""
    tokenizer = build_chat_tokenizer()
    return save_chat_model(out_dir, build_chat_model(tokenizer, seed=seed, vocab_rows=vocab_rows, **shape), tokenizer)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fastrlhf.modeling.tiny_chat",
                                     description="Make a tiny Qwen2-shaped chat model (random weights, a tokenizer "
                                                 "trained here, Qwen2.5's chat template with tools) in OUT.")
    parser.add_argument("out", metavar="OUT", help="the folder to write (replaced if it exists), e.g. runs/tiny-chat")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vocab-rows", type=int, default=QWEN2_VOCAB_SIZE,
                        help=f"embedding rows (default {QWEN2_VOCAB_SIZE}, Qwen2's; a few thousand is faster on a CPU)")
    args = parser.parse_args(argv)
    info = save_tiny_chat(args.out, seed=args.seed, vocab_rows=args.vocab_rows)
    print(f"{args.out}: Qwen2 chat model, {info['parameters'] / 1e6:.1f}M parameters (random init), tokenizer of "
          f"{info['tokenizer_vocab']} tokens with a chat template (tools supported), {info['model_vocab']} "
          f"embedding rows; model.path: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
