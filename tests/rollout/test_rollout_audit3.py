"""Audit of the generation path (third round): sampling parity of the engines with the trainer's logprobs,
unseeded HF sampling, and SamplingConfig's own checks. One tiny vLLM engine for the module (seconds)."""

import os

import pytest
import torch

from fastrlhf.algorithms import logprobs_from_logits
from fastrlhf.modeling.tiny import save_tiny_llama
from fastrlhf.rollout import HFEngine, SamplingConfig

# A narrow init gives flat next-token distributions: unseeded samples differ call to call.
MODEL_KW = dict(initializer_range=0.02, vocab_size=256, hidden_size=64, num_heads=2)


def _prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 256, (n,), generator=g).tolist() for n in lengths]


PROMPTS = _prompts([5, 17, 30])


def _tokens(results):
    return [[c.token_ids for c in samples] for samples in results]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("rollout3_model")
    return root, save_tiny_llama(root, seed=1, **MODEL_KW)


@pytest.fixture(scope="module")
def vllm_engine(tiny):
    pytest.importorskip("vllm")
    saved = os.environ.pop("TRITON_INTERPRET", None)  # conftest's Triton interpreter must not reach vLLM's start-up
    from fastrlhf.rollout import VLLMEngine

    engine = VLLMEngine(str(tiny[0]), dtype="float32", max_model_len=128, kv_cache_bytes=16 << 20)
    if saved is not None:
        os.environ["TRITON_INTERPRET"] = saved
    yield engine
    engine.close()


def test_hf_unseeded_calls_draw_new_samples_and_follow_the_callers_seed(tiny):
    """fork_rng rewinds the global generator after each generate: an unseeded call used to start from the state the
    previous one started from, and so repeated its samples exactly (every unseeded call, the same completions)."""
    engine = HFEngine(tiny[1])
    sampling = SamplingConfig(n=2, temperature=1.0, max_new_tokens=12, ignore_eos=True)
    torch.manual_seed(0)
    first, second = _tokens(engine.generate(PROMPTS, sampling)), _tokens(engine.generate(PROMPTS, sampling))
    assert first != second
    torch.manual_seed(0)  # and still reproducible from the caller's own seed
    assert _tokens(engine.generate(PROMPTS, sampling)) == first
    seeded = SamplingConfig(n=2, temperature=1.0, max_new_tokens=12, ignore_eos=True, seed=5)
    assert _tokens(engine.generate(PROMPTS, seeded)) == _tokens(engine.generate(PROMPTS, seeded))


@pytest.mark.slow
def test_vllm_refuses_a_temperature_it_would_silently_raise(tiny, vllm_engine, monkeypatch):
    """vLLM lifts a temperature in (0, 0.01) to 0.01 with a log line: at 0.005 its logprobs were 3.2 nats off the
    trainer's recomputation at 0.005 (HF: 3e-5). Refused before any generation, naming the field."""
    from vllm.sampling_params import _MAX_TEMP

    from fastrlhf.rollout import vllm_adapter

    monkeypatch.setattr(vllm_adapter, "run_generate", lambda *a: pytest.fail("generation started"))
    with pytest.raises(ValueError, match=r"SamplingConfig.temperature 0.005 is below vLLM's smallest, 0.01"):
        vllm_engine.generate(PROMPTS, SamplingConfig(temperature=0.005, max_new_tokens=4, seed=1))
    monkeypatch.undo()
    assert vllm_adapter.VLLM_MIN_TEMPERATURE == _MAX_TEMP  # the bound is vLLM's own
    # From 0.01 up vLLM samples at the temperature asked for, and its logprobs are the trainer's.
    sampling = SamplingConfig(n=2, temperature=0.01, max_new_tokens=8, seed=3, ignore_eos=True)
    worst = 0.0
    for prompt, samples in zip(PROMPTS, vllm_engine.generate(PROMPTS, sampling), strict=True):
        for c in samples:
            with torch.no_grad():
                logits = tiny[1](torch.tensor([prompt + c.token_ids])).logits[0, len(prompt) - 1 : -1]
            recomputed = logprobs_from_logits(logits, torch.tensor(c.token_ids), sampling.temperature)
            worst = max(worst, (recomputed - torch.tensor(c.logprobs)).abs().max().item())
    assert worst < 1e-2


@pytest.mark.slow
@pytest.mark.parametrize("top_p,top_k", [(0.7, -1), (1.0, 5), (0.9, 10)])
def test_engines_report_logprobs_of_the_same_truncated_distribution(tiny, vllm_engine, top_p, top_k):
    """With top-k/top-p both engines report logprobs renormalised over the kept tokens (Completion's contract):
    vLLM's processed_logprobs and HF's recorder alike, against apply_sampling_filters recomputed."""
    from fastrlhf.rollout.hf_engine import apply_sampling_filters

    sampling = SamplingConfig(
        n=2, temperature=0.8, top_p=top_p, top_k=top_k, max_new_tokens=12, seed=3, ignore_eos=True
    )
    for engine in (vllm_engine, HFEngine(tiny[1])):
        worst = 0.0
        for prompt, samples in zip(PROMPTS, engine.generate(PROMPTS, sampling), strict=True):
            for c in samples:
                with torch.no_grad():
                    logits = tiny[1](torch.tensor([prompt + c.token_ids])).logits[0, len(prompt) - 1 : -1]
                kept = torch.log_softmax(apply_sampling_filters(logits, sampling), -1)
                recomputed = kept.gather(-1, torch.tensor(c.token_ids)[:, None]).squeeze(-1)
                worst = max(worst, (recomputed - torch.tensor(c.logprobs)).abs().max().item())
        assert worst < 1e-4, (engine.kind, worst)


def test_greedy_with_several_samples_is_refused_by_the_config_not_by_an_engine():
    """n > 1 at temperature 0 used to pass SamplingConfig and fail inside generate, in each engine's words (HF:
    "Greedy methods ... num_return_sequences", vLLM: its VLLMValidationError)."""
    with pytest.raises(ValueError, match="SamplingConfig.n must be 1 with temperature 0"):
        SamplingConfig(n=2, temperature=0)
    assert SamplingConfig(n=1, temperature=0).greedy and SamplingConfig(n=2, temperature=0.5).n == 2


@pytest.mark.parametrize("task_type", ["CAUSAL_LM", None])
def test_hf_generate_on_a_lora_model_keeps_and_ignores_the_checkpoints_generation_config(tmp_path, task_type):
    """HFEngine swaps a blank generation_config in for generate (a checkpoint's repetition_penalty, top_k... would
    fill the unset fields) and restores it after. On a PEFT wrapper it swapped the wrapper's only: the LoRA actor's
    (task CAUSAL_LM) transformers model was left with a blank config for good (eos None), and a wrapper without a
    task sampled under the checkpoint's penalty and warpers (0.25 nats off the trainer's recomputation)."""
    peft = pytest.importorskip("peft")
    from transformers import GenerationConfig

    model = save_tiny_llama(tmp_path, seed=1, **{**MODEL_KW, "initializer_range": 0.05})
    checkpoint = dict(repetition_penalty=3.0, temperature=0.3, top_k=3, top_p=0.5, do_sample=True, eos_token_id=[7, 9])
    model.generation_config = GenerationConfig(**checkpoint)
    lora = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type=task_type))
    sampling = SamplingConfig(n=2, temperature=1.0, max_new_tokens=16, seed=3, ignore_eos=True)
    results = HFEngine(lora).generate(PROMPTS, sampling)
    kept = lora.get_base_model().generation_config
    assert (kept.eos_token_id, kept.repetition_penalty, kept.top_k) == ([7, 9], 3.0, 3)
    worst = 0.0
    for prompt, samples in zip(PROMPTS, results, strict=True):
        for c in samples:
            with torch.no_grad():
                logits = lora(input_ids=torch.tensor([prompt + c.token_ids])).logits[0, len(prompt) - 1 : -1]
            recomputed = logprobs_from_logits(logits, torch.tensor(c.token_ids), 1.0)
            worst = max(worst, (recomputed - torch.tensor(c.logprobs)).abs().max().item())
    assert worst < 1e-4


def test_hf_stop_strings_begun_in_the_prompt_neither_stop_nor_pad_the_row(tmp_path):
    """HF's StopStringCriteria read the whole sequence: a stop string made of the prompt's last character and the
    completion's first ended the row at once, though the completion holds no stop string. The cut (like vLLM)
    reads the completion only, so the row came back as 1 token and 23 pad tokens, finish "length", the pads then
    trained on as the policy's tokens."""
    from tests.helpers.rollout3_tokenizers import one_char_per_token_tokenizer

    tokenizer = one_char_per_token_tokenizer()
    model = save_tiny_llama(tmp_path, seed=1, **{**MODEL_KW, "initializer_range": 0.2})  # peaked: greedy is stable
    engine = HFEngine(model, tokenizer=tokenizer)
    greedy = SamplingConfig(temperature=0, max_new_tokens=24, ignore_eos=True)
    free = engine.generate(PROMPTS[:2], greedy)[0][0].token_ids
    stop = tokenizer.decode([PROMPTS[0][-1], free[0]])
    if stop in tokenizer.decode(free):  # the check below needs a completion without the stop string
        pytest.skip("the greedy completion holds the boundary string itself")
    c = engine.generate(PROMPTS[:2], SamplingConfig(temperature=0, max_new_tokens=24, ignore_eos=True, stop=(stop,)))
    assert (c[0][0].token_ids, c[0][0].finish_reason) == (free, "length")
    # A stop string inside the completion still ends it there.
    inside = tokenizer.decode(free[3:5])
    c = engine.generate(PROMPTS[:1], SamplingConfig(temperature=0, max_new_tokens=24, ignore_eos=True, stop=(inside,)))
    end = tokenizer.decode(free).index(inside) + 2
    assert (c[0][0].token_ids, c[0][0].finish_reason) == (free[:end], "stop")
