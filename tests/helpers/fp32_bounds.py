"""Error bounds of fp32 softmax statistics (log-sum-exp, logprob, entropy), their gradients, the LM head
GEMMs around them and the policy loss on top, computed from float64 references: a kernel test asserts
``|kernel - reference| <= bound`` element by element (:func:`assert_within`), whatever order the
kernel sums in and whatever the CPU's vector width.

Notation: u = 2^-24 (fp32 unit roundoff); x the logits as the kernel reads them (fp32, or bf16 / fp16
values, which float64 holds exactly: the reference reads the same numbers), T the temperature,
z = x / T, m = max z, d = z - m <= 0, e = exp(d), S = sum e, L = log S, lse = m + L, p = e / S,
A = sum e |d|, H = L + A / S (the entropy), lp = d[label] - L. Everything on the right-hand side of a
bound is a float64 reference quantity; first-order terms are kept, and the few second-order ones that
matter are kept as products (1 + eps)(1 + eps') rather than dropped.

1. Elementwise. fl(x / T) or x * fl(1 / T): |dz| <= 2u|z|. The kernels subtract a computed max
   m^ (shift invariance: lse = m^ + log sum exp(z - m^) for any m^, so m^'s own error cancels) and
   fl(z^ - m^) adds u|d|; a caller that shifts by lse instead (the torch gradient without a shift)
   adds u|log p|. An input error eps_x (the GEMM's, for fused_linear) adds eps_x / T. So
       dd_i = eps_x,i / T + u (2|z_i| + |d_i| + |log p_i|)           (absolute error of d_i)
   exp and log: at most 4 ulp = 8u relative (torch uses Sleef, the Triton interpreter numpy), so
       rho_i = (1 + 8u) exp(dd_i) - 1                                (relative error of e_i)
   A value that underflows may lose 2^-126 (flush to zero) on top.
   Triton's online softmax over ``blocks`` vocabulary blocks rescales its running sums at each new
   block: fl(m - m_new) (these telescope to at most u|d_i|, added to dd_i), exp of it (8u), the
   products and the a + s*shift sum (3u): rho_i gains 12u (blocks - 1).

2. Sums of n nonnegative terms t_i (S, A: all e_i and e_i|d_i| >= 0), in ANY order. The deterministic
   bound gamma_n = nu / (1 - nu) holds for every order but is ~100x pessimistic at V = 32003. We use
   Higham & Mary's probabilistic bound (SIAM J. Sci. Comput. 41(5), 2019, Thm 3.1): under independent
   mean-zero rounding errors, whatever the order, |error| <= gamma~_n(lam) sum t_i with
       gamma~_n(lam) = exp(lam sqrt(n) u + n u^2 / (1 - u)) - 1,
   with probability >= 1 - 2n exp(-lam^2 (1 - u)^2 / 2). lam = 8: <= 4e-9 per sum at n = 152k, so
   over all the sums the kernel tests check, the chance of one spurious failure is below 1e-5.
   The mean-zero model fails where it predictably does: when a summand Q is below the ulp of the
   sum P + Q it is absorbed (rounded down when Q < ulp/2, up when above), always the same way, so
   e.g. adding the small probabilities after the large ones (sequential, largest first) drifts
   linearly in n; at V = 151936 that order exceeds gamma~ alone (tests/kernels/test_fp32_bounds.py
   shows it). Those additions (Q < ulp(P + Q)) are bounded deterministically instead, and only the
   others keep the model: the error of fl(P + Q) is at most min(Q, ulp - Q) with ulp = ulp(P + Q), at
   most the fp32 ulp of the largest partial sum, ulp* = ulp((1 + 2 gamma~) sum t) (for Triton's
   rescaled partial sums only ulp* <= 2u (1 + 2 gamma~) sum t is known, and used).
   Only leaves t_i < ulp* take part (Q < ulp* needs all its leaves below it), min(Q, ulp - Q)
   <= sum over Q's leaves of min(t_i, ulp* - t_i), and each absorption multiplies the partial sum
   holding leaf i by at least 1/(2u) = 2^23, so leaf i is absorbed at most
   c_i = ceil(log2(sum t / t_i) / 23) times. Hence, for any order,
       |error| <= gamma~_n sum t_i + (1 + gamma~_n) sum_{t_i < ulp*} c_i min(t_i, ulp* - t_i).
   Adding the leaves below ulp/2 last, one by one, loses all of them: that order reaches over a third
   of this term at V = 32003 and 151936 (test_fp32_bounds.py), so it is not loose by much.
   (:func:`sum_error`.) Dot products of mixed sign and short length (the GEMMs: length H, the token
   count, or V for grad_hidden) use the deterministic gamma_n |a|.|b| (:func:`gamma`), which needs no
   model and is tight enough there.

3. Statistics. E_S = sum rho_i e_i + sum_error(e (1 + rho)) bounds |S^ - S|, eps_S = E_S / S;
   dL = -log(1 - eps_S - 2u) + 8u|L| (the torch path takes -log p[argmax] = log(S^) up to the 2u of
   the normalisation); dlse = dL + u|lse|; dlp = dd_label + dL + u|lse| + u|lp|.
   E_A = sum e (|d| (rho + u) + (1 + rho) dd (1 + u)) + sum_error(e (1 + rho)(|d| + dd)(1 + u)) bounds
   |A^ - A|. With S^ = S (1 + s), A^ = A + a and q = A / S, H^ - H = log(1 + s) - q s / (1 + s)
   + a / (S (1 + s)) + roundings (an error of S moves log S and A / S in opposite directions), so
   dH = max over s = +-eps_S of |log(1 + s) - q s / (1 + s)| (+ eps_S^2) + E_A / (S (1 - eps_S))
   + 2u + 8u|L| + 3u (A^ / S^: the torch path's normalised p, Triton's division) + u|H|.

4. Gradient in the logits. dx_j = (1/T) [g_lp (1[j = label] - p_j) - g_ent p_j (log p_j + H)].
   Computed p_j: relative error eps_p = max((1 + rho)(1 + 2u) / (1 - eps_S) - 1 (torch: e^ / S^),
   (1 + 8u) exp(dd + dL + u|lse|) - 1 (Triton: exp(z - lse^))); log p_j + H is off by at most
   dc = dd + dL + u|lse| + dH. Then
       |dx^_j - dx_j| <= (1/T) [|g_lp| p eps_p + |g_ent| p (|log p + H| eps_p + dc (1 + eps_p))
                               + 10u M_j] (+ the upstream gradients' own errors, propagated alike)
   with M_j = p (1 + eps_p)(|g_lp| + |g_ent| (|d| + |L| + |H| + |log p|)) + |g_lp| 1[j = label] the
   size of the intermediates, of which at most 10 roundings (1/T, the coefficient, the products, the
   sums, the one-hot term) enter. A bf16 / fp16 output adds its rounding: 2^-8 / 2^-11 relative
   (round to nearest), twice that where the Triton interpreter truncates, plus half the dtype's
   smallest subnormal in absolute terms (twice that too when truncating).

5. LM head (fused_linear). logits = hidden @ W^T (+ b): each is a dot product of length H (+1),
   |error| <= gamma_{H+1} (|h| |W|^T + |b|), then rounded to the input dtype (bf16: the products of
   bf16 numbers are exact in fp32 and the GEMM accumulates in fp32, then rounds once; twice with a
   bias). That is eps_x of 1. grad_hidden = dlogits @ W: sum_j (bound_j |W_jk|) + gamma_V sum_j
   |dlogits^_j| |W_jk|, and the output rounding; grad_W = dlogits^T @ hidden and grad_b = sum_t
   dlogits alike with gamma over the tokens (and, for bf16, each chunk's GEMM rounded to bf16).

6. Policy loss (vanilla clipped surrogate + KL penalty - entropy bonus, aggregated with weights w).
   Per token the loss is Lipschitz in lp with constant |A| r e^D (+ kl_coef times the KL's), D the
   error of lp (plus u|lp - old| and u|lp - ref| for the fp32 differences), and linear in H. The
   per-token fp32 math (exp, clamp, max/min, a few products and sums) is elementwise: at most 16u of
   the size of its terms, plus 5u for w (fp32 weights are at most 3 divisions of the mask away from
   the float64 ones) and the product by it. The loss sums w_t l_t over the tokens: gamma over the
   tokens and chunks. Metrics are masked means: the same per-token errors, gamma of the sum, one
   division; clipfrac may differ by the tokens whose ratio lies within D of a clip bound.
   Its gradient in lp changes by at most |A| r (e^D - 1) (+ the KL's) within D of the reference, except
   where a kink (a clip bound, the dual clip, the log-ratio clamp, |x| of the "abs" KL, k3's clamps)
   lies within D, where it may jump by 2x its Lipschitz constant: such tokens get that allowance (and
   count as ambiguous in clipfrac).

Everything a bound needs comes from float64 references; the reference VALUES themselves come from
``fastrlhf.algorithms`` called with float64 tensors (the tests do that, and :func:`policy_loss_bounds`
for its per-token derivatives), whose own error (~2^-53 relative) is far below these bounds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from fastrlhf.algorithms import (
    K3_CLAMP,
    LOG_RATIO_CLAMP,
    actor_loss_per_token,
    entropy_from_logits,
    logprobs_from_logits,
)

U = 2.0**-24
EXP_U = 8.0  # exp / log: 4 ulp = 8u relative
GRAD_OPS_U = 10.0  # roundings in one gradient element, relative to the size of its intermediates
TOKEN_OPS_U = 16.0  # roundings in one token's policy-loss math, relative to the size of its terms
LAMBDA = 8.0
TINY = 2.0**-126  # what an underflowing fp32 value may lose (flush to zero)
F64 = torch.float64

# Output rounding of a float32 result stored in a narrower dtype: (relative, absolute) for round to
# nearest; truncation (the Triton interpreter's fp32 -> bf16) doubles both.
_ROUNDING = {
    torch.float32: (0.0, 0.0),
    torch.bfloat16: (2.0**-8, 2.0**-134),
    torch.float16: (2.0**-11, 2.0**-25),
}


def gamma(n: int) -> float:
    """Deterministic gamma_n = n u / (1 - n u): any order, any signs."""
    if n * U >= 1:
        return math.inf
    return n * U / (1 - n * U)


def gamma_prob(n: int, lam: float = LAMBDA) -> float:
    """Higham & Mary's probabilistic gamma~_n(lam) = exp(lam sqrt(n) u + n u^2 / (1 - u)) - 1."""
    return math.expm1(lam * math.sqrt(n) * U + n * U * U / (1 - U))


def failure_probability(n: int, lam: float = LAMBDA) -> float:
    """Upper bound on the probability that one sum of n terms exceeds gamma~_n(lam) sum |t_i|."""
    return min(1.0, 2 * n * math.exp(-(lam**2) * (1 - U) ** 2 / 2))


def rounding(dtype: torch.dtype, truncates: bool = False) -> tuple[float, float]:
    """(relative, absolute) error of rounding an fp32 value to ``dtype``."""
    rel, tiny = _ROUNDING[dtype]
    return (2 * rel, 2 * tiny) if truncates else (rel, tiny)


def sum_error(terms: torch.Tensor, n: int | None = None, lam: float = LAMBDA, absorption: bool = True,
              rescaled: bool = False) -> torch.Tensor:
    """Bound on |fl(sum t) - sum t| over the last dim for NONNEGATIVE float64 terms, in any order
    (section 2 of the module docstring). ``n``: the number of additions on a leaf's path (default: the
    number of terms). ``absorption=False`` leaves out the absorption term (to show it is needed).
    ``rescaled``: partial sums get multiplied by factors <= 1 on the way (Triton's online softmax), so
    only ulp <= 2u (1 + 2 gamma~) sum t holds for them, not the fp32 ulp of that number."""
    terms = terms.to(F64)
    n = terms.shape[-1] if n is None else n
    g = gamma_prob(max(n, 1), lam)
    total = terms.sum(-1, keepdim=True)
    bound = g * total.squeeze(-1)
    if not absorption:
        return bound
    # The largest ulp a partial sum can have: that of (1 + 2 gamma~) sum t, in fp32.
    top = (1 + 2 * g) * total
    ulp = 2 * U * top if rescaled else torch.exp2(torch.floor(torch.log2(top)) - 23)
    small = (terms > 0) & (terms < ulp)
    ratio = torch.where(small, total / torch.where(small, terms, 1.0), 1.0)
    times = torch.ceil(torch.log2(ratio) / 23).clamp(min=1)
    charge = torch.where(small, times * torch.minimum(terms, ulp - terms), 0.0)
    return bound + (1 + g) * charge.sum(-1)


def assert_within(actual: torch.Tensor, expected: torch.Tensor, bound: torch.Tensor | float, what: str = "value"):
    """``|actual - expected| <= bound`` element by element, in float64; equal infinities (and equal NaNs
    nowhere) count as exact. Returns the largest ratio |actual - expected| / bound (0 if exact)."""
    a = actual.detach().to(F64)
    e = expected.detach().to(F64)
    b = torch.as_tensor(bound, dtype=F64).expand_as(e) if not torch.is_tensor(bound) else bound.detach().to(F64)
    assert a.shape == e.shape, f"{what}: shape {tuple(a.shape)} != {tuple(e.shape)}"
    assert not torch.isnan(a).any(), f"{what}: NaN in the kernel's output"
    same = a == e  # covers equal infinities
    diff = torch.where(same, 0.0, (a - e).abs())
    bad = ~(diff <= b)
    if bad.any():
        i = torch.nonzero(bad)[0].tolist()
        ratio = (diff / b)[bad].max().item()
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {e.numel()} elements outside the fp32 error bound (worst "
            f"|error| / bound = {ratio:.3g}); e.g. at {i}: got {a[tuple(i)].item():.9g}, reference "
            f"{e[tuple(i)].item():.9g}, bound {b[tuple(i)].item():.3g}"
        )
    positive = b > 0
    return (diff[positive] / b[positive]).max().item() if positive.any() else 0.0


# ----------------------------------------------------------------------------------------------
# Softmax statistics and their gradient (sections 1-4)
# ----------------------------------------------------------------------------------------------


@dataclass
class SoftmaxBounds:
    """float64 references (from fastrlhf.algorithms) and bounds, all of the labels' shape."""

    logprobs: torch.Tensor
    entropy: torch.Tensor
    lse: torch.Tensor
    logprobs_bound: torch.Tensor
    entropy_bound: torch.Tensor
    lse_bound: torch.Tensor
    # Per element [N, V] / per row [N], for the gradient bound.
    temperature: float
    shape: torch.Size
    labels: torch.Tensor
    finite: torch.Tensor
    p: torch.Tensor
    d: torch.Tensor
    logp: torch.Tensor
    rho: torch.Tensor
    dd: torch.Tensor
    row: dict


def softmax_bounds(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0, *,
                   logit_error: torch.Tensor | None = None, blocks: int = 1, path: int | None = None) -> SoftmaxBounds:
    """References and fp32 bounds of logprob, entropy and lse of softmax(logits / T) per row.

    ``logits`` ``[..., V]`` as the kernel reads them (any float dtype; -inf allowed where a row keeps
    one finite logit), ``labels`` ``[...]``. ``logit_error``: absolute error of the logits the kernel
    computed itself (``[..., V]``, see :func:`linear_logits`). ``blocks``: the Triton kernel's number
    of vocabulary blocks (1 for the torch path). ``path``: instead of any order, sums whose every term
    goes through at most ``path`` additions (a pairwise / cascade sum), bounded deterministically by
    gamma_path sum t (no model needed).
    """
    v = logits.shape[-1]
    x = logits.detach().to(F64).reshape(-1, v)
    lab = labels.reshape(-1).long()
    t = float(temperature)
    fin = torch.isfinite(x)
    zero = torch.zeros((), dtype=F64)
    z = torch.where(fin, x / t, zero)
    m = torch.where(fin, x / t, -math.inf).amax(-1, keepdim=True)
    d = torch.where(fin, x / t - m, zero)
    e = torch.where(fin, torch.exp(d), zero)
    S = e.sum(-1)
    L = torch.log(S)
    logp = torch.where(fin, d - L[:, None], zero)
    p = e / S[:, None]
    lse = m.squeeze(-1) + L
    A = (e * -d).sum(-1)
    H = L + A / S
    lp = logp.gather(1, lab[:, None]).squeeze(1)

    eps_x = torch.zeros_like(x) if logit_error is None else torch.where(
        fin, logit_error.detach().to(F64).reshape(-1, v), zero) / t
    dd = eps_x + U * (2 * z.abs() + d.abs() + logp.abs()) + (U * d.abs() if blocks > 1 else 0.0)
    dd = torch.where(fin, dd, zero)
    rho = torch.where(fin, (1 + EXP_U * U) * torch.exp(dd) - 1 + 12 * U * (blocks - 1), zero)
    n = v + 2 * blocks
    finite_count = fin.sum(-1).to(F64)

    def summed(t):
        return gamma(path) * t.sum(-1) if path is not None else sum_error(t, n, rescaled=blocks > 1)

    E_S = (rho * e).sum(-1) + TINY * finite_count + summed(e * (1 + rho))
    eps_S = E_S / S
    dL = -torch.log1p(-(eps_S + 2 * U)) + EXP_U * U * L.abs()
    dlse = dL + U * lse.abs()
    dlp = dd.gather(1, lab[:, None]).squeeze(1) + dL + U * lse.abs() + U * lp.abs()

    E_A = (e * (d.abs() * (rho + U) + (1 + rho) * dd * (1 + U))).sum(-1) + 1000 * TINY * finite_count + summed(
        e * (1 + rho) * (d.abs() + dd) * (1 + U))
    # H^ - H = [log(1 + s) - q s / (1 + s)] + a / (S (1 + s)) + roundings, for S^ = S (1 + s), |s| <= eps_S,
    # A^ = A + a, |a| <= E_A, q = A / S: an error of S moves log S and A / S in opposite directions.
    q = A / S
    f = torch.maximum((torch.log1p(eps_S) - q * eps_S / (1 + eps_S)).abs(),
                      (torch.log1p(-eps_S) + q * eps_S / (1 - eps_S)).abs()) + eps_S**2
    dH = (f + E_A / (S * (1 - eps_S)) + 2 * U + EXP_U * U * (L.abs() + eps_S)
          + 3 * U * (q + E_A / S) / (1 - eps_S))
    dH = dH + U * (H.abs() + dH)

    shape = labels.shape
    lp_ref = logprobs_from_logits(logits.detach().to(F64), labels, t)
    ent_ref = entropy_from_logits(logits.detach().to(F64), t)
    lse_ref = torch.logsumexp(logits.detach().to(F64) / t, dim=-1)
    return SoftmaxBounds(
        logprobs=lp_ref, entropy=ent_ref, lse=lse_ref,
        logprobs_bound=dlp.view(shape), entropy_bound=dH.view(shape), lse_bound=dlse.view(shape),
        temperature=t, shape=logits.shape, labels=lab, finite=fin, p=p, d=d, logp=logp, rho=rho, dd=dd,
        row=dict(L=L, H=H, lse=lse, eps_S=eps_S, dL=dL, dH=dH),
    )


@dataclass
class GradBound:
    """``size``: |exact gradient| per element; ``bound``: the error bound of the kernel's gradient."""

    size: torch.Tensor
    bound: torch.Tensor


def _relative_p_error(stats: SoftmaxBounds) -> torch.Tensor:
    """Relative error of a computed p_j: e^ / S^ (torch) or exp(z - lse^) (Triton), whichever is larger."""
    eps_S, dL, lse = (stats.row[k][:, None] for k in ("eps_S", "dL", "lse"))
    return torch.maximum((1 + stats.rho) * (1 + 2 * U) / (1 - eps_S) - 1,
                         (1 + EXP_U * U) * torch.exp(stats.dd + dL + U * lse.abs()) - 1)


def softmax_probs_bound(stats: SoftmaxBounds) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 softmax(logits / T) and the bound on the error of fp32 probabilities (logits' shape)."""
    bound = torch.where(stats.finite, stats.p * _relative_p_error(stats) + TINY, torch.zeros((), dtype=F64))
    return stats.p.view(stats.shape), bound.view(stats.shape)


def _per_row(g, n, like):
    if g is None:
        return torch.zeros(n, dtype=F64)
    g = torch.as_tensor(g, dtype=F64)
    return g.expand(like).reshape(-1) if g.dim() == 0 else g.detach().to(F64).reshape(-1)


def softmax_grad_bound(stats: SoftmaxBounds, grad_logprobs=None, grad_entropy=None, *, grad_logprobs_error=None,
                       grad_entropy_error=None, out_dtype: torch.dtype = torch.float32,
                       truncates: bool = False) -> GradBound:
    """Bound on the kernel's d(sum g_lp lp + g_ent H)/dlogits (section 4), of the logits' shape.

    ``grad_*``: the upstream gradients (fp32 values, read exactly by the reference; None: absent);
    ``grad_*_error``: their own error where the kernel computed them (the policy loss). ``out_dtype``:
    the gradient's dtype; ``truncates``: the Triton interpreter's fp32 -> bf16 conversion.
    """
    n, v = stats.p.shape
    lead = stats.shape[:-1]
    gl = _per_row(grad_logprobs, n, lead).abs()[:, None]
    ge = _per_row(grad_entropy, n, lead).abs()[:, None]
    dgl = _per_row(grad_logprobs_error, n, lead)[:, None]
    dge = _per_row(grad_entropy_error, n, lead)[:, None]
    r = stats.row
    L, H, lse, eps_S, dL, dH = (r[k][:, None] for k in ("L", "H", "lse", "eps_S", "dL", "dH"))
    p, d, logp, dd, fin = stats.p, stats.d, stats.logp, stats.dd, stats.finite
    onehot = torch.zeros_like(p).scatter_(1, stats.labels[:, None], 1.0)
    t = stats.temperature

    eps_p = _relative_p_error(stats)
    dc = dd + dL + U * lse.abs() + dH
    c = (logp + H).abs()
    size = (gl * (onehot - p).abs() + ge * p * c) / t
    mag = p * (1 + eps_p) * (gl + dgl + (ge + dge) * (d.abs() + L.abs() + H.abs() + logp.abs())) + (gl + dgl) * onehot
    err = (gl * p * eps_p + ge * p * (c * eps_p + dc * (1 + eps_p))
           + dgl * ((onehot - p).abs() + p * eps_p) + dge * p * (1 + eps_p) * (c + dc)
           + GRAD_OPS_U * U * mag + TINY * (gl + dgl + (ge + dge) * (1000 + L.abs() + H.abs()))) / t
    err = torch.where(fin, err, torch.zeros((), dtype=F64))
    rel, tiny = rounding(out_dtype, truncates)
    if rel:
        err = err + rel * (size + err) + tiny
    return GradBound(size.view(stats.shape), err.view(stats.shape))


# ----------------------------------------------------------------------------------------------
# LM head (section 5)
# ----------------------------------------------------------------------------------------------


def linear_logits(hidden, weight, bias=None):
    """float64 ``hidden @ weight.T + bias`` (``[..., V]``) and the bound on the error of the kernel's
    logits, computed by a GEMM in hidden's dtype (fp32 accumulation, then one rounding to bf16 / fp16,
    two with a bias)."""
    h = hidden.detach().to(F64)
    w = weight.detach().to(F64)
    prod = h @ w.T
    mag = h.abs() @ w.abs().T
    logits = prod if bias is None else prod + bias.detach().to(F64)
    if bias is not None:
        mag = mag + bias.detach().to(F64).abs()
    err = gamma(h.shape[-1] + (bias is not None)) * mag
    rel, tiny = rounding(hidden.dtype)
    if rel:
        err = err * (1 + rel) ** 2 + rel * logits.abs() + tiny
        if bias is not None:
            err = err + rel * (1 + rel) * prod.abs() + tiny
    err = torch.where(torch.isfinite(logits), err, torch.zeros((), dtype=F64))
    return logits, err


def linear_grad_bounds(hidden, weight, dlogits: GradBound, reference: dict, *, num_chunks: int = 1,
                       with_bias: bool = False, scale: float = 1.0) -> dict:
    """Bounds on the head's gradients from a bound on ``dlogits`` (``[N, V]``, already rounded to
    hidden's dtype): keys ``hidden``, ``weight``, ``bias`` (those in ``reference``, the float64
    reference gradients, used for the final rounding). ``scale``: grad_output, applied at the end
    (one more rounding unless it is a power of two)."""
    dtype = hidden.dtype
    rel, tiny = rounding(dtype)
    h = hidden.detach().to(F64).reshape(-1, hidden.shape[-1]).abs()
    w = weight.detach().to(F64).abs()
    size = dlogits.size.reshape(-1, w.shape[0])
    db = dlogits.bound.reshape(-1, w.shape[0])
    top = size + db  # |computed dlogits|
    n_tok, vocab = size.shape
    exact_scale = scale == 0 or math.frexp(abs(scale))[0] == 0.5
    out = {}

    def finish(err, ref):
        err = err + rel * (ref.abs() + err) + tiny  # cast / store in the input dtype
        err = abs(scale) * err
        if not exact_scale:
            err = err + max(rel, U) * (abs(scale) * ref.abs() + err)
        return err

    if "hidden" in reference:
        err = db @ w + gamma(vocab) * (top @ w)
        out["hidden"] = finish(err, reference["hidden"].detach().to(F64).reshape(-1, w.shape[1])).view(hidden.shape)
    if "weight" in reference:
        err = db.T @ h + gamma(n_tok + num_chunks) * (top.T @ h) + rel * (top.T @ h)
        out["weight"] = finish(err, reference["weight"].detach().to(F64))
    if "bias" in reference and with_bias:
        err = db.sum(0) + gamma(n_tok + num_chunks) * top.sum(0) + rel * top.sum(0)
        out["bias"] = finish(err, reference["bias"].detach().to(F64))
    return out


# ----------------------------------------------------------------------------------------------
# Policy loss (section 6)
# ----------------------------------------------------------------------------------------------


@dataclass
class PolicyBounds:
    loss: float  # float64 reference sum_t w_t loss_t (fastrlhf.algorithms.actor_loss_per_token)
    loss_bound: float
    metric_bounds: dict
    grad_logprobs: torch.Tensor  # float64 reference d loss / d lp per token (labels' shape)
    grad_logprobs_error: torch.Tensor
    grad_entropy: torch.Tensor
    grad_entropy_error: torch.Tensor


def _near(x, points, radius):
    hit = torch.zeros_like(x, dtype=torch.bool)
    for point in points:
        hit |= (x - point).abs() <= radius
    return hit


def policy_loss_bounds(stats: SoftmaxBounds, old_logprobs, advantages, weights, ref_logprobs=None, *,
                       clip_low=0.2, clip_high=0.2, dual_clip=None, kl_coef=0.0, kl_kind="k3", entropy_coef=0.0,
                       num_chunks=1) -> PolicyBounds:
    """Bounds on the vanilla policy loss sum_t w_t (policy + kl_coef KL - entropy_coef H), its metrics and
    the per-token gradients the kernel feeds to the logits gradient (section 6).

    ``weights``: the float64 aggregation weights (0 where masked; masked data may hold NaN / -inf);
    ``old_logprobs`` None: on-policy (ratio exactly 1 on both sides). ``num_chunks``: chunks whose
    losses the kernel adds up (each a further addition).
    """
    shape = stats.logprobs.shape
    w = weights.detach().to(F64).reshape(shape)
    keep = w > 0
    zero = torch.zeros((), dtype=F64)

    def kept(t):
        return torch.where(keep, t.detach().to(F64).reshape(shape), zero)

    lp, H = kept(stats.logprobs), kept(stats.entropy)
    D_lp, D_H = kept(stats.logprobs_bound), kept(stats.entropy_bound)
    adv = kept(advantages).abs()
    old = kept(old_logprobs) if old_logprobs is not None else None
    ref = kept(ref_logprobs) if ref_logprobs is not None else None
    use_kl = kl_coef != 0.0 and ref is not None
    D = D_lp + (U * (lp - old).abs() if old is not None else 0.0) + (U * (lp - ref).abs() if ref is not None else 0.0)

    # Policy term.
    caps = 1 + clip_high + (dual_clip or 0.0)
    if old is None:
        L_P = smooth_P = torch.zeros_like(lp)
        amb_P = amb_clip = torch.zeros_like(keep)
        ratio_top = torch.ones_like(lp)
    else:
        delta = lp - old
        r = torch.exp(delta.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
        ratio_top = r * torch.exp(D)
        L_P = adv * ratio_top
        smooth_P = adv * r * torch.expm1(D)
        clip_points = [math.log(1 - clip_low), math.log1p(clip_high)]
        amb_clip = _near(delta, clip_points, D) & (adv > 0)
        kinks = clip_points + [LOG_RATIO_CLAMP, -LOG_RATIO_CLAMP] + ([math.log(dual_clip)] if dual_clip else [])
        amb_P = _near(delta, kinks, D)
    mag_P = adv * (ratio_top + caps)
    dmag_P = adv * ratio_top

    # KL term.
    L_K = smooth_K = mag_K = kl_size = torch.zeros_like(lp)
    amb_K = torch.zeros_like(keep)
    if ref is not None:
        diff = lp - ref
        if kl_kind in ("k1", "kl"):
            L_K, mag_K = torch.ones_like(lp), diff.abs() + D
        elif kl_kind == "abs":
            L_K, mag_K, amb_K = torch.ones_like(lp), diff.abs() + D, diff.abs() <= D
        elif kl_kind in ("k2", "mse"):
            L_K, smooth_K, mag_K = diff.abs() + D, D, (diff.abs() + D) ** 2 / 2
        else:  # k3
            dp = (-diff).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
            L_K = torch.expm1(dp).abs() + torch.exp(dp) * torch.expm1(D)
            smooth_K = torch.exp(dp) * torch.expm1(D)
            value = torch.expm1(dp) - dp
            mag_K = torch.exp(dp + D) + dp.abs() + D + 1
            amb_K = _near(-diff, [LOG_RATIO_CLAMP, -LOG_RATIO_CLAMP], D) | _near(value, [K3_CLAMP, -K3_CLAMP], L_K * D)
        kl_size = mag_K
    kc = kl_coef if use_kl else 0.0
    mag = mag_P + kc * mag_K + entropy_coef * H.abs()

    n_tok = int(keep.sum())
    g_sum = gamma(max(n_tok, 1) + num_chunks)
    token_err = (L_P + kc * L_K) * D + entropy_coef * D_H + (TOKEN_OPS_U + 5) * U * mag
    loss_bound = (w * token_err).sum() + g_sum * (w * mag).sum()

    # Per-token gradients (float64 reference through fastrlhf.algorithms) and their errors.
    lp_r = torch.where(keep, stats.logprobs.detach().to(F64).reshape(shape), zero).requires_grad_()
    H_r = torch.where(keep, stats.entropy.detach().to(F64).reshape(shape), zero).requires_grad_()
    with torch.enable_grad():
        loss_mat, _, _ = actor_loss_per_token(
            lp_r, H_r, old if old is not None else lp_r.detach(), torch.where(keep, kept(advantages), zero), keep,
            ref, clip_low=clip_low, clip_high=clip_high, dual_clip=dual_clip, kl_coef=kc, kl_kind=kl_kind,
            entropy_coef=entropy_coef)
        total = torch.where(keep, w * loss_mat, zero).sum()
        g_lp, g_ent = torch.autograd.grad(total, (lp_r, H_r), allow_unused=True)
    g_lp = torch.zeros_like(lp) if g_lp is None else g_lp
    g_ent = torch.zeros_like(lp) if g_ent is None else g_ent
    dmag = dmag_P + kc * L_K
    g_lp_err = w * (smooth_P + kc * smooth_K + 2 * L_P * amb_P + 2 * kc * L_K * amb_K
                    + (TOKEN_OPS_U + 5) * U * dmag)
    g_ent_err = 5 * U * g_ent.abs()

    count = max(n_tok, 1)
    metric_bounds = {
        "entropy": ((D_H.sum() + g_sum * H.abs().sum()) / count + U * H.abs().sum() / count).item(),
        "clipfrac": (amb_clip & keep).sum().item() / count + U,
        "approx_kl": 0.0 if old is None else (
            ((D_lp + U * (lp - old).abs()).sum() + g_sum * (lp - old).abs().sum()) / count * (1 + 2 * U)).item(),
        "kl": 0.0 if ref is None else (
            ((L_K * D + TOKEN_OPS_U * U * kl_size).sum() + g_sum * kl_size.sum()) / count * (1 + 2 * U)).item(),
    }
    return PolicyBounds(total.item(), loss_bound.item(), metric_bounds, g_lp.detach(), g_lp_err, g_ent.detach(),
                        g_ent_err)
