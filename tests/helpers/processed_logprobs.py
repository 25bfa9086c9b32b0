"""The distribution a rollout engine samples from under ``rollout.repetition_penalty``, ``min_p`` and ``top_p``,
written with transformers' own processors in vLLM's order, on the model's device: what the GPU proof
(tests/gpu/test_new_settings_on_cuda.py) compares the HF engine's logprobs to on CUDA.

vLLM's order (vllm/v1/sample/sampler.py): penalties in ``apply_logits_processors``, then ``apply_temperature``, the
argmax-invariant ``MinPLogitsProcessor``, then ``topk_topp_sampler``; HF's own generate puts min-p after top-p.
``RepetitionPenaltyLogitsProcessor`` reads the whole unpadded history (prompt + the tokens so far); logits below 0
are multiplied by the penalty, the others divided (vllm/_custom_ops.py's ``apply_repetition_penalties_torch``
alike). tests/rollout/test_sampling_penalties.py writes the same on the CPU."""

import torch


def hf_processed_logprobs(model, prompt: list[int], tokens: list[int], sampling) -> torch.Tensor:
    """[T, V] fp32 log-probabilities, on the model's device, of the distribution each of ``tokens`` (a completion of
    ``prompt``) was sampled from under ``sampling`` (a :class:`fastrlhf.rollout.SamplingConfig`)."""
    from transformers.generation.logits_process import (
        MinPLogitsWarper,
        RepetitionPenaltyLogitsProcessor,
        TemperatureLogitsWarper,
        TopPLogitsWarper,
    )

    device = next(model.parameters()).device
    ids = torch.tensor([prompt + tokens], device=device)
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    rows = []
    for t in range(len(tokens)):
        history = ids[:, : len(prompt) + t]
        z = logits[t : t + 1].clone()
        if sampling.repetition_penalty != 1.0:
            z = RepetitionPenaltyLogitsProcessor(penalty=sampling.repetition_penalty)(history, z)
        z = TemperatureLogitsWarper(sampling.temperature)(history, z)
        if sampling.min_p > 0:
            z = MinPLogitsWarper(min_p=sampling.min_p)(history, z)
        if sampling.top_p < 1:
            z = TopPLogitsWarper(top_p=sampling.top_p)(history, z)
        rows.append(torch.log_softmax(z, -1)[0])
    return torch.stack(rows)


def logprob_gaps(model, prompts, results, sampling) -> torch.Tensor:
    """|reported - processed| logprob of every generated token of ``results`` (an engine's completions of
    ``prompts``), flat, on the host."""
    gaps = []
    for prompt, samples in zip(prompts, results, strict=True):
        for c in samples:
            expected = hf_processed_logprobs(model, prompt, c.token_ids, sampling).cpu()
            recomputed = expected.gather(-1, torch.tensor(c.token_ids)[:, None]).squeeze(-1)
            gaps.append((recomputed - torch.tensor(c.logprobs)).abs())
    return torch.cat(gaps)
