"""tests/helpers/fp32_bounds.py: its bounds hold for fp32 softmax statistics summed in other orders, and
they still catch real bugs.

The fp32 computations here are the kernels' math (z = x / T, d = z - max, e = exp(d), S = sum e,
lse = max + log S, lp = d[label] - log S, H = log S + sum(e |d|) / S, dlogits from p = e / S) with
the two sums taken in many orders: ATen's, pairwise, sequential (forward, reversed, permuted, largest
first, smallest first), chunks of 7 / 64 / 1024 summed sequentially and then added sequentially,
Triton's online softmax over blocks of 1024, and an adversarial order (every term below half the
sum's ulp added last, one by one, so that each is absorbed). Every result must lie within the bound of
the float64 reference.
"""

import math

import numpy as np
import pytest
import torch
from helpers.fp32_bounds import (
    GradBound,
    U,
    assert_within,
    failure_probability,
    gamma,
    gamma_prob,
    linear_grad_bounds,
    linear_logits,
    softmax_bounds,
    softmax_grad_bound,
    sum_error,
)

ORDERS = ["aten", "pairwise", "sequential", "reversed", "permuted", "largest first", "smallest first", "chunks of 7",
          "chunks of 64", "chunks of 1024", "adversarial"]


def ordered_sum(t: torch.Tensor, order: str) -> torch.Tensor:
    """Row sums of the fp32 [N, V] ``t`` in ``order``, in fp32."""
    a = t.numpy()

    def sequential(x):
        return np.cumsum(x, axis=-1, dtype=np.float32)[..., -1]

    if order == "aten":
        return t.sum(-1)
    if order == "pairwise":
        width = 1 << (a.shape[-1] - 1).bit_length()
        b = np.zeros(a.shape[:-1] + (width,), np.float32)
        b[..., : a.shape[-1]] = a
        while b.shape[-1] > 1:
            b = b[..., 0::2] + b[..., 1::2]
        out = b[..., 0]
    elif order == "sequential":
        out = sequential(a)
    elif order == "reversed":
        out = sequential(a[..., ::-1])
    elif order == "permuted":
        g = torch.Generator().manual_seed(1)
        out = sequential(np.take_along_axis(a, torch.argsort(torch.rand(t.shape, generator=g), -1).numpy(), -1))
    elif order in ("largest first", "smallest first"):
        out = sequential(np.sort(a, -1)[..., ::-1] if order == "largest first" else np.sort(a, -1))
    elif order.startswith("chunks of "):
        k = int(order.removeprefix("chunks of "))
        pad = np.zeros(a.shape[:-1] + ((-a.shape[-1]) % k,), np.float32)
        out = sequential(sequential(np.concatenate([a, pad], -1).reshape(a.shape[:-1] + (-1, k))))
    else:  # adversarial: the terms >= half the sum's ulp first (exactly), then the rest one by one
        out = np.empty(a.shape[0], np.float32)
        for i, row in enumerate(a):
            half_ulp = np.spacing(np.float32(row.astype(np.float64).sum())) / 2
            big, small = row[row >= half_ulp], row[row < half_ulp]
            out[i] = sequential(np.concatenate([[np.float32(big.astype(np.float64).sum())], small]).astype(np.float32))
    return torch.from_numpy(np.ascontiguousarray(out))


def fp32_grad(stats32, labels, g_lp, g_ent, temperature):
    """dlogits in fp32 from fp32 stats (lp, H, lse, p, d, L)."""
    _, H, _, p, d, L = stats32
    onehot = torch.zeros_like(p).scatter_(1, labels[:, None], 1.0)
    logp = torch.where(p > 0, d - L[:, None], torch.zeros(()))
    return (g_lp[:, None] * (onehot - p) - g_ent[:, None] * p * (logp + H[:, None])) / temperature


def exact_grad(ref, labels, g_lp, g_ent, temperature):
    onehot = torch.zeros_like(ref.p).scatter_(1, labels[:, None], 1.0)
    return (g_lp[:, None].double() * (onehot - ref.p)
            - g_ent[:, None].double() * ref.p * (ref.logp + ref.entropy[:, None])) / temperature


def fp32_stats(x, labels, temperature, order):
    """(lp, H, lse, p, d, L) in fp32 with both row sums taken in ``order``."""
    z = x.float() / temperature
    m = z.amax(-1, keepdim=True)
    d = z - m
    e = torch.exp(d)
    products = torch.where(e > 0, e * -d, torch.zeros(()))
    S = ordered_sum(e, order)
    A = ordered_sum(products, order)
    L = torch.log(S)
    lp = d.gather(1, labels[:, None]).squeeze(1) - L
    return lp, L + A / S, m.squeeze(1) + L, e / S[:, None], d, L


def online_stats(x, labels, temperature, block):
    """Triton's stats kernel: online max / sum / entropy accumulator over vocabulary blocks (fp32)."""
    z = x.float() / temperature
    n, v = z.shape
    m = torch.full((n,), -3.0e38)
    s = torch.zeros(n)
    a = torch.zeros(n)
    for start in range(0, v, block):
        zb = z[:, start:start + block]
        m_new = torch.maximum(m, zb.amax(-1))
        shift = m - m_new
        scale = torch.exp(shift)
        db = torch.clamp(zb - m_new[:, None], min=-1000.0)
        eb = torch.exp(db)
        a = scale * (a + s * shift) + (eb * db).sum(-1)
        s = s * scale + eb.sum(-1)
        m = m_new
    log_s = torch.log(s)
    lse = m + log_s
    return z.gather(1, labels[:, None]).squeeze(1) - lse, log_s - a / s, lse


def make_case(vocab, scale, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed + vocab)
    x = (torch.randn(3, vocab, generator=g) * scale).to(dtype)
    x[1, : vocab // 2] = float("-inf")  # a row with half its logits -inf
    labels = torch.randint(0, vocab, (3,), generator=g)
    labels[1] = vocab - 1
    return x, labels


@pytest.mark.parametrize(
    "vocab,scale,temperature,dtype",
    [
        (7, 3.0, 0.7, torch.float32),
        (300, 3.0, 0.7, torch.float32),
        (4097, 3.0, 1.3, torch.bfloat16),
        (32003, 3.0, 0.7, torch.float32),
        (32003, 30.0, 0.5, torch.bfloat16),
        (151936, 3.0, 0.7, torch.float32),
        (151936, 30.0, 1.0, torch.float32),
    ],
)
def test_stats_and_gradient_within_bounds_in_every_order(vocab, scale, temperature, dtype):
    x, labels = make_case(vocab, scale, dtype)
    g = torch.Generator().manual_seed(2)
    g_lp, g_ent = torch.randn(3, generator=g), torch.randn(3, generator=g)
    ref = softmax_bounds(x, labels, temperature)
    grad_ref = softmax_grad_bound(ref, g_lp, g_ent)
    exact = exact_grad(ref, labels, g_lp, g_ent, temperature)
    for order in ORDERS:
        stats32 = fp32_stats(x, labels, temperature, order)
        lp, H, lse = stats32[:3]
        assert_within(lp, ref.logprobs, ref.logprobs_bound, f"logprob, {order}")
        assert_within(H, ref.entropy, ref.entropy_bound, f"entropy, {order}")
        assert_within(lse, ref.lse, ref.lse_bound, f"lse, {order}")
        assert_within(fp32_grad(stats32, labels, g_lp, g_ent, temperature), exact, grad_ref.bound, f"dlogits, {order}")
    if vocab > 1024:
        blocks = -(-vocab // 1024)
        online = softmax_bounds(x, labels, temperature, blocks=blocks)
        for what, got, want, bound in zip(("logprob", "entropy", "lse"), online_stats(x, labels, temperature, 1024),
                                          (online.logprobs, online.entropy, online.lse),
                                          (online.logprobs_bound, online.entropy_bound, online.lse_bound),
                                          strict=True):
            assert_within(got, want, bound, f"{what}, online softmax over {blocks} blocks")


def test_head_gemms_within_bounds_in_every_order():
    """fused_linear's GEMMs (logits, grad_hidden, grad_weight, grad_bias) summed in other orders."""
    g = torch.Generator().manual_seed(3)
    n, h, v, temperature = 6, 64, 1000, 0.8
    hidden = torch.randn(n, h, generator=g)
    weight = torch.randn(v, h, generator=g) * 2 / h**0.5
    bias = torch.randn(v, generator=g) * 0.5
    labels = torch.randint(0, v, (n,), generator=g)
    g_lp, g_ent = torch.randn(n, generator=g), torch.randn(n, generator=g)
    logits, logit_error = linear_logits(hidden, weight, bias)
    stats = softmax_bounds(logits, labels, temperature, logit_error=logit_error)
    dlogits = softmax_grad_bound(stats, g_lp, g_ent)
    exact = exact_grad(stats, labels, g_lp, g_ent, temperature)
    reference = dict(hidden=exact @ weight.double(), weight=exact.T @ hidden.double(), bias=exact.sum(0))
    bounds = linear_grad_bounds(hidden, weight, GradBound(dlogits.size, dlogits.bound), reference, with_bias=True)

    def gemm(a, b, order):
        """a @ b.T with each dot product summed in ``order`` (fp32 products)."""
        if order == "aten":
            return a @ b.T
        products = a[:, None, :] * b[None, :, :]
        return ordered_sum(products.reshape(-1, a.shape[1]), order).view(a.shape[0], b.shape[0])

    for order in ("aten", "pairwise", "sequential", "reversed", "permuted", "chunks of 7"):
        x = gemm(hidden, weight, order) + bias
        assert_within(x, logits, logit_error, f"logits, {order}")
        stats32 = fp32_stats(x, labels, temperature, order)
        assert_within(stats32[0], stats.logprobs, stats.logprobs_bound, f"logprob of the head, {order}")
        assert_within(stats32[1], stats.entropy, stats.entropy_bound, f"entropy of the head, {order}")
        grad = fp32_grad(stats32, labels, g_lp, g_ent, temperature)
        assert_within(grad, exact, dlogits.bound, f"dlogits of the head, {order}")
        assert_within(gemm(grad, weight.T, order), reference["hidden"], bounds["hidden"], f"grad_hidden, {order}")
        assert_within(gemm(grad.T, hidden.T, order), reference["weight"], bounds["weight"], f"grad_weight, {order}")
        assert_within(ordered_sum(grad.T.contiguous(), order), reference["bias"], bounds["bias"], f"grad_bias, {order}")


def test_absorption_term_is_needed_and_nearly_reached():
    """The probabilistic bound alone fails where small terms are absorbed (largest first, at V = 151936);
    the absorption term covers it, and the adversarial order reaches a good part of that term."""
    x, _ = make_case(151936, 3.0)
    e = torch.exp(x[0:1].double() / 0.7 - (x[0:1].double() / 0.7).max())
    exact = e.float().double().sum().item()  # the sum of the fp32 terms the orders add up
    without = sum_error(e, absorption=False).item()
    full = sum_error(e).item()
    largest_first = abs(ordered_sum(e.float(), "largest first").item() - exact)
    adversarial = abs(ordered_sum(e.float(), "adversarial").item() - exact)
    assert largest_first > without
    assert adversarial > without
    assert adversarial <= full
    assert adversarial > 0.25 * (full - without)
    # The deterministic gamma_n would allow several times more.
    assert gamma(151936) * e.sum().item() > 3 * full


def test_bounds_catch_real_bugs():
    """A wrong temperature, a dropped logit or a gradient slightly off are outside the bounds; the bound
    at small V is within a small factor of the fp32 errors the orders above make."""
    x, labels = make_case(300, 1.0)
    x[1] = torch.randn(300)  # every row finite here
    ref = softmax_bounds(x, labels, 0.7)

    def outside(got, want, bound):
        return ((got.double() - want).abs() > bound).all()

    # At V = 32003, whose any-order bound is two orders of magnitude wider: temperature off by 1%.
    big, big_labels = make_case(32003, 3.0)
    wide = softmax_bounds(big, big_labels, 0.7)
    lp, H, *_ = fp32_stats(big, big_labels, 0.7 * 1.01, "aten")
    assert outside(lp, wide.logprobs, wide.logprobs_bound) and outside(H, wide.entropy, wide.entropy_bound)
    # Temperature off by 0.1%.
    lp, H, lse, *_ = fp32_stats(x, labels, 0.7 * 1.001, "aten")
    assert outside(lp, ref.logprobs, ref.logprobs_bound) and outside(H, ref.entropy, ref.entropy_bound)
    # The last logit of the row dropped (a ragged tail masked one too far).
    lp, H, lse, *_ = fp32_stats(x[:, :-1], labels.clamp(max=298), 0.7, "aten")
    assert outside(lse, ref.lse, ref.lse_bound)
    assert outside(lp, ref.logprobs.double(), ref.logprobs_bound)
    # The gradient 0.1% off in every element (an fp16 round trip of p would do that).
    g_lp, g_ent = torch.ones(3), torch.ones(3)
    bound = softmax_grad_bound(ref, g_lp, g_ent)
    _, H, _, p, d, L = fp32_stats(x, labels, 0.7, "aten")
    onehot = torch.zeros(3, 300).scatter_(1, labels[:, None], 1.0)
    grad = (onehot - p - p * (d - L[:, None] + H[:, None])) / 0.7
    exact = (onehot - ref.p - ref.p * (ref.logp + ref.entropy[:, None])) / 0.7
    assert_within(grad, exact, bound.bound, "dlogits")
    assert ((grad * 1.001 - exact).abs() > bound.bound).any(-1).all()
    # Margins at V = 300: the worst order uses a sizable part of each bound.
    worst = max(((got.double() - want).abs() / bound).max().item()
                for order in ORDERS
                for got, want, bound in zip(fp32_stats(x, labels, 0.7, order)[:3],
                                            (ref.logprobs, ref.entropy, ref.lse),
                                            (ref.logprobs_bound, ref.entropy_bound, ref.lse_bound), strict=True))
    assert worst > 0.02


def test_constants():
    assert U == 2.0**-24
    assert gamma_prob(32003) < gamma(32003) / 20  # ~ 8 sqrt(n) u against n u
    assert failure_probability(151936) < 1e-8
    assert math.isclose(gamma_prob(1, 0.0), 1 * U * U / (1 - U), rel_tol=1e-6)
