"""Model forward passes the RL step needs: logprobs of sampled tokens, the actor's and critic's
losses, critic values and reward-model scores. Never materialises [B, T, V] logits on the default path.

Every function takes a plain HF module, a PEFT model or a DeepSpeed engine (``.module``). The LM
head is always CALLED as a module (with its forward temporarily swapped for the fused kernel):
under ZeRO-3 that is what makes DeepSpeed's hooks gather ``lm_head.weight`` for the kernel and
reduce-scatter its gradient afterwards, exactly as for an ordinary ``nn.Linear``.
"""

from __future__ import annotations

import contextlib

import torch

from fastrlhf.algorithms import (
    actor_loss_per_token,
    aggregate_loss,
    entropy_from_logits,
    get_policy_loss,
    logprobs_from_logits,
    masked_mean,
    value_loss,
)
from fastrlhf.rl.experience import Experience

__all__ = [
    "body_and_head",
    "critic_loss",
    "policy_loss_from_model",
    "reward_model_scores",
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


@contextlib.contextmanager
def _head_forward(head: torch.nn.Module, fn):
    """Run ``head(...)`` as ``fn(...)`` (the module's hooks still fire: ZeRO-3 gathers its weight)."""
    head.forward = fn
    try:
        yield
    finally:
        del head.forward


def response_hidden(model, exp: Experience) -> torch.Tensor:
    """[B, T, H] final hidden states at the positions that predict the completion tokens."""
    body, _ = body_and_head(model)
    out = body(input_ids=exp.input_ids, attention_mask=exp.attention_mask, position_ids=exp.position_ids,
               use_cache=False)
    return out.last_hidden_state[:, exp.response_slice()]


def _fused_kernels():
    from fastrlhf.kernels import fused_linear_logprob_entropy, fused_linear_policy_loss

    return fused_linear_logprob_entropy, fused_linear_policy_loss


def _logprob_head_fn(head, temperature, chunk_size, chunk_bytes):
    fused_lp, _ = _fused_kernels()

    def head_fn(hidden, labels):
        return fused_lp(hidden, head.weight, labels, bias=head.bias, temperature=temperature, chunk_size=chunk_size,
                        chunk_bytes=chunk_bytes)

    return head_fn


def sequence_logprobs(model, exp: Experience, temperature: float = 1.0, micro_batch: int | None = None,
                      chunk_size: int | None = None, fused: bool = True,
                      chunk_bytes: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``(logprobs, entropy)`` ``[B, T]`` of the completion tokens, without gradients.

    0 at masked positions. ``micro_batch`` bounds how many sequences go through the model at once.
    """
    B = exp.batch_size
    micro_batch = micro_batch or B
    lp_rows, ent_rows = [], []
    with torch.no_grad():
        for start in range(0, B, micro_batch):
            mb = exp.select(slice(start, start + micro_batch))
            hidden = response_hidden(model, mb)
            _, head = body_and_head(model)
            if fused:
                with _head_forward(head, _logprob_head_fn(head, temperature, chunk_size, chunk_bytes)):
                    lp, ent = head(hidden, mb.labels)
            else:
                logits = head(hidden)
                lp = logprobs_from_logits(logits, mb.labels, temperature)
                ent = entropy_from_logits(logits, temperature)
            keep = mb.response_mask > 0
            lp_rows.append(torch.where(keep, lp.float(), 0.0))
            ent_rows.append(torch.where(keep, ent.float(), 0.0))
    return torch.cat(lp_rows), torch.cat(ent_rows)


def policy_loss_from_model(model, mb: Experience, config):
    """The actor's loss of a micro-batch (``fastrlhf.algorithms.actor_loss_per_token``, aggregated by
    ``trainer.agg``) and its detached metrics (clipfrac, approx_kl, entropy, kl masked means).

    Advantages are ``mb.advantages`` times the truncated importance weights ``mb.is_weights`` when
    present: every registered policy term is positively homogeneous in A, so this weights exactly
    each token's policy term, as TIS prescribes, and leaves the KL and entropy terms alone. A
    token-level loss runs inside the fused kernel; a sequence-level one (GSPO) on the fused
    kernel's logprobs, through autograd.
    """
    cfg, temperature = config.trainer, config.rollout.temperature
    advantages = mb.advantages if mb.is_weights is None else mb.advantages * mb.is_weights
    # The KL goes into PPO's token rewards (trainer.kl_in_reward) or into the loss, never both.
    kl_coef = 0.0 if (config.algorithm == "ppo" and cfg.kl_in_reward) else cfg.kl_coef
    ref = mb.ref_logprobs if kl_coef != 0.0 else None
    terms = dict(policy_loss=cfg.policy_loss, clip_low=cfg.clip_low, clip_high=cfg.clip_high,
                 dual_clip=cfg.dual_clip, kl_coef=kl_coef, kl_kind=cfg.kl_kind, entropy_coef=cfg.entropy_coef)
    hidden = response_hidden(model, mb)
    _, head = body_and_head(model)
    fused = cfg.fused_loss and get_policy_loss(cfg.policy_loss).token_level
    if fused:
        _, fused_loss = _fused_kernels()

        def head_fn(h, labels, old, adv, mask, *ref_lp):
            return fused_loss(h, head.weight, labels, old, adv, mask, ref_logprobs=ref_lp[0] if ref_lp else None,
                              temperature=temperature, agg=cfg.agg, bias=head.bias, chunk_size=cfg.loss_chunk_size,
                              chunk_bytes=cfg.loss_chunk_bytes, **terms)

        args = (hidden, mb.labels, mb.old_logprobs, advantages, mb.response_mask) + ((ref,) if ref is not None else ())
        with _head_forward(head, head_fn):
            return head(*args)
    if cfg.fused_loss:  # a sequence-level loss: per-token logprobs from the fused kernel, then autograd
        with _head_forward(head, _logprob_head_fn(head, temperature, cfg.loss_chunk_size, cfg.loss_chunk_bytes)):
            lp, ent = head(hidden, mb.labels)
    else:  # trainer.fused_loss: false, for debugging: the same math on materialised logits
        logits = head(hidden)
        lp = logprobs_from_logits(logits, mb.labels, temperature)
        ent = entropy_from_logits(logits, temperature)
    mask = mb.response_mask
    old = mb.old_logprobs if mb.old_logprobs is not None else lp.detach()
    loss_mat, is_clipped, kl = actor_loss_per_token(lp, ent, old, advantages, mask, ref, **terms)
    metrics = {"clipfrac": masked_mean(is_clipped.to(loss_mat.dtype), mask),
               "approx_kl": masked_mean(old - lp, mask), "entropy": masked_mean(ent, mask),
               "kl": masked_mean(kl, mask) if kl is not None else torch.zeros(())}
    return aggregate_loss(loss_mat, mask, cfg.agg), {k: v.detach() for k, v in metrics.items()}


def critic_loss(critic, mb: Experience, config):
    """``trainer.vf_coef`` x the clipped value loss of a micro-batch; returns ``(loss, metrics)``."""
    cfg = config.trainer
    values = token_values(critic, mb, grad=True)
    loss, metrics = value_loss(values, mb.values, mb.returns, mb.response_mask, cfg.vf_clip, cfg.agg)
    metrics["value_loss"] = loss.detach()
    return cfg.vf_coef * loss, metrics


def _accepts_position_ids(model) -> bool:
    import inspect

    params = inspect.signature(unwrap(model).forward).parameters
    return "position_ids" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def _per_token_outputs(model, input_ids, attention_mask, position_ids) -> torch.Tensor:
    """[B, L] scalar output per position of a critic / value-head model."""
    kwargs = dict(input_ids=input_ids, attention_mask=attention_mask)
    if _accepts_position_ids(model):
        kwargs["position_ids"] = position_ids
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


def token_values(critic, exp: Experience, micro_batch: int | None = None, grad: bool = False) -> torch.Tensor:
    """[B, T] critic values of the states before each completion token (0 where masked).

    The critic is any model whose per-position output is a scalar: a ``*ForTokenClassification``
    with one label, or a causal LM with a value head returning ``[B, L]`` / ``[B, L, 1]``.
    """
    B = exp.batch_size
    micro_batch = micro_batch or B
    rows = []
    with torch.set_grad_enabled(grad):
        for start in range(0, B, micro_batch):
            mb = exp.select(slice(start, start + micro_batch))
            v = _per_token_outputs(critic, mb.input_ids, mb.attention_mask, mb.position_ids)[:, mb.response_slice()]
            rows.append(torch.where(mb.response_mask > 0, v, 0.0))
    return torch.cat(rows)


def reward_model_scores(reward_model, exp: Experience, kind: str = "classifier", label_index: int = 0,
                        micro_batch: int | None = None) -> torch.Tensor:
    """[B] score of each whole sequence (prompt + completion) at its last real token.

    ``classifier``: a ``*ForSequenceClassification``; its body runs and its score head is applied to
    the last attended position (not to the last non-pad id, which breaks when a completion emits the
    pad id). ``value_head``: a model with per-position scalar outputs, read at the last token.
    """
    if kind not in ("classifier", "value_head"):
        raise ValueError(f"reward model_kind must be 'classifier' or 'value_head', got {kind!r}")
    m = unwrap(reward_model)
    last = (exp.attention_mask.cumsum(-1) == exp.attention_mask.sum(-1, keepdim=True)) & (exp.attention_mask > 0)
    last_index = last.long().argmax(-1)
    B = exp.batch_size
    micro_batch = micro_batch or B
    out = []
    with torch.no_grad():
        for start in range(0, B, micro_batch):
            sl = slice(start, start + micro_batch)
            ids, am, pos = exp.input_ids[sl], exp.attention_mask[sl], exp.position_ids[sl]
            rows = torch.arange(ids.shape[0], device=ids.device)
            if kind == "value_head":
                out.append(_per_token_outputs(m, ids, am, pos)[rows, last_index[sl]])
                continue
            body = getattr(m, getattr(m, "base_model_prefix", "model"))
            head = getattr(m, "score", None) or getattr(m, "classifier", None)
            if head is None:
                raise ValueError(f"reward model {type(m).__name__} has no 'score' or 'classifier' head")
            hidden = body(input_ids=ids, attention_mask=am, position_ids=pos).last_hidden_state
            logits = head(hidden[rows, last_index[sl]])
            if not 0 <= label_index < logits.shape[-1]:
                raise ValueError(f"reward label_index {label_index} out of range for {logits.shape[-1]} labels")
            out.append(logits[:, label_index].float())
    return torch.cat(out)
