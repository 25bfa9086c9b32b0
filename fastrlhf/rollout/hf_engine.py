"""Rollout with transformers ``generate`` on the trainer's own model: no second copy of the weights.

The default on CPU for small models (vLLM's per-step overhead dominates there, see
``fastrlhf.rollout.engine_choice``) and the reference the vLLM engine is tested against.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable

import torch

from fastrlhf.engine.device import to_device
from fastrlhf.modeling.compile import eager_layers
from fastrlhf.modeling.heads import fp32_logits_head
from fastrlhf.rollout.base import (
    RolloutEngine,
    cut_at_stop_strings,
    eos_token_ids_with,
    new_token_limits,
    stop_token_ids_for,
    validate_prompts,
)
from fastrlhf.rollout.sampling import Completion, SamplingConfig

__all__ = ["HFEngine", "apply_sampling_filters", "seen_tokens"]

_NEVER_SAMPLED_ID = 2**31 - 1


def apply_sampling_filters(logits: torch.Tensor, sampling: SamplingConfig, seen: torch.Tensor | None = None
                           ) -> torch.Tensor:
    """fp32 logits of the distribution the engine samples from: the repetition penalty on the tokens ``seen``
    (a [rows, V] bool mask; None: no penalty), then temperature, min-p, top-k and top-p.

    vLLM's order (its v1 sampler, 0.26-0.32), as vLLM is the engine runs sample with and this one must match it:
    penalties before the greedy pick, then temperature and min-p, then top-k/top-p. HF's generate applies min-p
    last, after top-p, whose cumulative mass then counts the tokens min-p drops: another distribution. Greedy keeps
    the penalised logits (argmax is unchanged by the rest). Tokens cut become -inf, so a log_softmax of the result
    is renormalised over the kept tokens.
    """
    z = logits.float()
    if seen is not None and sampling.repetition_penalty != 1.0:
        # HF's RepetitionPenaltyLogitsProcessor and vLLM's apply_repetition_penalties alike
        penalised = torch.where(z < 0, z * sampling.repetition_penalty, z / sampling.repetition_penalty)
        z = torch.where(seen, penalised, z)
    if sampling.greedy:
        return z
    if sampling.temperature != 1.0:
        z = z / sampling.temperature
    if sampling.min_p > 0.0:  # HF's MinPLogitsWarper and vLLM's MinPLogitsProcessor alike
        probs = z.softmax(-1)
        z = z.masked_fill(probs < sampling.min_p * probs.amax(-1, keepdim=True), float("-inf"))
    if sampling.top_k != -1 and sampling.top_k < z.shape[-1]:
        kth = torch.topk(z, sampling.top_k, dim=-1).values[..., -1:]
        z = z.masked_fill(z < kth, float("-inf"))
    if sampling.top_p < 1.0:
        sorted_z, order = torch.sort(z, dim=-1, descending=True)
        probs = sorted_z.softmax(-1)
        # Drop a token when the mass before it already reaches top_p; the top token always stays.
        drop_sorted = (probs.cumsum(-1) - probs) >= sampling.top_p
        drop_sorted[..., 0] = False
        z = z.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), float("-inf"))
    return z


def seen_tokens(input_ids: torch.Tensor, first: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[rows, vocab_size] bool: the tokens of each row of ``input_ids`` from position ``first[row]`` on (the left
    padding before it is no token of the prompt: HF's processor penalises it, vLLM's does not)."""
    positions = torch.arange(input_ids.shape[1], device=input_ids.device)
    ids = input_ids.masked_fill(positions < first[:, None], vocab_size)  # padding lands in a column dropped below
    seen = torch.zeros((input_ids.shape[0], vocab_size + 1), dtype=torch.bool, device=input_ids.device)
    return seen.scatter_(1, ids, True)[:, :vocab_size]


class _SampledTokenLogprobs:
    """A logits processor that applies the sampling filters and records the sampled tokens' logprobs.

    HF samples from softmax of what this returns. The token sampled at step t only shows up in
    ``input_ids`` at step t+1, so each call gathers the previous step's logprobs; ``finish`` gathers
    the last step. Only one [rows, V] tensor is kept, never the whole score history.
    """

    def __init__(self, sampling: SamplingConfig, first: torch.Tensor | None = None):
        """``first``: each row's first prompt token (past its left padding), for the repetition penalty."""
        self.sampling, self.first = sampling, first
        self.prev_logprobs: torch.Tensor | None = None
        self.steps: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self.prev_logprobs is not None:
            self.steps.append(self.prev_logprobs.gather(-1, input_ids[:, -1:]).squeeze(-1))
        seen = None
        if self.sampling.repetition_penalty != 1.0:
            if self.first.device != input_ids.device:
                self.first = self.first.to(input_ids.device)
            seen = seen_tokens(input_ids, self.first, scores.shape[-1])
        z = apply_sampling_filters(scores, self.sampling, seen)
        self.prev_logprobs = torch.log_softmax(z, dim=-1)
        return z

    def finish(self, sequences: torch.Tensor) -> torch.Tensor:
        """[rows, new_tokens] logprobs of the generated tokens."""
        if self.prev_logprobs is not None:
            self.steps.append(self.prev_logprobs.gather(-1, sequences[:, -1:]).squeeze(-1))
            self.prev_logprobs = None
        return torch.stack(self.steps, dim=1)


class _GeneratedOnly:
    """A stopping criterion applied to the tokens after ``prompt_width`` (the generated ones) only."""

    def __init__(self, criterion, prompt_width: int):
        self.criterion, self.prompt_width = criterion, prompt_width

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs) -> torch.BoolTensor:
        return self.criterion(input_ids[:, self.prompt_width :], scores, **kwargs)


class _RowLimits:
    """A stopping criterion that ends each row at its own limit: ``max_new_tokens`` is the batch's largest, and a row
    past its limit (an episode's last budget) kept the batch decoding, every token of it then cut."""

    def __init__(self, limits: torch.Tensor, prompt_width: int):
        self.limits, self.prompt_width = limits, prompt_width

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs) -> torch.BoolTensor:
        return self.limits <= input_ids.shape[1] - self.prompt_width


def _as_id_list(x) -> list[int]:
    if x is None:
        return []
    if isinstance(x, int):
        return [x]
    return [int(t) for t in x]


def _within_positions(max_model_len: int | None, config) -> int:
    """``max_model_len`` (a tool run's is prompt + new + tool tokens), at most the model's positions: past them a
    learned position table is indexed out of range (a device-side assert on CUDA) and rotary positions run on where
    the model never saw any, silently. An episode's turns end at the model's positions instead."""
    positions = getattr(config, "max_position_embeddings", None)
    if not isinstance(positions, int) or positions < 2:
        return int(max_model_len or config.max_position_embeddings)
    return min(int(max_model_len or positions), positions)


def _generation_config_holders(model) -> list:
    """``model``, and under a PEFT wrapper the transformers model too: PEFT's ``generate`` copies the wrapper's
    generation_config into it, where restoring the wrapper's alone left it blank for good."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    return [model] if inner is model else [model, inner]


class HFEngine(RolloutEngine):
    """``generate`` on a plain torch module (or a ZeRO-0/1/2 DeepSpeed engine's ``module``).

    One batched, KV-cached ``model.generate`` call per ``generate`` (left-padded prompts,
    ``num_return_sequences=n``); no per-token Python work beyond one logits processor.
    """

    kind = "hf"

    def __init__(self, model: torch.nn.Module, max_model_len: int | None = None, eos_token_id=None, tokenizer=None,
                 fp32_logits: bool = False):
        """``fp32_logits`` (``model.fp32_logits``): the head's logits as its GEMM's fp32 sums while generating
        (``fastrlhf.modeling.heads``), as the trainer's fused kernels make them."""
        self.fp32_logits = fp32_logits
        config = getattr(model, "config", None)
        if config is None or not hasattr(model, "generate"):
            raise ValueError(
                f"HFEngine needs a transformers model with .config and .generate, got {type(model).__name__}"
            )
        self.model = model
        self._vocab_size = int(config.vocab_size)
        self._max_model_len = _within_positions(max_model_len, config)
        gen_config = getattr(model, "generation_config", None)
        if eos_token_id is None:
            eos_token_id = getattr(gen_config, "eos_token_id", None)
            if eos_token_id is None:
                eos_token_id = config.eos_token_id
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids_with(_as_id_list(eos_token_id), tokenizer)
        pad = getattr(config, "pad_token_id", None)
        self.pad_token_id = int(pad if pad is not None else (self.eos_token_ids or [0])[0])

    @property
    def weight_dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    def _device(self) -> torch.device:
        return next(self.model.parameters()).device

    def generate(self, prompt_token_ids, sampling: SamplingConfig, limits=None, seeds=None) -> list[list[Completion]]:
        from transformers import GenerationConfig, LogitsProcessorList

        if not isinstance(sampling, SamplingConfig):
            raise ValueError(f"sampling must be a SamplingConfig, got {type(sampling).__name__}")
        prompts = validate_prompts(prompt_token_ids, self.vocab_size, self.max_model_len)
        if sampling.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer: HFEngine(..., tokenizer=...)")
        limits = new_token_limits(prompts, sampling, self.max_model_len, limits)
        stop_ids = stop_token_ids_for(sampling, self.eos_token_ids)

        device = self._device()
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):  # left padding: every prompt ends where generation starts
            input_ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
            attention_mask[i, width - len(p) :] = 1

        # num_return_sequences repeats each prompt n times in a row
        first = (width - torch.tensor([len(p) for p in prompts])).repeat_interleave(sampling.n)
        recorder = _SampledTokenLogprobs(sampling, first)
        sample_kwargs = dict(temperature=1.0, top_k=0, top_p=1.0) if not sampling.greedy else {}
        gen_config = GenerationConfig(
            do_sample=not sampling.greedy,
            # The penalty, temperature and truncation are applied by the recorder, so that its logprobs are of
            # exactly the distribution HF samples from.
            **sample_kwargs,
            max_new_tokens=max(limits),
            num_return_sequences=sampling.n,
            # An id no logit can produce when nothing may stop generation: an empty value would be
            # filled in from the model's generation_config.
            eos_token_id=stop_ids if stop_ids else [_NEVER_SAMPLED_ID],
            pad_token_id=self.pad_token_id,
            use_cache=True,
            return_dict_in_generate=False,
        )
        seed = sampling.seed if not seeds else int(seeds[0])  # one stream draws for the whole batch
        if seed is None and not sampling.greedy:
            # Drawn from the caller's stream, outside the fork below, which rewinds it: else every unseeded call
            # would start from the same state and repeat the previous call's samples.
            seed = int(torch.randint(0, 2**62, ()))
        was_training = self.model.training
        # generate() fills unset fields from the model's generation_config (a checkpoint's
        # repetition_penalty, top_k=50...): swap in a blank one so only this config applies.
        saved_gen_configs = [(m, getattr(m, "generation_config", None)) for m in _generation_config_holders(self.model)]
        for m, _ in saved_gen_configs:
            m.generation_config = GenerationConfig()
        self.model.eval()
        try:
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.inference_mode(), \
                    eager_layers(self.model), \
                    fp32_logits_head(self.model) if self.fp32_logits else contextlib.nullcontext():
                if seed is not None:
                    torch.manual_seed(seed)
                sequences = self.model.generate(
                    **to_device(dict(input_ids=input_ids, attention_mask=attention_mask), device),
                    generation_config=gen_config,
                    logits_processor=LogitsProcessorList([recorder]),
                    stopping_criteria=self._stopping_criteria(sampling, limits, width, device),
                )
                logprobs = recorder.finish(sequences).float().cpu()
        finally:
            self.model.train(was_training)
            for m, saved in saved_gen_configs:
                m.generation_config = saved
        new_tokens = sequences[:, width:].cpu()
        results = self._split(new_tokens, logprobs, limits, sampling.n, set(stop_ids))
        return cut_at_stop_strings(results, sampling.stop, self.tokenizer)

    def _stopping_criteria(self, sampling: SamplingConfig, limits: list[int], width: int, device):
        """The stop strings' criterion, and the rows' own limits where they differ (no read of the device: a
        criterion's verdict stays there)."""
        criteria = self._stop_string_criteria(sampling.stop, width)
        if len(set(limits)) > 1:  # each prompt's limit for each of its n rows
            per_row = torch.tensor(limits, dtype=torch.long).repeat_interleave(sampling.n)
            criteria.append(_RowLimits(to_device(per_row, device), width))
        return criteria

    def _stop_string_criteria(self, stop: tuple[str, ...], prompt_width: int = 0):
        """HF's early stop for rows whose generated text ends with a stop string (where it can index the vocab;
        ``cut_at_stop_strings`` decides the cut either way, so without it rows only run longer). Tokens before
        ``prompt_width`` are the prompt's: a stop string begun there is none (the cut, like vLLM, reads the
        completion only), and a row ended on one ran on as padding, trained on as the policy's tokens."""
        from transformers import StoppingCriteriaList
        from transformers.generation.stopping_criteria import StopStringCriteria

        if not stop:
            return StoppingCriteriaList()
        cache = self.__dict__.setdefault("_stop_criteria", {})
        if stop not in cache:
            try:
                cache[stop] = StopStringCriteria(self.tokenizer, list(stop))
            except Exception:  # noqa: BLE001 -- a vocab HF cannot clean: no early stop, same result
                cache[stop] = None
        if cache[stop] is None:
            return StoppingCriteriaList()
        return StoppingCriteriaList([_GeneratedOnly(cache[stop], prompt_width)])

    @staticmethod
    def _split(new_tokens, logprobs, limits, n, stop_ids) -> list[list[Completion]]:
        token_rows = new_tokens.tolist()
        logprob_rows = logprobs.tolist()
        results = []
        for i, limit in enumerate(limits):
            samples = []
            for j in range(n):
                row = i * n + j  # num_return_sequences repeats each prompt n times in a row
                tokens = token_rows[row][:limit]
                end = next((k + 1 for k, t in enumerate(tokens) if t in stop_ids), None)
                if end is None:
                    samples.append(Completion(tokens, logprob_rows[row][:limit], "length"))
                else:
                    samples.append(Completion(tokens[:end], logprob_rows[row][:end], "stop"))
            results.append(samples)
        return results

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        # state_dict (not named_parameters) so that a tied lm_head.weight is a known name too.
        targets = self.model.state_dict(keep_vars=True)
        with torch.no_grad():
            for name, tensor in named_tensors:
                if name not in targets:
                    raise ValueError(f"update_weights: {name!r} is not a parameter of {type(self.model).__name__}")
                target = targets[name]
                if tuple(target.shape) != tuple(tensor.shape):
                    raise ValueError(
                        f"update_weights: {name!r} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}"
                    )
                target.data.copy_(tensor)
