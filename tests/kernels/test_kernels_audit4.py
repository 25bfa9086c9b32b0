"""The kernels at the edges the other kernel tests leave: row offsets past int32 (a 16,384-token micro-batch at
a 151,936 vocabulary), upstream gradients that are broadcasts, zeros or transposes, logits read through a shift
and a vocabulary-padding slice, bf16 at a temperature, a tied LM head, chunk boundaries down to a last chunk of
one row, and the clipped policy loss with dual clip and each KL estimator in three aggregation modes. The
reference is ``fastrlhf.algorithms`` in float64 on the same values; Triton runs under the interpreter
(tests/conftest.py), so sizes stay small and odd.
"""

import json
import os
import subprocess
import sys

import pytest
import torch
from fastrlhf.kernels import fused_linear_chunks as chunks_module
from fastrlhf.kernels import fused_linear_logprob_entropy, fused_linear_policy_loss, fused_policy_loss, logprob_entropy
from helpers import kernels4_wide_rows

from fastrlhf import algorithms as A

BACKENDS = ["torch", "triton"]
WIDE_ROWS = kernels4_wide_rows.__file__


def _close(got, want, dtype=torch.float32, what="value"):
    """Within fp32 rounding of the float64 reference (relative to the tensor's largest entry for its small ones),
    and one bf16 ulp more (the interpreter truncates) where the result is stored in bf16."""
    got, want = got.double(), want.double()
    rel = 2.0**-7 if dtype == torch.bfloat16 else 1e-5
    bound = rel * want.abs() + 1e-5 * want.abs().max() + 1e-7
    worst = ((got - want).abs() - bound).max()
    assert worst <= 0, f"{what}: off by {(got - want).abs().max():.3e} (reference max {want.abs().max():.3e})"


def test_row_offsets_past_int32_elements_under_the_interpreter(tmp_path):
    """Old: the row kernel's offsets wrapped at 2^31 elements under TRITON_INTERPRET (its loop yields Python ints,
    which times an int32 stride multiply in int32) and the child died of a segfault (exit -11)."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run(
        [sys.executable, WIDE_ROWS, "interpret", str(tmp_path)], env=env, capture_output=True, text=True, timeout=300
    )
    if proc.returncode == 2 and "SKIP" in proc.stdout:
        pytest.skip(proc.stdout.strip())
    assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), (proc.returncode, proc.stderr[-3000:])


def test_compiled_kernels_multiply_rows_by_strides_in_int64():
    """What a GPU runs: with the int32 strides the JIT passes for a 151,936 vocabulary, every row x stride
    product in the kernels' Triton IR is int64."""
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1"}
    proc = subprocess.run([sys.executable, WIDE_ROWS, "compile"], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    products = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(products) == 3
    for kernel, types in products.items():
        assert types and set(types) == {"i64"}, (kernel, types)


def _reference_le(logits, labels, temperature, g_lp, g_ent):
    x = logits.detach().double().requires_grad_()
    lp, ent = A.logprobs_from_logits(x, labels, temperature), A.entropy_from_logits(x, temperature)
    torch.autograd.backward((lp, ent), (g_lp.double(), g_ent.double()))
    return lp.detach(), ent.detach(), x.grad


UPSTREAM = {
    "broadcast": lambda b, t: (torch.tensor(0.5).expand(b, t), torch.tensor(-0.25).expand(b, t)),
    "zeros": lambda b, t: (torch.zeros(b, t), torch.zeros(b, t)),
    "transposed": lambda b, t: (
        torch.randn(t, b, generator=torch.Generator().manual_seed(3)).t(),
        torch.randn(t, b, generator=torch.Generator().manual_seed(4)).t(),
    ),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logprob_entropy_of_a_shifted_vocabulary_slice_with_odd_upstream_gradients(backend, dtype):
    """``logits[:, :-1, :V]`` of a padded vocabulary (neither contiguous nor a view of [N, V]) at T = 0.7, a row
    half -inf; the gradient reaches only the read part, whatever the upstream gradient's layout."""
    b, t, v, padded = 3, 5, 29, 32
    g = torch.Generator().manual_seed(0)
    full = (torch.randn(b, t + 1, padded, generator=g) * 3).to(dtype)
    full[0, 1, :14] = float("-inf")
    labels = torch.randint(0, v, (b, t), generator=g)
    labels[0, 1] = v - 1
    x = full.clone().requires_grad_()
    lp, ent = logprob_entropy(x[:, :-1, :v], labels, 0.7, backend)
    for name, make in UPSTREAM.items():
        g_lp, g_ent = make(b, t)
        (grad,) = torch.autograd.grad((lp, ent), x, (g_lp, g_ent), retain_graph=True)
        ref_lp, ref_ent, ref_grad = _reference_le(full[:, :-1, :v], labels, 0.7, g_lp, g_ent)
        _close(lp, ref_lp, what="logprobs")
        _close(ent, ref_ent, what="entropy")
        _close(grad[:, :-1, :v], ref_grad, dtype, what=f"dlogits ({name})")
        assert not grad[:, -1].any() and not grad[..., v:].any(), name
        if name == "zeros":
            assert not grad.any()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("chunk_size", [1, 3, 6, 7])  # 7 tokens: 7 chunks, 3 (last of 1 row), 2 (6 + 1), 1
def test_fused_linear_logprob_entropy_with_a_tied_head(backend, chunk_size):
    """The head is the input embedding: its gradient is the embedding's plus the head's (autograd adds them),
    at every chunking, with a broadcast upstream gradient for the entropy."""
    n, h, v = 7, 5, 23
    g = torch.Generator().manual_seed(1)
    weight0 = torch.randn(v, h, generator=g)
    ids, labels = torch.randint(0, v, (n,), generator=g), torch.randint(0, v, (n,), generator=g)
    g_lp = torch.randn(n, generator=g)

    def run(fused):
        emb = torch.nn.Embedding(v, h)
        with torch.no_grad():
            emb.weight.copy_(weight0.double() if not fused else weight0)
        if not fused:
            emb = emb.double()
        hidden = emb(ids) * 1.5
        if fused:
            lp, ent = fused_linear_logprob_entropy(
                hidden, emb.weight, labels, temperature=0.8, chunk_size=chunk_size, backend=backend
            )
        else:
            logits = hidden @ emb.weight.t()
            lp, ent = A.logprobs_from_logits(logits, labels, 0.8), A.entropy_from_logits(logits, 0.8)
        torch.autograd.backward((lp, ent), (g_lp.to(lp.dtype), torch.tensor(0.3, dtype=ent.dtype).expand(n)))
        return lp.detach(), emb.weight.grad

    lp, grad = run(True)
    ref_lp, ref_grad = run(False)
    _close(lp, ref_lp, what="logprobs")
    _close(grad, ref_grad, what="tied weight's gradient")


@pytest.mark.parametrize("backend", BACKENDS)
def test_fused_linear_frozen_head_makes_no_weight_gradient(backend, monkeypatch):
    """A head that requires no grad: no [V, H] accumulator and no grad_W GEMM, and the hidden states' gradient
    right; hidden states that require none: the head's gradient alone."""
    n, h, v = 7, 5, 23
    g = torch.Generator().manual_seed(2)
    weight, hidden, labels = torch.randn(v, h, generator=g), torch.randn(n, h, generator=g), torch.randint(0, v, (n,))
    made = []
    init = chunks_module._HeadGrads.__init__

    def spy(self, *args):
        init(self, *args)
        made.append(self.grad_weight is not None)

    monkeypatch.setattr(chunks_module._HeadGrads, "__init__", spy)
    for trained in ("hidden", "weight"):
        x = hidden.clone().requires_grad_(trained == "hidden")
        w = weight.clone().requires_grad_(trained == "weight")
        lp, ent = fused_linear_logprob_entropy(x, w, labels, chunk_size=3, backend=backend)
        (lp.sum() + ent.sum()).backward()
        x64, w64 = (
            hidden.double().requires_grad_(trained == "hidden"),
            weight.double().requires_grad_(trained == "weight"),
        )
        logits = x64 @ w64.t()
        (A.logprobs_from_logits(logits, labels).sum() + A.entropy_from_logits(logits).sum()).backward()
        leaf, ref = (x, x64) if trained == "hidden" else (w, w64)
        _close(leaf.grad, ref.grad, what=f"{trained} gradient")
        assert (w.grad is None) == (trained == "hidden") and (x.grad is None) == (trained == "weight")
    assert made == [False, True]


def _loss_reference(hidden, weight, labels, old, adv, mask, ref, temperature, agg, **terms):
    logits = hidden.double() @ weight.double().t()
    lp, ent = A.logprobs_from_logits(logits, labels, temperature), A.entropy_from_logits(logits, temperature)
    loss_mat, _, _ = A.actor_loss_per_token(lp, ent, old.double(), adv.double(), mask, ref.double(), **terms)
    return A.aggregate_loss(loss_mat, mask, agg)


TERMS = [
    dict(dual_clip=3.0, kl_coef=0.1, kl_kind="k1", entropy_coef=0.01),
    dict(dual_clip=2.0, kl_coef=0.2, kl_kind="k2", entropy_coef=0.0),
    dict(dual_clip=1.5, kl_coef=0.3, kl_kind="k3", entropy_coef=0.02),
    dict(dual_clip=None, kl_coef=0.1, kl_kind="abs", entropy_coef=0.0),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
@pytest.mark.parametrize("chunk_size", [7, 14])  # 15 tokens: 7 + 7 + 1, and 14 + 1
def test_fused_linear_policy_loss_every_kl_with_dual_clip_at_chunk_ends(backend, agg, chunk_size):
    """GRPO's broadcast advantages, a fully masked sequence, T = 0.7, clip-higher and dual clip, each KL
    estimator; the loss and both gradients against the float64 reference, the loss scaled in backward."""
    b, t, h, v = 3, 5, 6, 29
    for i, terms in enumerate(TERMS):
        g = torch.Generator().manual_seed(10 + i)
        hidden, weight = torch.randn(b, t, h, generator=g), torch.randn(v, h, generator=g) * 0.7
        labels = torch.randint(0, v, (b, t), generator=g)
        mask = (torch.rand(b, t, generator=g) > 0.3).float()
        mask[1] = 0
        old, ref = torch.randn(b, t, generator=g) * 0.5 - 3, torch.randn(b, t, generator=g) * 0.5 - 3
        adv = torch.randn(b, 1, generator=g).expand(b, t)
        x, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        loss, _ = fused_linear_policy_loss(
            x,
            w,
            labels,
            old,
            adv,
            mask,
            ref,
            temperature=0.7,
            agg=agg,
            chunk_size=chunk_size,
            backend=backend,
            clip_high=0.28,
            **terms,
        )
        (loss * 0.37).backward()
        x64, w64 = hidden.double().requires_grad_(), weight.double().requires_grad_()
        want = _loss_reference(x64, w64, labels, old, adv, mask, ref, 0.7, agg, clip_high=0.28, **terms)
        (want * 0.37).backward()
        _close(loss, want, what=f"loss {terms}")
        _close(x.grad, x64.grad, what=f"hidden gradient {terms}")
        _close(w.grad, w64.grad, what=f"weight gradient {terms}")
        assert not x.grad[1].any()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_policy_loss_of_a_shifted_vocabulary_slice(backend, dtype):
    """``fused_policy_loss`` reads ``logits[:, :-1, :V]`` in place at T = 0.6, with broadcast advantages."""
    b, t, v, padded = 3, 5, 29, 32
    g = torch.Generator().manual_seed(5)
    full = (torch.randn(b, t + 1, padded, generator=g) * 2).to(dtype)
    labels = torch.randint(0, v, (b, t), generator=g)
    mask = (torch.rand(b, t, generator=g) > 0.3).float()
    old, ref = torch.randn(b, t, generator=g) * 0.5 - 3, torch.randn(b, t, generator=g) * 0.5 - 3
    adv = torch.randn(b, 1, generator=g).expand(b, t)
    terms = dict(dual_clip=3.0, kl_coef=0.1, kl_kind="k3", entropy_coef=0.01)
    x = full.clone().requires_grad_()
    loss, _ = fused_policy_loss(
        x[:, :-1, :v], labels, old, adv, mask, ref, temperature=0.6, agg="seq-mean-token-mean", backend=backend, **terms
    )
    (loss * 0.37).backward()
    y = full.double().requires_grad_()
    lp, ent = A.logprobs_from_logits(y[:, :-1, :v], labels, 0.6), A.entropy_from_logits(y[:, :-1, :v], 0.6)
    loss_mat, _, _ = A.actor_loss_per_token(lp, ent, old.double(), adv.double(), mask, ref.double(), **terms)
    want = A.aggregate_loss(loss_mat, mask, "seq-mean-token-mean")
    (want * 0.37).backward()
    _close(loss, want, what="loss")
    _close(x.grad[:, :-1, :v], y.grad[:, :-1, :v], dtype, what="dlogits")
    assert not x.grad[:, -1].any() and not x.grad[..., v:].any()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("label", [-100, 23])
def test_fused_linear_labels_out_of_range_name_the_labels(backend, label):
    """An ignore index or a label past the vocabulary: a ValueError naming the labels and the head's rows, not an
    out-of-bounds read."""
    hidden, weight = torch.randn(3, 5), torch.randn(23, 5)
    labels = torch.tensor([0, label, 1])
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 23\).*weight\.shape\[0\]"):
        fused_linear_logprob_entropy(hidden, weight, labels, backend=backend)
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 23\)"):
        fused_linear_policy_loss(hidden, weight, labels, None, torch.ones(3), torch.ones(3), backend=backend)
