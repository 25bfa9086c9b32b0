"""Input checks of the logprob / entropy primitives, shared by ``logprob_entropy.py``,
``fused_linear.py`` and ``policy_loss.py``, and of a chunk's per-token loss inputs (``policy_loss.py``,
``policy_loss_triton.py``).

Off the CPU none of them reads a tensor value into Python (see ``_backend.py``).
"""

from __future__ import annotations

import torch

from fastrlhf.algorithms import check_same_shape

from ._backend import on_cpu


def _check_logits_labels(logits: torch.Tensor, labels: torch.Tensor) -> None:
    if logits.dim() != 2:
        raise ValueError(f"logits must be [N, V], got shape {tuple(logits.shape)}")
    if labels.shape != logits.shape[:1]:
        raise ValueError(
            f"shape mismatch: logits has shape {tuple(logits.shape)} (expected labels shape + [V]) "
            f"but labels has shape {tuple(labels.shape)}"
        )
    if logits.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"logits must be float32, bfloat16 or float16, got {logits.dtype}")
    if logits.shape[0] and logits.stride(1) != 1:
        raise ValueError(f"logits must be contiguous along the vocabulary, got strides {logits.stride()}")
    _check_label_dtype(labels)


def _check_label_dtype(labels: torch.Tensor) -> None:
    if labels.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"labels must be an integer tensor (int64 or int32), got {labels.dtype}")


def _check_labels_in_range(labels: torch.Tensor, vocab_size: int, vocab_name: str = "the vocabulary size") -> None:
    """Labels in [0, V): a clear ValueError on the CPU; elsewhere a device-side assert, which
    needs no host sync (an out-of-range label would otherwise index out of bounds; on meta the
    assert is a no-op)."""
    _check_label_dtype(labels)
    if labels.numel() == 0:
        return

    def message(found: str = "") -> str:
        return (f"labels must lie in [0, {vocab_size}) ({vocab_name}){found}; "
                "ignore indices such as -100 are not supported: mask those tokens instead")

    if not on_cpu(labels):
        torch._assert_async(((labels >= 0) & (labels < vocab_size)).all(), message())
        return
    lo, hi = int(labels.min()), int(labels.max())
    if lo < 0 or hi >= vocab_size:
        raise ValueError(message(f", found {lo if lo < 0 else hi}"))


def _check_row_vector(name: str, t: torch.Tensor | None, n: int, out: bool = False) -> torch.Tensor | None:
    if t is None:
        return None
    if t.shape != (n,) or (out and t.dtype != torch.float32):
        kind = "a float32 tensor of shape" if out else "shape"
        raise ValueError(f"{name} must have {kind} ({n},) (one value per logits row), got {t.dtype} {tuple(t.shape)}")
    return t if out else t.float().contiguous()


def _check_chunk_buffers(names, first, second, logits, backend, first_alone=False):
    """``probs_out`` / ``pz_out`` (or ``probs`` / ``pz``): fp32 ``[N, V]``, torch backend only; the
    second needs the first, and the first needs the second unless ``first_alone``."""
    if first is None and second is None:
        return
    if first is None:
        raise ValueError(f"{names[1]} needs {names[0]}: pass both or neither")
    if second is None and not first_alone:
        raise ValueError(f"{names[0]} needs {names[1]}: pass both or neither")
    if backend != "torch":
        raise ValueError(f"{names[0]} / {names[1]} are for backend='torch' only, got {backend!r}")
    for name, t in zip(names, (first, second), strict=True):
        if t is None:
            continue
        if t.shape != logits.shape or t.dtype != torch.float32 or (t.shape[0] and t.stride(1) != 1):
            raise ValueError(
                f"{name} must be a float32 tensor of logits' shape {tuple(logits.shape)}, contiguous along the "
                f"vocabulary, got dtype {t.dtype} shape {tuple(t.shape)} strides {t.stride()}"
            )


def check_token_inputs(logprobs, entropy, old_logprobs, advantages, weights, ref_logprobs, kl_coef) -> None:
    """The checks of a chunk's per-token inputs, shared by the reference and the Triton kernel's launcher."""
    if logprobs.dim() != 1:
        raise ValueError(f"logprobs must be 1-D [n] (a chunk of flattened tokens), got shape {tuple(logprobs.shape)}")
    tensors = dict(logprobs=logprobs, entropy=entropy, advantages=advantages, weights=weights)
    if old_logprobs is not None:
        tensors["old_logprobs"] = old_logprobs
    if ref_logprobs is not None:
        tensors["ref_logprobs"] = ref_logprobs
    check_same_shape(**tensors)
    if kl_coef != 0.0 and ref_logprobs is None:
        raise ValueError(f"kl_coef is {kl_coef} but ref_logprobs is None; pass ref_logprobs or set kl_coef=0")
