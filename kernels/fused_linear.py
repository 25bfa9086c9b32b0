"""LM head + logprob / entropy / policy loss, chunked over tokens so the [N, V] logits never exist.

``logits = hidden @ weight.T (+ bias)`` is only ever built ``chunk_size`` tokens at a time, into one
reused ``[chunk_size, V]`` buffer of the input dtype. Per chunk the softmax statistics and the
``dlogits`` come from the shared primitives of ``logprob_entropy.py`` (Triton kernels or the
in-place torch path; for the vanilla, CISPO and SAPO policy losses on Triton, one kernel does a chunk's
statistics, loss and ``dlogits``: ``policy_loss_triton.triton_row_loss_and_grad``), ``dlogits`` overwrites the chunk's
logits in place, and the three GEMMs of the head run in the input dtype (bf16 inputs: bf16 GEMMs, fp32
softmax math, like the peers). ``fp32_logits=True`` keeps a bf16 head's logits as the GEMM's fp32 sums instead
of rounding them to bf16 (ScaleRL's fp32 head, vLLM's ``head_dtype: float32``); their gradient is rounded to bf16
once, for the head's two backward GEMMs.

Two ops, two gradient strategies:

* :func:`fused_linear_policy_loss` returns a scalar whose per-token weights are known up front
  (``aggregation_weights(mask, agg)``), so each chunk's gradients are computed DURING THE FORWARD
  pass right after its loss: 3 GEMMs in all, and backward only scales the stored ``grad_hidden`` /
  ``grad_weight`` / ``grad_bias`` by ``grad_output``. On the CPU, chunks where every token is masked
  are skipped (no GEMM; their gradient is zero and they count in no metric); finding them reads the
  mask on the host, so on other devices every chunk runs and a masked one adds zeros.
* :func:`fused_linear_logprob_entropy` returns per-token outputs whose upstream gradient is unknown
  until backward: forward keeps three fp32 numbers per token (logprob, entropy, lse), backward
  recomputes each chunk's logits (one extra GEMM, 4 in all), writes ``dlogits`` in place and
  accumulates the head's gradients.

``grad_weight`` is accumulated over chunks in one fp32 ``[V, H]`` buffer and returned in the weight's
dtype (``_HeadGrads``): ``addmm_`` straight into it for fp32; for bf16/fp16 on CUDA each chunk's GEMM
writes (first chunk) or adds into it in fp32 itself (``out_dtype``); elsewhere each chunk's bf16 GEMM
lands in a scratch of the weight's dtype that is then added into the fp32 buffer. The policy loss casts
it once, in backward, scaled by ``grad_output`` in the same pass. ``grad_hidden`` rows are written per
chunk in the hidden dtype.

Chunk size: by default the number of tokens whose logits fill a byte budget in fp32
(``budget // (4 * V)``), rounded down to a multiple of 8 (CPU) or 64 (accelerators) and clamped
to ``[minimum, N]``; see :func:`default_chunk_size`. The budget depends on the device, because the
cost of a chunk does (``_backend.py`` explains the rules):

* CPU: :data:`CPU_CHUNK_BYTES` (64 MiB: 512 tokens at V=32k, 104 at V=152k), at least
  :data:`MIN_CHUNK_TOKENS`. GEMMs reach full speed at a few hundred rows, and each op's OpenMP
  barrier, not the chunk count, is what costs.
* Accelerators: :data:`GPU_CHUNK_BYTES` (1 GiB: ~1.7k tokens at V=152k, so a 16k-token micro-batch
  is about ten chunks, not ~150), capped by a share of the device's free memory, and at least
  :data:`MIN_CHUNK_TOKENS_GPU`. Each chunk re-reads the whole ``[V, H]`` head and launches a
  dozen kernels, so small chunks leave the GEMMs bandwidth-bound and the GPU waiting on launches.

Where the head's gradient sums in fp32 inside its GEMMs (CUDA, bf16/fp16), the default budget grows by the
``[V, H]`` scratch that path does without (:func:`call_chunk_size`). ``chunk_bytes=`` sets the budget for one
call and ``chunk_size=`` (tokens) overrides both. Extra
memory is then two chunk buffers (the logits and, on the torch path, their fp32 probabilities; a
third fp32 one for bf16 inputs or T != 1) plus the fp32 ``grad_weight`` accumulator (and, where the GEMM
cannot sum in fp32, its scratch for bf16), instead of several ``[N, V]`` tensors.

No host syncs off the CPU: the chunk loops read no tensor value into Python there (labels are
checked once by a device-side assert; ``grad_output`` is applied unconditionally), so the host
queues every chunk's kernels without waiting for the device.

Value semantics equal the from-logits reference in ``fastrlhf.algorithms`` (``logprobs_from_logits``,
``entropy_from_logits``, ``policy_loss`` + KL + entropy terms, as :func:`fused_policy_loss`).
"""

from __future__ import annotations

import torch

from fastrlhf.algorithms import _check_temperature, loss_weights, resolve_kl_kind
from fastrlhf.memory.components import balanced_chunk_rows, chunk_budget_without_head_scratch

from ._backend import CPU_CHUNK_BYTES, GPU_CHUNK_BYTES, chunk_budget_bytes, on_cpu, resolve_backend
from .fused_linear_chunks import (
    PATHS,
    _chunks,
    _chunks_with_kept_tokens,
    _HeadGrads,
    _logits_into,
    _SoftmaxBuffers,
    accumulates_in_gemm,
    logits_dtype,
    row_programs,
    scale_and_cast,
)

__all__ = [
    "CPU_CHUNK_BYTES",
    "DEFAULT_CHUNK_BYTES",
    "GPU_CHUNK_BYTES",
    "MIN_CHUNK_TOKENS",
    "MIN_CHUNK_TOKENS_GPU",
    "call_chunk_size",
    "default_chunk_size",
    "fused_linear_logprob_entropy",
    "fused_linear_policy_loss",
]

# The CPU budget under its former name (CPU_CHUNK_BYTES and GPU_CHUNK_BYTES live in _backend.py,
# shared with the torch path's row chunks; patch them there).
DEFAULT_CHUNK_BYTES = CPU_CHUNK_BYTES
# Below this many rows a GEMM against the whole [V, H] head is far from peak speed on a CPU.
MIN_CHUNK_TOKENS = 16
# On an accelerator each chunk's GEMMs re-read the whole [V, H] head: in bf16 they do about one
# FLOP per head byte per token row, and a GPU's peak FLOPs over its memory bandwidth is a few
# hundred, so chunks below ~512 tokens are bandwidth-bound whatever the memory budget says.
MIN_CHUNK_TOKENS_GPU = 512


def default_chunk_size(
    num_tokens: int,
    vocab_size: int,
    budget_bytes: int | None = None,
    device: torch.device | str | None = None,
) -> int:
    """Tokens per chunk so that a chunk's fp32 logits fit ``budget_bytes`` (at most N), balanced: as many
    chunks as the budget needs, of (nearly) equal size, so that no small tail chunk runs its GEMMs at a
    fraction of the others' efficiency (16,384 tokens at V=152k on a GPU: ten chunks of 1,664 tokens,
    the last 1,408, rather than nine of 1,728 and one of 832).

    ``budget_bytes=None``: the budget of ``device`` (None: the CPU), ``_backend.chunk_budget_bytes``.
    CPU: a multiple of 8, at least :data:`MIN_CHUNK_TOKENS`; other devices: a multiple of 64, at
    least :data:`MIN_CHUNK_TOKENS_GPU` (the floor wins over the budget: pass an explicit
    ``chunk_size`` to go below it).
    """
    if budget_bytes is None:
        budget_bytes = chunk_budget_bytes(device)
    floor, multiple = (MIN_CHUNK_TOKENS, 8) if on_cpu(device) else (MIN_CHUNK_TOKENS_GPU, 64)
    return balanced_chunk_rows(num_tokens, budget_bytes // (4 * max(1, vocab_size)), floor, multiple)


def _primitives():
    # Imported on use: the sibling modules pull in nothing heavy, but keeping the import here lets
    # this module load (and report a clear error) even while a sibling is being edited.
    from .logprob_entropy import logprob_entropy_grad, logprob_entropy_stats

    return logprob_entropy_stats, logprob_entropy_grad


def _check_labels_in_range(labels, vocab_size):
    from .logprob_entropy import _check_labels_in_range

    _check_labels_in_range(labels, vocab_size, "the vocabulary size, weight.shape[0]")


def _loss_primitives(backend: str = "torch", policy_loss: str = "vanilla"):
    from .policy_loss import METRIC_SUM_KEYS, finalize_metrics, token_loss_function

    return token_loss_function(backend, policy_loss), finalize_metrics, METRIC_SUM_KEYS


def _row_loss_function(backend: str, policy_loss: str):
    """The one-launch chunk step (``policy_loss_triton.triton_row_loss_and_grad``) where it applies (Triton, the
    policy losses it covers, :data:`~fastrlhf.kernels.fused_linear_chunks.PATHS` leaving it on), else None."""
    from .policy_loss_triton import POLICY_LOSS_CODES, triton_row_loss_and_grad

    if backend != "triton" or policy_loss not in POLICY_LOSS_CODES or not PATHS.one_pass_rows:
        return None

    return triton_row_loss_and_grad


# ----------------------------------------------------------------------------------------------
# Argument checks and flattening
# ----------------------------------------------------------------------------------------------


def _check_positive_int(name, value):
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"{name} must be a positive int or None (automatic), got {value!r}")


def _flatten_inputs(hidden, weight, labels, bias, temperature, chunk_size, chunk_bytes=None):
    if not isinstance(hidden, torch.Tensor) or hidden.dim() not in (2, 3):
        shape = tuple(hidden.shape) if isinstance(hidden, torch.Tensor) else type(hidden).__name__
        raise ValueError(f"hidden must be a [N, H] or [B, T, H] tensor, got {shape}")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"weight must be [V, H] with H = hidden.shape[-1] = {hidden.shape[-1]}, got shape {tuple(weight.shape)}"
        )
    if weight.shape[0] == 0:
        raise ValueError("weight must have a non-empty vocabulary dimension, got V = 0")
    if labels.shape != hidden.shape[:-1]:
        raise ValueError(
            f"shape mismatch: hidden has shape {tuple(hidden.shape)} (expected labels shape + [H]) "
            f"but labels has shape {tuple(labels.shape)}"
        )
    if labels.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"labels must be an integer tensor (int64 or int32), got {labels.dtype}")
    if not hidden.is_floating_point() or hidden.dtype != weight.dtype:
        raise ValueError(
            f"hidden and weight must share one floating dtype, got hidden {hidden.dtype} and weight {weight.dtype}"
        )
    if bias is not None and (bias.shape != weight.shape[:1] or bias.dtype != weight.dtype):
        raise ValueError(
            f"bias must be [V] = ({weight.shape[0]},) of weight's dtype {weight.dtype}, "
            f"got shape {tuple(bias.shape)} dtype {bias.dtype}"
        )
    _check_temperature(temperature)
    _check_positive_int("chunk_size", chunk_size)
    _check_positive_int("chunk_bytes", chunk_bytes)
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    flat_labels = labels.reshape(-1).long()
    n = flat_hidden.shape[0]
    # Once per call: the chunks then skip the check (off the CPU each one is a few launches).
    _check_labels_in_range(flat_labels, weight.shape[0])
    if chunk_size is None:
        chunk_size = call_chunk_size(n, weight, chunk_bytes)
    return flat_hidden, flat_labels, max(1, min(chunk_size, n))


def call_chunk_size(num_tokens: int, weight: torch.Tensor, chunk_bytes: int | None = None) -> int:
    """The chunk rows of a call on ``num_tokens`` tokens and this head: :func:`default_chunk_size` of
    ``chunk_bytes``, or of the device's budget grown by the ``[V, H]`` scratch that a bf16/fp16 head's
    gradient does without where its GEMMs sum in fp32 (:func:`accumulates_in_gemm`; only when that gradient
    is made, i.e. grad enabled and the weight requiring it): the same peak in fewer chunks
    (``fastrlhf.memory.components.chunk_budget_without_head_scratch``, which the memory plan counts too)."""
    vocab, device = weight.shape[0], weight.device
    if chunk_bytes is None and not on_cpu(device) and _head_scratch_spared(weight):
        chunk_bytes = chunk_budget_without_head_scratch(chunk_budget_bytes(device), vocab, weight.shape[1],
                                                        weight.element_size())
    return default_chunk_size(num_tokens, vocab, chunk_bytes, device)


def _head_scratch_spared(weight: torch.Tensor) -> bool:
    return (torch.is_grad_enabled() and weight.requires_grad and weight.dtype != torch.float32
            and accumulates_in_gemm(weight))


def _flat_token_tensor(name: str, t: torch.Tensor | None, shape: torch.Size) -> torch.Tensor | None:
    if t is None:
        return None
    if not isinstance(t, torch.Tensor) or t.shape != shape:
        got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{name} must have the labels' shape {tuple(shape)}, got {got}")
    return t.detach().reshape(-1).float()


# ----------------------------------------------------------------------------------------------
# Per-token logprob + entropy
# ----------------------------------------------------------------------------------------------


class _FusedLinearLogprobEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, temperature, chunk_size, backend, fp32_logits):
        n, vocab = hidden.shape[0], weight.shape[0]
        rows = min(chunk_size, n)
        stats, _ = _primitives()
        dtype = logits_dtype(hidden, fp32_logits)
        softmax_bufs = _SoftmaxBuffers(backend, rows, vocab, dtype, hidden.device, temperature)
        logprobs = torch.empty(n, dtype=torch.float32, device=hidden.device)
        entropy = torch.empty_like(logprobs)
        # Per-row shift and lse relative to it: backward rebuilds log p from these exactly.
        shift = torch.empty_like(logprobs)
        lse = torch.empty_like(logprobs)
        buf = torch.empty(rows, vocab, dtype=dtype, device=hidden.device)
        for start, stop in _chunks(n, chunk_size):
            logits = _logits_into(buf[: stop - start], hidden[start:stop], weight, bias)
            logprobs[start:stop], entropy[start:stop], lse[start:stop] = stats(
                logits, labels[start:stop], temperature, backend, shift_out=shift[start:stop], check_labels=False,
                **softmax_bufs.stats_kwargs(logits),
            )
        ctx.save_for_backward(hidden, weight, bias, labels, lse, entropy, shift)
        ctx.temperature, ctx.chunk_size, ctx.backend, ctx.logits_dtype = temperature, chunk_size, backend, dtype
        ctx.set_materialize_grads(False)
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        hidden, weight, bias, labels, lse, entropy, shift = ctx.saved_tensors
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        if grad_logprobs is None and grad_entropy is None:
            return (None,) * 8
        n, vocab = hidden.shape[0], weight.shape[0]
        rows = min(ctx.chunk_size, n)
        _, grad = _primitives()
        grads = _HeadGrads(hidden, weight, bias, need_hidden, need_weight, need_bias and bias is not None)
        softmax_bufs = _SoftmaxBuffers(ctx.backend, rows, vocab, ctx.logits_dtype, hidden.device, ctx.temperature,
                                       with_products=False)
        buf = torch.empty(rows, vocab, dtype=ctx.logits_dtype, device=hidden.device)
        for start, stop in _chunks(n, ctx.chunk_size):
            h = hidden[start:stop]
            logits = _logits_into(buf[: stop - start], h, weight, bias)
            dlogits = grad(
                logits, labels[start:stop], lse[start:stop], entropy[start:stop],
                None if grad_logprobs is None else grad_logprobs[start:stop],
                None if grad_entropy is None else grad_entropy[start:stop], ctx.temperature, ctx.backend,
                out=logits, shift=shift[start:stop], **softmax_bufs.grad_kwargs(logits, False),
            )
            grads.add_chunk(start, stop, h, dlogits)
        del buf, softmax_bufs
        grad_hidden, grad_weight, grad_bias = grads.finish(hidden.dtype, weight.dtype)
        return grad_hidden, grad_weight, grad_bias, None, None, None, None, None


def fused_linear_logprob_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    backend: str = "auto",
    *,
    chunk_bytes: int | None = None,
    fp32_logits: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token fp32 ``(logprobs, entropy)`` of ``softmax((hidden @ weight.T + bias) / T)`` at ``labels``.

    hidden ``[N, H]`` or ``[B, T, H]``, weight ``[V, H]``, labels ``[N]`` / ``[B, T]`` in [0, V), bias
    ``[V]`` or None. Differentiable in hidden, weight and bias; the logits exist only
    ``chunk_size`` tokens at a time (default: :func:`default_chunk_size` of ``chunk_bytes``, itself
    by default the device's budget). Backward recomputes each chunk's logits once. Equal to
    ``logprobs_from_logits`` / ``entropy_from_logits`` of the materialised logits: of the inputs' dtype, or with
    ``fp32_logits`` the GEMM's fp32 sums of bf16/fp16 inputs (``logits_dtype``; the chunk then takes twice the
    bytes, and its gradient is rounded to the weight's dtype for the head's GEMMs).
    """
    backend = resolve_backend(backend, hidden)
    flat_hidden, flat_labels, chunk_size = _flatten_inputs(hidden, weight, labels, bias, temperature, chunk_size,
                                                           chunk_bytes)
    if flat_hidden.shape[0] == 0:
        empty = torch.zeros(labels.shape, dtype=torch.float32, device=hidden.device)
        if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
            # No tokens (a packed micro-batch of empty completions): outputs still in the graph, so
            # that a loss built on them backpropagates (zero gradients) like any other micro-batch's.
            anchor = (flat_hidden.sum() * 0 + weight.sum() * 0).float()
            return empty + anchor, empty + anchor
        return empty, empty.clone()
    logprobs, entropy = _FusedLinearLogprobEntropy.apply(
        flat_hidden, weight, bias, flat_labels, float(temperature), chunk_size, backend, bool(fp32_logits)
    )
    return logprobs.view(labels.shape), entropy.view(labels.shape)


# ----------------------------------------------------------------------------------------------
# Scalar policy loss, gradients computed during the forward pass
# ----------------------------------------------------------------------------------------------


class _FusedLinearPolicyLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, old_logprobs, advantages, weights, ref_logprobs, loss_kwargs,
                temperature, chunk_size, backend, grad_enabled, fp32_logits):
        loss_fn, _, metric_keys = _loss_primitives(backend, loss_kwargs["policy_loss"])
        rows_fn = _row_loss_function(backend, loss_kwargs["policy_loss"])
        n, vocab = hidden.shape[0], weight.shape[0]
        rows = min(chunk_size, n)
        need_hidden, need_weight, need_bias = (grad_enabled and need for need in ctx.needs_input_grad[:3])
        grads = _HeadGrads(hidden, weight, bias, need_hidden, need_weight, need_bias and bias is not None)
        stats, grad = _primitives()
        dtype = logits_dtype(hidden, fp32_logits)
        softmax_bufs = _SoftmaxBuffers(backend, rows, vocab, dtype, hidden.device, temperature)
        shift_buf = torch.empty(rows, dtype=torch.float32, device=hidden.device)
        with_entropy_grad = loss_kwargs["entropy_coef"] != 0.0

        chunk_has_tokens = _chunks_with_kept_tokens(weights, chunk_size)

        loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
        sums = {k: torch.zeros((), dtype=torch.float32, device=hidden.device) for k in metric_keys}
        buf = torch.empty(rows, vocab, dtype=dtype, device=hidden.device)
        for index, (start, stop) in enumerate(_chunks(n, chunk_size)):
            if not chunk_has_tokens[index]:
                # Every token masked: no loss, no metric, zero gradient; skip the GEMMs.
                if grads.grad_hidden is not None:
                    grads.grad_hidden[start:stop].zero_()
                continue
            h, lab = hidden[start:stop], labels[start:stop]
            logits = _logits_into(buf[: stop - start], h, weight, bias)
            old, ref = (None if t is None else t[start:stop] for t in (old_logprobs, ref_logprobs))
            if rows_fn is not None:  # statistics, loss and dlogits (in place) in one launch
                chunk_loss, chunk_sums = rows_fn(logits, lab, old, advantages[start:stop], weights[start:stop], ref,
                                                 temperature, out=logits if grads.any else None,
                                                 programs=row_programs(logits.device) if grads.any else None,
                                                 **loss_kwargs)
                dlogits = logits
            else:
                shift = shift_buf[: stop - start]
                lp, ent, lse = stats(logits, lab, temperature, backend, shift_out=shift, check_labels=False,
                                     **softmax_bufs.stats_kwargs(logits))
                chunk_loss, grad_lp, grad_ent, chunk_sums = loss_fn(lp, ent, old, advantages[start:stop],
                                                                    weights[start:stop], ref, **loss_kwargs)
                if grads.any:
                    dlogits = grad(logits, lab, lse, ent, grad_lp, grad_ent if with_entropy_grad else None,
                                   temperature, backend, out=logits, shift=shift,
                                   **softmax_bufs.grad_kwargs(logits, True))
            loss += chunk_loss
            for k in metric_keys:
                sums[k] += chunk_sums[k]
            if grads.any:
                grads.add_chunk(start, stop, h, dlogits)
        del buf, softmax_bufs
        # Cast later, with grad_output: one pass over the fp32 accumulators instead of a cast now and a scale then.
        ctx.head_grads = grads.finish(hidden.dtype, weight.dtype, cast=False) if grads.any else (None, None, None)
        ctx.grad_dtypes, ctx.backend = (hidden.dtype, weight.dtype, weight.dtype), backend
        metric_values = tuple(sums[k] for k in metric_keys)
        ctx.mark_non_differentiable(*metric_values)
        return (loss,) + metric_values

    @staticmethod
    def backward(ctx, grad_output, *_metric_grads):
        if ctx.head_grads is None:
            raise RuntimeError(
                "fused_linear_policy_loss: backward ran twice through the same graph; its gradients are "
                "computed in forward and released by the first backward, so call the op again instead"
            )
        grads, ctx.head_grads = ctx.head_grads, None
        # The stored gradients are ours alone (released above): grad_hidden is scaled in place, the fp32
        # accumulators scaled and cast in one pass. The loss is usually backpropagated with grad_output == 1,
        # which the CPU checks for free (elsewhere that read would wait for the device).
        scale = None if on_cpu(grad_output) and float(grad_output) == 1.0 else grad_output
        return tuple(scale_and_cast(g, scale, dtype, ctx.backend)
                     for g, dtype in zip(grads, ctx.grad_dtypes, strict=True)) + (None,) * 11


def fused_linear_policy_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    old_logprobs: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    ref_logprobs: torch.Tensor | None = None,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float | None = None,
    kl_coef: float = 0.0,
    kl_kind: str = "k3",
    entropy_coef: float = 0.0,
    temperature: float = 1.0,
    agg: str = "token-mean",
    bias: torch.Tensor | None = None,
    chunk_size: int | None = None,
    backend: str = "auto",
    *,
    chunk_bytes: int | None = None,
    policy_loss: str = "vanilla",
    weights: torch.Tensor | None = None,
    policy_loss_args: dict | None = None,
    fp32_logits: bool = False,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The actor's loss (a registered token-level policy loss, with its options ``policy_loss_args``, + KL
    penalty - entropy bonus) from hidden states and the LM head.

    Equal to :func:`fastrlhf.kernels.fused_policy_loss` of ``logits = hidden @ weight.T + bias``
    (itself ``aggregate_loss(actor_loss_per_token(...))`` of ``fastrlhf.algorithms``), without ever
    holding those logits: hidden ``[N, H]`` or ``[B, T, H]``,
    weight ``[V, H]``, bias ``[V]`` or None; labels, old_logprobs, advantages, mask and ref_logprobs
    all of labels' shape (``[B, T]`` for the ``seq-mean-*`` aggregations). Returns the fp32 scalar loss,
    differentiable in hidden, weight and bias, and detached metrics ``clipfrac``, ``approx_kl``,
    ``entropy``, ``kl`` (masked means; ``kl`` is 0 without ref_logprobs). ``old_logprobs=None`` is the
    on-policy update (old = the logprobs computed here, detached: ratio 1), which spares the caller
    a forward pass to recompute them.

    The gradients are computed chunk by chunk during this call and held until backward, which
    only scales them by ``grad_output`` (and casts the head's fp32 sums to the weight's dtype in the
    same pass); so backward can run once per call (not with ``retain_graph`` twice), and a call made
    with grad enabled holds ``grad_weight`` (fp32 ``[V, H]``) until then.

    Chunking and ``fp32_logits`` as in :func:`fused_linear_logprob_entropy`: ``chunk_size`` tokens, else
    :func:`default_chunk_size` of ``chunk_bytes`` (default: the device's budget).

    ``weights`` (labels' shape): the per-token aggregation weights, precomputed, instead of
    ``aggregation_weights(mask, agg)`` (``fastrlhf.algorithms.loss_weights``): a micro-batch of a
    larger minibatch passes its tokens' share of the minibatch's weights, so that the micro-batches'
    losses and gradients add up to the minibatch's. Packed sequences pass flat ``[n]`` tokens with
    their weights, whatever ``agg`` was.
    """
    backend = resolve_backend(backend, hidden)
    flat_hidden, flat_labels, chunk_size = _flatten_inputs(hidden, weight, labels, bias, temperature, chunk_size,
                                                           chunk_bytes)
    if kl_coef != 0.0 and ref_logprobs is None:
        raise ValueError(f"kl_coef is {kl_coef} but ref_logprobs is None; pass ref_logprobs or set kl_coef=0")
    resolve_kl_kind(kl_kind)  # an unknown kind raises here, not only where a chunk keeps a token
    flat = {
        name: _flat_token_tensor(name, t, labels.shape)
        for name, t in (("old_logprobs", old_logprobs), ("advantages", advantages), ("mask", mask),
                        ("ref_logprobs", ref_logprobs))
    }
    weights = loss_weights(mask.detach(), agg, weights).reshape(-1).float()
    _, finalize_metrics, metric_keys = _loss_primitives()
    if flat_hidden.shape[0] == 0:
        zero = torch.zeros((), dtype=torch.float32, device=hidden.device)
        loss = (flat_hidden.sum() * 0 + weight.sum() * 0).float() if torch.is_grad_enabled() else zero
        return loss, finalize_metrics({k: zero for k in metric_keys})
    loss_kwargs = dict(clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip, kl_coef=kl_coef,
                       kl_kind=kl_kind, entropy_coef=entropy_coef, policy_loss=policy_loss,
                       policy_loss_args=policy_loss_args)
    loss, *sums = _FusedLinearPolicyLoss.apply(
        flat_hidden, weight, bias, flat_labels, flat["old_logprobs"], flat["advantages"], weights,
        flat["ref_logprobs"], loss_kwargs, float(temperature), chunk_size, backend, torch.is_grad_enabled(),
        bool(fp32_logits),
    )
    return loss, finalize_metrics(dict(zip(metric_keys, sums, strict=True)))
