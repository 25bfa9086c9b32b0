"""``model.fp32_logits`` outside the fused kernels: a bf16/fp16 LM head whose logits are its GEMM's fp32 sums.

The RL step compares (and, with TIS, weighs) the trainer's logprobs against the rollout engine's. Both run the head
as a GEMM of bf16 operands with fp32 accumulation; rounding its output to bf16 moves a logit of a few units by up
to ~1e-2, differently in each engine's kernels, and that rounding is a large share of the mismatch (ScaleRL; vLLM
PR #48390, which added ``head_dtype: float32`` for generation). With the option on, the fused kernels keep their
chunk's logits in fp32 (``fastrlhf.kernels.fused_linear``), vLLM runs its head with ``head_dtype: float32``
(``fastrlhf.rollout.vllm_adapter``), and HF ``generate`` runs the head through :func:`fp32_logits_head`: the same
exact products and fp32 sums, no bf16 rounding anywhere between the GEMM and the log-softmax.
"""

from __future__ import annotations

import contextlib

import torch

__all__ = ["fp32_logits_head"]


@contextlib.contextmanager
def fp32_logits_head(model: torch.nn.Module):
    """Within the block, ``model``'s output embedding (its LM head) returns fp32 logits of its bf16/fp16 weight:
    one GEMM that writes fp32 (``out_dtype``) on CUDA, exact fp32 copies elsewhere. An fp32 head is left as it is."""
    from fastrlhf.kernels.fused_linear_chunks import _logits_into

    head = model.get_output_embeddings()
    if head is None or head.weight.dtype == torch.float32:
        yield
        return
    if type(head) is not torch.nn.Linear:  # an adapter's wrapper (LoRA on lm_head) adds more than weight and bias
        raise ValueError(f"model.fp32_logits: the LM head is a {type(head).__name__}, not a plain Linear; set "
                         "model.fp32_logits: false or keep the head out of model.lora_targets")

    def forward(hidden: torch.Tensor) -> torch.Tensor:  # the fused kernels' fp32 chunk, for the whole input
        flat = hidden.reshape(-1, hidden.shape[-1])
        logits = torch.empty(flat.shape[0], head.weight.shape[0], dtype=torch.float32, device=hidden.device)
        return _logits_into(logits, flat, head.weight, head.bias).view(*hidden.shape[:-1], -1)

    head.forward = forward
    try:
        yield
    finally:
        del head.forward  # the class's forward again
