"""vLLM ends completions at ``rollout.stop`` strings itself (vllmstop audit): the engine used to run without a
tokenizer, so vLLM ignored the strings and every completion ran to ``max_new_tokens`` before the cut. One tiny
vLLM engine for the module (seconds)."""

import os
from dataclasses import replace

import pytest
import torch

from fastrlhf.modeling.tiny import save_tiny_llama
from fastrlhf.rollout import SamplingConfig
from fastrlhf.rollout.base import cut_at_stop_strings

VOCAB = 320  # the byte-level BPE's whole vocabulary, and the one-character tokenizer's
MAX_NEW = 64


def _prompts(lengths, high=VOCAB, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, high, (n,), generator=g).tolist() for n in lengths]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    pytest.importorskip("vllm")
    root = tmp_path_factory.mktemp("vllmstop_model")
    # A peaked init: greedy completions are stable across batch shapes.
    save_tiny_llama(root, seed=1, initializer_range=0.2, vocab_size=VOCAB, hidden_size=64, num_heads=2)
    saved = os.environ.pop("TRITON_INTERPRET", None)  # conftest's Triton interpreter must not reach vLLM's start-up
    from fastrlhf.rollout import VLLMEngine

    eng = VLLMEngine(str(root), dtype="float32", max_model_len=128, kv_cache_bytes=16 << 20)
    if saved is not None:
        os.environ["TRITON_INTERPRET"] = saved
    yield eng
    eng.close()


@pytest.fixture
def generated(monkeypatch):
    """What vLLM itself returned at each call, before any cut: [(tokens, finish_reason), ...] per call."""
    from fastrlhf.rollout import vllm_adapter

    calls, run = [], vllm_adapter.run_generate

    def spy(*args, **kwargs):
        raw = run(*args, **kwargs)
        calls.append([(len(t), fr) for samples in raw for t, _, fr in samples])
        return raw

    monkeypatch.setattr(vllm_adapter, "run_generate", spy)
    return calls


def _ids(results):
    return [[c.token_ids for c in samples] for samples in results]


def test_vllm_stops_rows_at_the_stop_string_not_at_max_new_tokens(engine, generated, monkeypatch):
    """Stop strings completed at the 8th token of each greedy row: vLLM generated all 64 tokens of every row
    (finish "length", 512 tokens for 64 kept) before the cut; now it ends each row at the completing token."""
    from tests.helpers.rollout3_tokenizers import one_char_per_token_tokenizer

    tokenizer = one_char_per_token_tokenizer(VOCAB)
    engine.tokenizer = tokenizer
    try:
        prompts = _prompts([5, 9, 17, 30, 12, 21, 7, 25], high=95)  # printable ASCII prompts
        free = engine.generate(prompts, SamplingConfig(temperature=0, max_new_tokens=MAX_NEW, ignore_eos=True))
        stops = tuple(sorted({tokenizer.decode(c.token_ids[6:8]) for samples in free for c in samples}))
        expected = cut_at_stop_strings(free, stops, tokenizer)
        generated.clear()
        # The logprobs stay numbers: no text decoded for each one (most of the detokenizer's cost).
        from vllm.v1.engine import logprobs

        monkeypatch.setattr(logprobs, "convert_ids_list_to_tokens", lambda *a: pytest.fail("logprob text decoded"))
        sampling = SamplingConfig(temperature=0, max_new_tokens=MAX_NEW, ignore_eos=True, stop=stops)
        got = engine.generate(prompts, sampling)
    finally:
        engine.tokenizer = None
    kept = [len(c.token_ids) for samples in got for c in samples]
    assert all(n <= 8 for n in kept)
    assert generated == [[(n, "stop") for n in kept]]  # what vLLM generated is what is kept
    assert _ids(got) == _ids(expected)  # the cut's tokens, the completing token kept
    assert all(c.finish_reason == "stop" for samples in got for c in samples)
    for samples, free_samples in zip(got, free, strict=True):  # the sampled logprobs, not recomputed ones
        c, f = samples[0], free_samples[0]
        assert torch.allclose(torch.tensor(c.logprobs), torch.tensor(f.logprobs[: len(c.logprobs)]), atol=1e-5)


def test_sampled_rows_are_the_cut_of_the_unstopped_rows(engine, generated, tmp_path):
    """Seeded samples (n=3) under a byte-level BPE, with prompts ending inside a character: vLLM's decoder adds
    such a prompt's pending bytes to the first token's text and may see a stop string there that the cut (the
    completion alone) does not; those prompts run again without stop strings, so every row is still exactly
    the cut of the unstopped one, and vLLM generates fewer tokens than the 64 per row it used to."""
    from transformers import AutoTokenizer

    from tests.helpers.data3_tokenizers import save_tokenizer

    tokenizer = AutoTokenizer.from_pretrained(save_tokenizer(tmp_path))
    prompts = _prompts(range(3, 40, 3))
    assert any(tokenizer.decode(p).endswith("\ufffd") for p in prompts)  # the case this test is about
    engine.tokenizer = tokenizer
    try:
        for stops in [("e",), ("ll", " a")]:
            free_sampling = SamplingConfig(n=3, temperature=1.0, max_new_tokens=MAX_NEW, ignore_eos=True, seed=7)
            free = engine.generate(prompts, free_sampling)
            generated.clear()
            got = engine.generate(prompts, replace(free_sampling, stop=stops))
            expected = cut_at_stop_strings(free, stops, tokenizer)
            assert _ids(got) == _ids(expected), stops
            assert [c.finish_reason for s in got for c in s] == [c.finish_reason for s in expected for c in s]
            for samples, free_samples in zip(got, free, strict=True):
                for c, f in zip(samples, free_samples, strict=True):
                    assert torch.allclose(
                        torch.tensor(c.logprobs), torch.tensor(f.logprobs[: len(c.logprobs)]), atol=1e-5
                    )
            made = sum(n for call in generated for n, _ in call)
            assert made < sum(len(c.token_ids) for samples in free for c in samples), (stops, made)
    finally:
        engine.tokenizer = None


def test_only_requests_with_stop_strings_make_text():
    """Without stop strings vLLM decodes nothing (today's path); with them it decodes as the cut does (special
    tokens' text included) and keeps the stop string in the text, so it ends the row at the completing token."""
    pytest.importorskip("vllm")
    from fastrlhf.rollout.vllm_adapter import make_sampling_params

    plain = make_sampling_params(SamplingConfig(max_new_tokens=8), 8, [2])
    assert (plain.detokenize, plain.stop) == (False, [])
    stopped = make_sampling_params(SamplingConfig(max_new_tokens=8, stop=("\n\n", "Q:")), 8, [2])
    assert stopped.stop == ["\n\n", "Q:"] and stopped.detokenize
    assert stopped.include_stop_str_in_output and not stopped.skip_special_tokens
    assert (stopped.stop_token_ids, stopped.logprobs, stopped.max_tokens) == ([2], 0, 8)
