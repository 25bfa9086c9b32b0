"""The LM head run by fastrlhf's own code instead of its forward: the fused kernels in its place (the RL and SFT
passes), and its logits in fp32 in HF ``generate`` (``model.fp32_logits``).

Both read the head's ``weight`` and ``bias`` and nothing else, so :func:`linear_head` is the one rule that admits a
head: a plain ``torch.nn.Linear``. An adapter's wrapper (LoRA on ``lm_head``) adds a delta that they would skip, so
it is refused, not run without it. The head is still CALLED as a module with its forward swapped
(:func:`head_forward`): under ZeRO-3 that is what makes DeepSpeed's hooks gather its weight for the kernel and
reduce-scatter its gradient afterwards, as for any ``nn.Linear``.

fp32 logits: the RL step compares (and, with TIS, weighs) the trainer's logprobs against the rollout engine's. Both
run the head as a GEMM of bf16 operands with fp32 accumulation; rounding its output to bf16 moves a logit of a few
units by up to ~1e-2, differently in each engine's kernels (ScaleRL; vLLM PR #48390, which added
``head_dtype: float32`` for generation). With ``model.fp32_logits`` the fused kernels keep their chunk's logits in
fp32 (``fastrlhf.kernels.fused_linear``), vLLM runs its head with ``head_dtype: float32``
(``fastrlhf.rollout.vllm_adapter``), and HF ``generate`` runs the head through :func:`fp32_logits_head`: the same
exact products and fp32 sums, no bf16 rounding anywhere between the GEMM and the log-softmax.
"""

from __future__ import annotations

import contextlib

import torch

__all__ = ["fp32_logits_head", "fused_logprob_head", "head_forward", "linear_head"]


def linear_head(head: torch.nn.Module, option: str) -> torch.nn.Linear:
    """``head`` where code that reads only its ``weight`` and ``bias`` may stand in for its forward: a plain
    ``torch.nn.Linear``. Otherwise a ValueError naming ``option``, the setting that asked for it."""
    if not isinstance(head, torch.nn.Linear):
        kind = f"{type(head).__module__}.{type(head).__qualname__}"
        raise ValueError(f"{option}: the LM head is a {kind}, not a torch.nn.Linear, and only its weight and bias "
                         f"would be read (an adapter's delta skipped): keep lm_head out of model.lora_targets or set "
                         f"{option}: false")
    return head


@contextlib.contextmanager
def head_forward(head: torch.nn.Module, fn):
    """Within the block, ``head(...)`` runs ``fn(...)`` (the module's hooks still fire: ZeRO-3 gathers its weight)."""
    head.forward = fn
    try:
        yield head
    finally:
        del head.forward  # the class's forward again


def fused_logprob_head(head: torch.nn.Module, temperature: float = 1.0, chunk_size=None, chunk_bytes=None,
                       fp32_logits: bool = False):
    """Within the block, ``head(hidden, labels)`` gives ``(logprobs, entropy)`` of ``labels`` from the fused
    kernel (``fastrlhf.kernels.fused_linear_logprob_entropy``): the ``[tokens, vocab]`` logits never exist."""
    from fastrlhf.kernels import fused_linear_logprob_entropy

    linear_head(head, "trainer.fused_loss")

    def forward(hidden: torch.Tensor, labels: torch.Tensor):
        return fused_linear_logprob_entropy(hidden, head.weight, labels, bias=head.bias, temperature=temperature,
                                            chunk_size=chunk_size, chunk_bytes=chunk_bytes, fp32_logits=fp32_logits)

    return head_forward(head, forward)


@contextlib.contextmanager
def fp32_logits_head(model: torch.nn.Module):
    """Within the block, ``model``'s output embedding (its LM head) returns fp32 logits of its bf16/fp16 weight:
    one GEMM that writes fp32 (``out_dtype``) on CUDA, exact fp32 copies elsewhere. An fp32 head is left as it is."""
    from fastrlhf.kernels.fused_linear_chunks import _logits_into

    head = model.get_output_embeddings()
    if head is None or head.weight.dtype == torch.float32:
        yield
        return
    linear_head(head, "model.fp32_logits")

    def forward(hidden: torch.Tensor) -> torch.Tensor:  # the fused kernels' fp32 chunk, for the whole input
        flat = hidden.reshape(-1, hidden.shape[-1])
        logits = torch.empty(flat.shape[0], head.weight.shape[0], dtype=torch.float32, device=hidden.device)
        return _logits_into(logits, flat, head.weight, head.bias).view(*hidden.shape[:-1], -1)

    with head_forward(head, forward):
        yield
