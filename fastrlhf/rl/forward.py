"""Model forward passes the RL step needs: logprobs of sampled tokens, the actor's and critic's
losses, critic values and reward-model scores. Never materialises [B, T, V] logits on the default path.

Every function takes a plain HF module, a PEFT model or a DeepSpeed engine (``.module``). The LM
head is always CALLED as a module (with its forward temporarily swapped for the fused kernel):
under ZeRO-3 that is what makes DeepSpeed's hooks gather ``lm_head.weight`` for the kernel and
reduce-scatter its gradient afterwards, exactly as for an ordinary ``nn.Linear``.

Each pass runs micro-batch by micro-batch (:class:`MicroBatch`): ``groups`` of rows (by count, or by
``trainer.max_tokens_per_microbatch``, see ``fastrlhf.sequences.packing``), each either padded (trimmed to the
widths its rows need) or packed (``trainer.packing``: one row, positions restarting per sequence,
no attention mask; the LM head and the value head see only the ``[M, H]`` positions that predict
completion tokens, token-flat). Results go back to ``[B, T]`` / ``[B]`` in the batch's row order.
A loss micro-batch carries its share of its minibatch's aggregation weights (``Experience.loss_weights``).
"""

from __future__ import annotations

import inspect
from dataclasses import replace

import torch

from fastrlhf.algorithms import (
    actor_loss_per_token,
    aggregate_loss,
    aggregation_weights,
    entropy_from_logits,
    get_policy_loss,
    kl_in_reward,
    logprobs_from_logits,
    masked_mean,
    off_policy_keep,
    value_loss,
)
from fastrlhf.engine.device import to_device
from fastrlhf.modeling.heads import fused_logprob_head, head_forward, linear_head
from fastrlhf.modeling.tied_gradient import tied_gradient_handoff
from fastrlhf.rl.experience import Experience, pad_response
from fastrlhf.sequences.masks import forward_mask

__all__ = [
    "MicroBatch",
    "body_and_head",
    "classifier_body_and_head",
    "critic_loss",
    "attention_mask_for",
    "attention_of",
    "check_segments",
    "micro_batches",
    "policy_loss_from_model",
    "pools_its_own",
    "reward_model_scores",
    "right_padded",
    "sequence_logprobs",
    "token_values",
    "unwrap",
]


def unwrap(model) -> torch.nn.Module:
    """The torch module inside a DeepSpeed engine (or the module itself)."""
    if any(cls.__name__ == "DeepSpeedEngine" for cls in type(model).__mro__):
        return model.module
    return model


def _hf_model(model) -> torch.nn.Module:
    m = unwrap(model)
    # A PeftModel's base model holds the LoRA layers; whether the adapter applies is decided by the
    # caller (``disable_adapter()`` gives the reference model).
    if hasattr(m, "get_base_model") and hasattr(m, "peft_config"):
        m = m.get_base_model()
    return m


def body_and_head(model) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(decoder body returning last_hidden_state, LM head module) of a causal LM."""
    m = _hf_model(model)
    head = m.get_output_embeddings() if hasattr(m, "get_output_embeddings") else None
    body = m.get_decoder() if hasattr(m, "get_decoder") else getattr(m, getattr(m, "base_model_prefix", "model"), None)
    if head is None or body is None:
        raise ValueError(f"{type(m).__name__} is not a causal LM with a decoder body and an LM head")
    return body, head


class MicroBatch:
    """One micro-batch as a forward pass takes it: padded rows (trimmed to the widths its own rows need)
    or packed (:class:`fastrlhf.sequences.packing.PackedLayout`: every sequence end to end in one row, no padding).

    :meth:`tokens` gives a ``[B, T]`` per-token tensor in the shape the loss math sees: the trimmed
    ``[b, T']`` rows padded, the ``[M]`` completion tokens packed (flat, as the fused kernels take
    them); :meth:`rows` turns such outputs back into ``[b, T]`` rows (zeros elsewhere).
    """

    def __init__(self, exp: Experience, packed: bool | str):
        """``packed``: False (padded rows), True (packed) or ``"shared"`` (packed, each prompt group's
        prompt once: :func:`packing_mode`)."""
        self.packed = bool(packed)
        self.width = exp.response_width
        self.exp = exp if packed else exp.trimmed()
        self.layout = exp.packed_layout(share_prompts=packed == "shared") if packed else None

    def tokens(self, per_token: torch.Tensor | None) -> torch.Tensor | None:
        if per_token is None or not self.packed:
            return per_token
        return self.layout.take(per_token)

    def rows(self, values: torch.Tensor) -> torch.Tensor:
        """``[b, T]`` rows of per-token ``values`` (``[b, T']`` padded or ``[M]`` packed)."""
        return self.layout.put(values) if self.packed else pad_response(values, self.width)

    def model_inputs(self, model=None) -> dict:
        """``input_ids``, ``attention_mask``, ``position_ids`` of ``model``'s forward pass (packed: no mask, so
        transformers reads the position restarts as sequence boundaries).

        A packed row's mask is its block mask (:meth:`fastrlhf.sequences.packing.PackedLayout.model_kwargs`); a
        padded micro-batch's is built on the device (:func:`attention_mask_for`), and without padding it needs
        no positions."""
        if self.packed:
            return dict(input_ids=self.layout.pack_padded(self.exp.input_ids),
                        **self.layout.model_kwargs(self.exp.block_masks))
        e = self.exp
        if all(p == e.prompt_width for p in e.prompt_lens) and all(n == e.response_width for n in e.completion_lens):
            return dict(input_ids=e.input_ids, attention_mask=attention_mask_for(model, e.attention_mask, False),
                        position_ids=None)
        return dict(input_ids=e.input_ids, attention_mask=attention_mask_for(model, e.attention_mask),
                    position_ids=e.position_ids)

    def at_response(self, per_position: torch.Tensor) -> torch.Tensor:
        """Outputs ``[b, L, ...]`` of every position -> those that predict the completion tokens:
        ``[b, T', ...]`` padded, ``[M, ...]`` packed."""
        if self.packed:
            return per_position[0, self.layout.hidden_index]
        return per_position[:, self.exp.response_slice()]

    def at_last_token(self, per_position: torch.Tensor, skip_id: int | None = None) -> torch.Tensor:
        """``[b, ...]`` outputs at each sequence's last real token; with ``skip_id``, at its last real token that is
        not ``skip_id`` (its first where all are), as transformers pools a sequence classifier on right-padded rows.
        A sequence's tokens are contiguous in both layouts (not with shared prompts), so that is a step back."""
        if skip_id is not None and self.packed and self.layout.segments is not None:
            raise ValueError("a shared-prompt packed row cannot step back from a completion into its prompt")
        back = 0 if skip_id is None else _trailing(self.exp, skip_id)
        if self.packed:
            return per_position[0, self.layout.last_index - back]
        mask = self.exp.attention_mask
        last = ((mask.cumsum(-1) == mask.sum(-1, keepdim=True)) & (mask > 0)).long().argmax(-1)
        return per_position[torch.arange(mask.shape[0], device=mask.device), last - back]


def _trailing(exp: Experience, token_id: int) -> torch.Tensor:
    """``[B]`` how many of each sequence's last attended tokens are ``token_id`` (all but its first where all are),
    on the device: no read of the ids."""
    mask = exp.attention_mask > 0
    columns = torch.arange(1, mask.shape[1] + 1, device=mask.device)
    last, kept = (columns * mask).amax(-1), (columns * (mask & (exp.input_ids != token_id))).amax(-1)
    return torch.where(kept > 0, last - kept, mask.sum(-1) - 1).clamp(min=0)


def attention_of(model) -> str | None:
    """The attention implementation transformers runs ``model`` (a critic's ``lm``) with."""
    m = _hf_model(model)
    config = getattr(m, "config", None) or getattr(getattr(m, "lm", None), "config", None)
    return getattr(config, "_attn_implementation", None)


def attention_mask_for(model, attention_mask: torch.Tensor, padded: bool = True):
    """The ``attention_mask`` argument of ``model``'s forward (a causal LM, classifier or value-head critic) on rows
    laid out as ``attention_mask`` (``[B, L]``): :func:`fastrlhf.sequences.masks.forward_mask`, built so that
    transformers does not read the device to find it."""
    return forward_mask(_decoder_of(model), attention_of(model), attention_mask, padded)


def _decoder_of(model) -> torch.nn.Module:
    """The transformers decoder (``*Model``) that ``model`` (a causal LM, classifier, value-head wrapper) runs."""
    m = _hf_model(model)
    if hasattr(m, "lm") and not hasattr(m, "config"):  # fastrlhf.modeling.CausalLMWithValueHead
        m = _hf_model(m.lm)
    return getattr(m, "base_model", m)


def packing_mode(trainer) -> bool | str:
    """How ``trainer`` (the config section) lays out a micro-batch: False, True or ``"shared"``."""
    return "shared" if trainer.packing and getattr(trainer, "share_prompts", False) else bool(trainer.packing)


def micro_batches(exp: Experience, groups: list[list[int]] | None, micro_batch: int | None, packed: bool | str):
    """``(rows, MicroBatch)`` for each micro-batch of ``exp``: ``groups`` (row indices), else consecutive
    runs of ``micro_batch`` rows (all rows: one)."""
    from fastrlhf.sequences.packing import fixed_count_groups

    if groups is None:
        groups = fixed_count_groups(exp.batch_size, micro_batch or exp.batch_size)
    exp = exp.with_lengths()  # once, not per micro-batch
    for rows in groups:
        yield rows, MicroBatch(exp.select(rows), packed)


def _scatter_rows(out: torch.Tensor, rows: list[int], values: torch.Tensor) -> None:
    out[to_device(torch.tensor(rows, dtype=torch.long), out.device)] = values.to(out.dtype)


def check_segments(model, inputs: dict) -> None:
    """A packed row is read by one attention only (its block mask and bounds); any other would misread it."""
    if "fastrlhf_rows" in inputs:
        from fastrlhf.sequences.packed_attention import check_model

        m = _hf_model(model)
        check_model(_hf_model(m.lm) if hasattr(m, "lm") and not hasattr(m, "config") else m)


def _decoder_hidden(body, inputs: dict) -> torch.Tensor:
    check_segments(body, inputs)
    return body(**inputs, use_cache=False).last_hidden_state


def response_hidden(model, mb: Experience | MicroBatch) -> torch.Tensor:
    """Final hidden states at the positions that predict the completion tokens: ``[B, T, H]`` of a
    padded batch (an Experience), ``[M, H]`` of a packed micro-batch."""
    mb = mb if isinstance(mb, MicroBatch) else MicroBatch(mb, packed=False)
    body, _ = body_and_head(model)
    return mb.at_response(_decoder_hidden(body, mb.model_inputs(body)))


def _token_logprobs(model, mb: MicroBatch, temperature, chunk_size, chunk_bytes, fused, fp32_logits=False):
    """Per-token ``(logprobs, entropy)`` of a micro-batch's completion tokens (``mb.tokens`` shape); ``fp32_logits``
    (``model.fp32_logits``, the fused kernels only): of a bf16 head's fp32 logits."""
    hidden = response_hidden(model, mb)
    labels = mb.tokens(mb.exp.labels)
    _, head = body_and_head(model)
    if fused:
        with fused_logprob_head(head, temperature, chunk_size, chunk_bytes, fp32_logits):
            return head(hidden, labels)
    logits = head(hidden)
    return logprobs_from_logits(logits, labels, temperature), entropy_from_logits(logits, temperature)


def sequence_logprobs(model, exp: Experience, temperature: float = 1.0, micro_batch: int | None = None,
                      chunk_size: int | None = None, fused: bool = True,
                      chunk_bytes: int | None = None, groups: list[list[int]] | None = None,
                      packed: bool = False, fp32_logits: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``(logprobs, entropy)`` ``[B, T]`` of the completion tokens, without gradients.

    0 at masked positions. ``groups``: the rows of each micro-batch (``fastrlhf.sequences.packing``), else
    ``micro_batch`` sequences at a time; ``packed``: each micro-batch's sequences in one row; ``fp32_logits``:
    of the head's fp32 logits (``model.fp32_logits``).
    """
    B, T = exp.batch_size, exp.response_width
    device = exp.response_mask.device
    lp_out = torch.zeros(B, T, dtype=torch.float32, device=device)
    ent_out = torch.zeros_like(lp_out)
    with torch.no_grad():
        for rows, mb in micro_batches(exp, groups, micro_batch, packed):
            lp, ent = _token_logprobs(model, mb, temperature, chunk_size, chunk_bytes, fused, fp32_logits)
            keep = mb.tokens(mb.exp.response_mask) > 0
            _scatter_rows(lp_out, rows, mb.rows(torch.where(keep, lp.float(), 0.0)))
            _scatter_rows(ent_out, rows, mb.rows(torch.where(keep, ent.float(), 0.0)))
    return lp_out, ent_out


def _with_loss_weights(mb: Experience, config) -> Experience:
    """``mb`` carrying per-token loss weights: the minibatch's (set by the update), else its own by ``trainer.agg``."""
    if mb.loss_weights is not None:
        return mb
    return replace(mb, loss_weights=aggregation_weights(mb.trained_mask, config.trainer.agg,
                                                        length=config.rollout.max_new_tokens))


def policy_loss_from_model(model, mb: Experience, config):
    """The actor's loss of a micro-batch (``fastrlhf.algorithms.actor_loss_per_token``, aggregated with
    ``mb.loss_weights``: its tokens' share of the minibatch's ``trainer.agg`` weights, or by
    ``trainer.agg`` over its own rows when None) and its detached metrics (clipfrac, approx_kl,
    entropy, kl masked means over its tokens).

    ``trainer.packing``: the micro-batch runs packed, and the LM head sees only the ``[M, H]``
    hidden states that predict completion tokens, token-flat, with their labels and per-token data.

    Advantages are ``mb.advantages`` times the truncated importance weights ``mb.is_weights`` when
    present: every registered policy term is positively homogeneous in A, so this weights exactly
    each token's policy term, as TIS prescribes, and leaves the KL and entropy terms alone. A
    token-level loss runs inside the fused kernel; a sequence-level one (GSPO) on the fused
    kernel's logprobs, through autograd, on ``[b, T]`` rows (packed logprobs are put back in rows).

    ``trainer.off_policy_mask_threshold`` (``fastrlhf.algorithms.off_policy_keep``) zeroes the advantages of the
    tokens it drops, judged by this micro-batch's own logprobs: every loss then takes the second path, since the
    fused loss kernel needs its advantages before it computes the logprobs (TRL refuses its Liger loss for it).
    """
    cfg, temperature = config.trainer, config.rollout.temperature
    view = MicroBatch(_with_loss_weights(mb, config), packing_mode(cfg))
    e = view.exp
    advantages = e.advantages if e.is_weights is None else e.advantages * e.is_weights
    # The KL goes into the token rewards (trainer.kl_in_reward, where the estimator takes it) or into the loss.
    kl_coef = 0.0 if kl_in_reward(config) else cfg.kl_coef
    ref = e.ref_logprobs if kl_coef != 0.0 else None
    terms = dict(policy_loss=cfg.policy_loss, clip_low=cfg.clip_low, clip_high=cfg.clip_high,
                 dual_clip=cfg.dual_clip, kl_coef=kl_coef, kl_kind=cfg.kl_kind, entropy_coef=cfg.entropy_coef,
                 policy_loss_args=dict(cfg.policy_loss_args) or None)
    token_level = get_policy_loss(cfg.policy_loss).token_level
    threshold = cfg.off_policy_mask_threshold
    if cfg.fused_loss and token_level and threshold is None:
        from fastrlhf.kernels import fused_linear_policy_loss

        head = linear_head(body_and_head(model)[1], "trainer.fused_loss")
        # A tied embedding and LM head get one [V, H] gradient, not two summed (fastrlhf.modeling.tied_gradient).
        with tied_gradient_handoff(_hf_model(model).get_input_embeddings(), head) as head_weight:
            hidden = response_hidden(model, view)

            def head_fn(h, labels, old, adv, mask, weights, *ref_lp):
                return fused_linear_policy_loss(
                    h, head_weight(), labels, old, adv, mask, ref_logprobs=ref_lp[0] if ref_lp else None,
                    temperature=temperature, agg=cfg.agg, bias=head.bias, chunk_size=cfg.loss_chunk_size,
                    chunk_bytes=cfg.loss_chunk_bytes, weights=weights, fp32_logits=config.model.fp32_logits, **terms)

            args = (hidden,) + tuple(view.tokens(t) for t in (e.labels, e.old_logprobs, advantages, e.response_mask,
                                                              e.loss_weights))
            args += (view.tokens(ref),) if ref is not None else ()
            with head_forward(head, head_fn):
                return head(*args)
    # A sequence-level loss (per-token logprobs from the fused kernel, then autograd), or
    # trainer.fused_loss: false (for debugging: the same math on materialised logits).
    lp, ent = _token_logprobs(model, view, temperature, cfg.loss_chunk_size, cfg.loss_chunk_bytes, cfg.fused_loss,
                              config.model.fp32_logits)
    tokens = view.tokens if token_level else (lambda t: t)
    if not token_level and view.packed:
        lp, ent = view.rows(lp), view.rows(ent)
    mask, weights = tokens(e.response_mask), tokens(e.loss_weights)
    masked = {}
    if threshold is not None:  # TRL's sign test reads the advantages without the TIS weights
        current = view.rows(lp.detach()) if token_level and view.packed else lp  # [b, T] rows
        keep = off_policy_keep(e.advantages, current, e.engine_logprobs, e.trained_mask, threshold)
        advantages = advantages * keep  # a product: a NaN advantage stays NaN for the guard
        masked["off_policy_masked_fraction"] = masked_mean(1.0 - keep, e.response_mask)
    # A loss over whole rows or the micro-batch (GSPO; Clip-Cov and KL-Cov pick tokens by a covariance over it) sees
    # only the trained rows: one left out (mask_truncated_completions) has weight 0, yet would move those picks
    loss_mask = mask if token_level else tokens(e.trained_mask)
    old = tokens(e.old_logprobs) if e.old_logprobs is not None else lp.detach()
    loss_mat, is_clipped, kl = actor_loss_per_token(lp, ent, old, tokens(advantages), loss_mask, tokens(ref), **terms)
    metrics = {"clipfrac": masked_mean(is_clipped.to(loss_mat.dtype), mask),
               "approx_kl": masked_mean(old - lp, mask), "entropy": masked_mean(ent, mask),
               "kl": masked_mean(kl, mask) if kl is not None else torch.zeros((), device=mask.device), **masked}
    return aggregate_loss(loss_mat, loss_mask, cfg.agg, weights), {k: v.detach() for k, v in metrics.items()}


def critic_loss(critic, mb: Experience, config):
    """``trainer.vf_coef`` x the clipped value loss of a micro-batch (weighted like the actor's, see
    :func:`policy_loss_from_model`; packed with ``trainer.packing``); returns ``(loss, metrics)``."""
    cfg = config.trainer
    view = MicroBatch(_with_loss_weights(mb, config), packing_mode(cfg))
    e = view.exp
    values = _response_values(critic, view)
    loss, metrics = value_loss(values, view.tokens(e.values), view.tokens(e.returns), view.tokens(e.response_mask),
                               cfg.vf_clip, cfg.agg, weights=view.tokens(e.loss_weights))
    metrics["value_loss"] = loss.detach()
    return cfg.vf_coef * loss, metrics


def _accepts(model, name: str) -> bool:
    params = inspect.signature(unwrap(model).forward).parameters
    return name in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def _per_token_outputs(model, input_ids, attention_mask, position_ids, **packed) -> torch.Tensor:
    """[B, L] scalar output per position of a critic / value-head model (packed: one row, its block mask
    as ``attention_mask``, positions restarting per sequence; ``packed``: the row's bounds, passed to a
    forward that takes ``**kwargs``)."""
    kwargs = dict(input_ids=input_ids, attention_mask=attention_mask)
    check_segments(model, packed)
    if packed and _accepts(model, "fastrlhf_rows"):  # any **kwargs forward
        kwargs.update(packed)
    elif "fastrlhf_rows" in packed:
        raise ValueError(f"{type(unwrap(model)).__name__}.forward takes no attention kwargs: it cannot run packed "
                         "rows (set trainer.packing: false)")
    if _accepts(model, "position_ids"):
        kwargs["position_ids"] = position_ids
    elif attention_mask is None and position_ids is not None:
        raise ValueError(f"{type(unwrap(model)).__name__}.forward takes no position_ids: it cannot run packed "
                         "sequences (set trainer.packing: false)")
    if _accepts(model, "use_cache"):
        kwargs["use_cache"] = False  # a cache would also hide packed sequences from the attention mask
    out = model(**kwargs)
    if isinstance(out, torch.Tensor):
        v = out
    elif getattr(out, "logits", None) is not None:
        v = out.logits
    elif isinstance(out, (tuple, list)):
        v = out[0]
    else:
        v = out["values"]
    if v.dim() == 3:
        v = v[..., 0]
    return v.float()


def _response_values(critic, mb: MicroBatch) -> torch.Tensor:
    inputs = mb.model_inputs(critic)
    return mb.at_response(_per_token_outputs(critic, **inputs))


def token_values(critic, exp: Experience, micro_batch: int | None = None, grad: bool = False,
                 groups: list[list[int]] | None = None, packed: bool = False) -> torch.Tensor:
    """[B, T] critic values of the states before each completion token (0 where masked).

    The critic is any model whose per-position output is a scalar: a ``*ForTokenClassification``
    with one label, or a causal LM with a value head returning ``[B, L]`` / ``[B, L, 1]``.
    Micro-batches as :func:`sequence_logprobs`.
    """
    out = torch.zeros(exp.batch_size, exp.response_width, dtype=torch.float32, device=exp.response_mask.device)
    parts = []
    with torch.set_grad_enabled(grad):
        for rows, mb in micro_batches(exp, groups, micro_batch, packed):
            v = _response_values(critic, mb)
            v = mb.rows(torch.where(mb.tokens(mb.exp.response_mask) > 0, v, 0.0))
            if grad:
                parts.append((rows, v))
            else:
                _scatter_rows(out, rows, v)
    if grad:  # differentiable: rows put together in batch order
        index = torch.tensor([r for rows, _ in parts for r in rows], dtype=torch.long)
        stacked = torch.cat([v for _, v in parts])
        return stacked[to_device(torch.argsort(index), stacked.device)]
    return out


def pools_its_own(classifier) -> bool:
    """Whether a ``*ForSequenceClassification`` reward model is an encoder's (BERT, RoBERTa, DeBERTa: a ``classifier``
    head that pools the first token, most through a pooler of its own), scored by its own forward on right-padded
    rows and never packed, rather than a decoder's, whose ``score`` head is read at the last token."""
    return getattr(unwrap(classifier), "score", None) is None


def classifier_body_and_head(model) -> tuple[torch.nn.Module, torch.nn.Module]:
    """(decoder body, score head) of a ``*ForSequenceClassification`` reward model."""
    m = unwrap(model)
    head = getattr(m, "score", None) or getattr(m, "classifier", None)
    if head is None:
        raise ValueError(f"reward model {type(m).__name__} has no 'score' or 'classifier' head")
    return getattr(m, getattr(m, "base_model_prefix", "model")), head


SCORE_POSITION = "fastrlhf_score_position"  # "last_token" in the config.json of `fastrlhf rm`'s exports


def skipped_id(classifier) -> int | None:
    """The id a decoder classifier's score steps back over at a sequence's end: its pad id, as transformers pools (so
    TRL trains and scores: the token before a closing eos where pad == eos); none where ``fastrlhf rm`` trained it."""
    config = unwrap(classifier).config
    if getattr(config, SCORE_POSITION, None) == "last_token":
        return None
    return getattr(config.get_text_config(), "pad_token_id", None)


def reward_model_scores(reward_model, exp: Experience, kind: str = "classifier", label_index: int = 0,
                        micro_batch: int | None = None, groups: list[list[int]] | None = None,
                        packed: bool = False) -> torch.Tensor:
    """[B] score of each whole sequence (prompt + completion) at its last real token.

    ``classifier``: a decoder's ``*ForSequenceClassification`` (a ``score`` head); its body runs and the head is
    applied to the last attended position that is not :func:`skipped_id` (transformers' pooling among the attended
    tokens). An encoder's (BERT, RoBERTa, DeBERTa: a ``classifier`` head, which pools the first token, most through a
    pooler of their own) runs its own forward on :func:`right_padded` rows, as it was trained, never packed.
    ``value_head``: a model with per-position scalar outputs, read at the last token.
    Micro-batches as :func:`sequence_logprobs`.
    """
    if kind not in ("classifier", "value_head"):
        raise ValueError(f"reward model_kind must be 'classifier' or 'value_head', got {kind!r}")
    m = unwrap(reward_model)
    pools_itself = kind == "classifier" and pools_its_own(m)
    out = torch.zeros(exp.batch_size, dtype=torch.float32, device=exp.input_ids.device)
    with torch.no_grad():
        for rows, mb in micro_batches(exp, groups, micro_batch, packed and not pools_itself):
            if kind == "value_head":
                values = _per_token_outputs(m, **mb.model_inputs(m))
                _scatter_rows(out, rows, mb.at_last_token(values))
                continue
            if pools_itself:
                logits = m(**right_padded(mb.exp, getattr(m.config, "pad_token_id", None) or 0)).logits
            else:
                body, head = classifier_body_and_head(m)
                logits = head(mb.at_last_token(_decoder_hidden(body, mb.model_inputs(m)), skipped_id(m)))
            if not 0 <= label_index < logits.shape[-1]:
                raise ValueError(f"reward label_index {label_index} out of range for {logits.shape[-1]} labels")
            _scatter_rows(out, rows, logits[:, label_index].float())
    return out


def right_padded(exp: Experience, pad_id: int) -> dict:
    """``input_ids`` and ``attention_mask`` of ``exp``'s rows with each sequence from column 0, padded on the right
    only, as an encoder reads a batch: its positions count columns (the batch's prompts are left-padded). Built
    from the host lengths: no device read."""
    exp = exp.with_lengths()
    lengths = torch.tensor([p + n for p, n in zip(exp.prompt_lens, exp.completion_lens, strict=True)])
    columns = torch.arange(int(lengths.max()))
    start = exp.prompt_width - torch.tensor(exp.prompt_lens)
    index = (start[:, None] + columns).clamp(max=exp.input_ids.shape[1] - 1)
    index, mask = to_device((index, (columns < lengths[:, None]).long()), exp.input_ids.device)
    return dict(input_ids=torch.where(mask > 0, exp.input_ids.gather(1, index), pad_id), attention_mask=mask)
