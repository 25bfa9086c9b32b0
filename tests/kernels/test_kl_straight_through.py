"""trainer.kl_kind's straight-through kinds ("k1+", "k3+", "low_var_kl+", verl's): the estimate's value with k2's
gradient, through every path that computes the KL term of the loss: the reference (fastrlhf.algorithms.kl_penalty),
the Triton token loss and row kernel (TRITON_INTERPRET=1, tests/conftest.py) and their torch fallback, the fused
logits loss and the fused-linear loss; checked against verl's formula written out below, and against the identities
that define the kinds (the value is the plain kind's, the gradient k2's). Where the KL is only a value (the logged
kl metric, the KL in the rewards) a "+" kind is its plain kind. The new kernel variants compile for sm_80 and sm_90.
"""


import pytest
import torch
from fastrlhf.kernels.fused_linear import fused_linear_policy_loss
from fastrlhf.kernels.fused_linear_chunks import fused_linear_paths
from fastrlhf.kernels.policy_loss import fused_policy_loss, policy_loss_from_token_stats
from fastrlhf.kernels.policy_loss_triton import (
    BLOCK,
    KL_KIND_CODES,
    KL_STRAIGHT_THROUGH_CODES,
    triton_policy_loss_from_token_stats,
    triton_row_loss_and_grad,
)
from helpers.rl_case import GRPO, PAD, PROMPTS, SCORES, FixedScorer, fixed_completions, make_config, tiny_actor

from fastrlhf import algorithms as A
from fastrlhf.algorithms.logprobs import kl_penalty, resolve_kl_kind

PLUS_KINDS = ["k1+", "k3+", "low_var_kl+"]  # the schema's
EVERY_PLUS_KIND = PLUS_KINDS + ["kl+", "abs+"]  # verl also takes these
PLAIN = {kind: kind[:-1] for kind in EVERY_PLUS_KIND}


# verl's kl_penalty, written out from volcengine/verl verl/trainer/ppo/core_algos.py (kl_penalty and
# kl_penalty_forward, at b178a3cd): the forward score of the plain kind, and for a kind ending in "+" (k2 and mse
# excepted) `backward_score - backward_score.detach() + forward_score.detach()` with backward_score k2. verl's HEAD
# there passes the "+" on to kl_penalty_forward, which then raises NotImplementedError for every "+" kind;
# verl-project/verl#6058 strips it first, as here.
def verl_kl_penalty_forward(logprob, ref_logprob, kl_penalty):
    if kl_penalty in ("kl", "k1"):
        return logprob - ref_logprob
    if kl_penalty == "abs":
        return (logprob - ref_logprob).abs()
    if kl_penalty in ("mse", "k2"):
        return 0.5 * (logprob - ref_logprob).square()
    if kl_penalty in ("low_var_kl", "k3"):
        kl = ref_logprob - logprob
        kl = torch.clamp(kl, min=-20, max=20)
        ratio = torch.exp(kl)
        kld = (ratio - kl - 1).contiguous()
        return torch.clamp(kld, min=-10, max=10)
    raise NotImplementedError(kl_penalty)


def verl_kl_penalty(logprob, ref_logprob, kl_penalty):
    forward_score = verl_kl_penalty_forward(logprob, ref_logprob, kl_penalty.removesuffix("+"))
    if not kl_penalty.endswith("+") or kl_penalty in ("mse", "k2"):
        return forward_score
    backward_score = 0.5 * (logprob - ref_logprob).square()
    return backward_score - backward_score.detach() + forward_score.detach()


def value_and_grad(fn, lp, ref, kind):
    x = lp.detach().clone().requires_grad_()
    value = fn(x, ref, kind)
    value.sum().backward()
    return value.detach(), x.grad


def spread_logprobs(dtype=torch.float64):
    """Log-ratios from -30 to 30 (past k3's value clamp beyond about -2.6 and its log-ratio clamp at 20), 0 and
    tiny ones (k3's series / expm1 region) included."""
    diff = torch.cat([torch.linspace(-30, 30, 241), torch.tensor([0.0, 1e-5, -1e-5, 0.05, -0.05, 2.6, -2.6])])
    lp = -torch.rand(diff.numel(), generator=torch.Generator().manual_seed(0), dtype=torch.float64) * 4
    return lp.to(dtype), (lp - diff).to(dtype)


# ----------------------------------------------------------------------------------------------
# The reference, fastrlhf.algorithms.kl_penalty
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", EVERY_PLUS_KIND)
def test_reference_matches_verl_value_and_gradient(kind):
    lp, ref = spread_logprobs()
    value, grad = value_and_grad(kl_penalty, lp, ref, kind)
    verl_value, verl_grad = value_and_grad(verl_kl_penalty, lp, ref, kind)
    torch.testing.assert_close(value, verl_value, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, verl_grad, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", EVERY_PLUS_KIND)
def test_reference_value_is_the_plain_kinds_and_gradient_k2s(kind, dtype):
    lp, ref = spread_logprobs(dtype)
    value, grad = value_and_grad(kl_penalty, lp, ref, kind)
    plain_value, plain_grad = value_and_grad(kl_penalty, lp, ref, PLAIN[kind])
    _, k2_grad = value_and_grad(kl_penalty, lp, ref, "k2")
    assert torch.equal(value, plain_value)
    assert grad.dtype == dtype and torch.equal(grad, k2_grad)
    # k2's gradient d/dlogp = logp - ref, clamped nowhere: where k3 is clamped its own gradient is 0
    torch.testing.assert_close(grad, (lp.double() - ref.double()).to(dtype), rtol=0, atol=0)
    if PLAIN[kind] in ("k3", "low_var_kl"):
        clamped = (plain_value == 10.0) & (lp.double() - ref.double()).abs().gt(1.0)
        assert clamped.sum() > 10 and (plain_grad[clamped] == 0).all() and (grad[clamped] != 0).all()


@pytest.mark.parametrize("kind", PLUS_KINDS)
def test_reference_masked_tokens_are_zero_whatever_they_hold(kind):
    lp, ref = spread_logprobs(torch.float32)
    mask = torch.rand(lp.shape, generator=torch.Generator().manual_seed(1)) > 0.3
    lp[~mask], ref[~mask] = float("nan"), float("-inf")
    value, grad = value_and_grad(lambda x, r, k: kl_penalty(x, r, k, mask), lp, ref, kind)
    assert torch.isfinite(value).all() and torch.isfinite(grad).all()
    assert (value[~mask] == 0).all() and (grad[~mask] == 0).all()
    _, k2_grad = value_and_grad(lambda x, r, k: kl_penalty(x, r, k, mask), lp, ref, "k2")
    assert torch.equal(grad, k2_grad)


@pytest.mark.parametrize("kind", PLUS_KINDS)
def test_value_only_uses_read_the_plain_kind(kind):
    """The logged kl metric (rl/step.py, under no_grad) and the KL in the rewards (shape_rewards, on detached
    logprobs): a "+" kind is its plain kind there, exactly, and raises nothing."""
    lp, ref = spread_logprobs(torch.float32)
    lp, ref = lp.reshape(31, 8), ref.reshape(31, 8)
    mask = (torch.rand(lp.shape, generator=torch.Generator().manual_seed(2)) > 0.2).float()
    with torch.no_grad():
        x = lp.clone().requires_grad_()
        assert torch.equal(kl_penalty(x, ref, kind, mask), kl_penalty(x, ref, PLAIN[kind], mask))
    metric = A.masked_mean(kl_penalty(lp, ref, kind, mask), mask)
    assert torch.equal(metric, A.masked_mean(kl_penalty(lp, ref, PLAIN[kind], mask), mask))
    scores = torch.randn(31)
    assert torch.equal(
        A.shape_rewards(scores, lp, ref, mask, 0.1, kind), A.shape_rewards(scores, lp, ref, mask, 0.1, PLAIN[kind])
    )


def test_kind_names():
    assert resolve_kl_kind("k3+") == ("k3", True) and resolve_kl_kind("low_var_kl+") == ("k3", True)
    assert resolve_kl_kind("k1+") == ("k1", True) and resolve_kl_kind("k3") == ("k3", False)
    assert resolve_kl_kind("k2+") == ("k2", False)  # k2's own gradient: nothing to pass straight through
    lp = torch.zeros(3)
    for bad in ("k4+", "+", "k3++", "k3 +", None):
        with pytest.raises(ValueError, match="unknown KL kind"):
            kl_penalty(lp, lp, bad)
        with pytest.raises(ValueError, match="unknown KL kind"):
            triton_policy_loss_from_token_stats(lp, lp, None, lp, lp + 1, lp, kl_coef=0.1, kl_kind=bad)
    assert set(KL_STRAIGHT_THROUGH_CODES.values()).isdisjoint(KL_KIND_CODES.values())


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_fused_linear_refuses_an_unknown_kind_with_no_kept_token(backend):
    """The kind is checked at the call, not only where a chunk keeps a token (an all-masked micro-batch)."""
    hidden, weight = torch.randn(2, 3, 8, requires_grad=True), torch.randn(11, 8, requires_grad=True)
    zeros = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="unknown KL kind 'k9'"):
        fused_linear_policy_loss(
            hidden,
            weight,
            torch.zeros(2, 3, dtype=torch.long),
            zeros,
            zeros,
            zeros,
            ref_logprobs=zeros,
            kl_coef=0.1,
            kl_kind="k9",
            backend=backend,
        )


# ----------------------------------------------------------------------------------------------
# The per-token loss: Triton kernel (interpreted) and its reference
# ----------------------------------------------------------------------------------------------


def token_inputs(n, seed=0, spread=4.0, on_policy=False, zero_advantages=False):
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(n, generator=g) * 5
    old = None if on_policy else lp + 0.3 * torch.randn(n, generator=g)
    ref = lp + spread * torch.randn(n, generator=g)  # past k3's clamps for many tokens
    weights = torch.rand(n, generator=g) * (torch.rand(n, generator=g) > 0.2)
    adv = torch.zeros(n) if zero_advantages else torch.randn(n, generator=g)
    masked = weights == 0
    ent = torch.rand(n, generator=g) * 3
    lp[masked], ent[masked], ref[masked] = float("-inf"), float("nan"), float("-inf")
    if old is not None:
        old[masked] = float("nan")
    return dict(logprobs=lp, entropy=ent, old_logprobs=old, advantages=adv, weights=weights, ref_logprobs=ref)


def assert_token_results(got, want, what, exact=False):
    tol = dict(rtol=0, atol=0) if exact else dict(rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[0], want[0], **(tol if exact else dict(rtol=1e-5, atol=1e-5)), msg=what)
    torch.testing.assert_close(got[1], want[1], **tol, msg=f"grad logprobs ({what})")
    torch.testing.assert_close(got[2], want[2], **tol, msg=f"grad entropy ({what})")
    for k in want[3]:
        torch.testing.assert_close(
            got[3][k], want[3][k], **(tol if exact else dict(rtol=1e-5, atol=1e-4)), msg=f"{k} ({what})"
        )
    assert torch.isfinite(got[1]).all()


TOKEN_FUNCTIONS = {"triton": triton_policy_loss_from_token_stats, "reference": policy_loss_from_token_stats}


@pytest.mark.parametrize("on_policy,dual_clip", [(False, None), (False, 3.0), (True, None)])
@pytest.mark.parametrize("kind", EVERY_PLUS_KIND)
def test_token_loss_kernel_matches_the_reference(kind, on_policy, dual_clip):
    x = token_inputs(BLOCK + 237, seed=1, on_policy=on_policy)
    kw = dict(clip_low=0.2, clip_high=0.28, dual_clip=dual_clip, kl_coef=0.1, kl_kind=kind, entropy_coef=0.01)
    assert_token_results(
        triton_policy_loss_from_token_stats(**x, **kw),
        policy_loss_from_token_stats(**x, **kw),
        f"{kind} on_policy={on_policy} dual={dual_clip}",
    )


@pytest.mark.parametrize("path", sorted(TOKEN_FUNCTIONS))
@pytest.mark.parametrize("kind", PLUS_KINDS)
def test_token_loss_value_is_the_plain_kinds_and_gradient_k2s(kind, path):
    fn = TOKEN_FUNCTIONS[path]
    x = token_inputs(BLOCK + 237, seed=2)
    kw = dict(clip_low=0.2, clip_high=0.28, kl_coef=0.1, entropy_coef=0.01)
    got = fn(**x, **kw, kl_kind=kind)
    plain, k2 = fn(**x, **kw, kl_kind=PLAIN[kind]), fn(**x, **kw, kl_kind="k2")
    torch.testing.assert_close(got[0], plain[0], rtol=1e-6, atol=1e-6)
    assert torch.equal(got[3]["kl"], plain[3]["kl"])
    assert torch.equal(got[1], k2[1]) and torch.equal(got[2], k2[2])
    assert not torch.equal(got[1], plain[1])  # the case reaches where the two gradients differ


@pytest.mark.parametrize("path", sorted(TOKEN_FUNCTIONS))
@pytest.mark.parametrize("kind", EVERY_PLUS_KIND)
def test_token_loss_kl_term_is_verls(kind, path):
    """Advantages 0 and no entropy bonus leave the KL term alone: loss sum_t w_t * c * kl_t, gradient w_t * c *
    d kl_t / d lp, verl's, in float64."""
    x = token_inputs(BLOCK + 237, seed=3, zero_advantages=True)
    loss, g_lp, _, sums = TOKEN_FUNCTIONS[path](**x, kl_coef=0.25, kl_kind=kind)
    keep = x["weights"] > 0
    w = x["weights"].double()
    lp = torch.where(keep, x["logprobs"], 0.0).double().requires_grad_()
    ref = torch.where(keep, x["ref_logprobs"], 0.0).double()
    kl = verl_kl_penalty(lp, ref, kind)
    (w * 0.25 * kl).sum().backward()
    torch.testing.assert_close(loss.double(), (w * 0.25 * kl).sum().detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(g_lp.double(), lp.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(sums["kl"].double(), kl[keep].sum().detach(), rtol=1e-5, atol=1e-3)


@pytest.mark.parametrize("kind", PLUS_KINDS)
def test_row_kernel_matches_the_token_loss(kind):
    """The row kernel (a chunk's statistics, loss and dlogits in one launch) on odd sizes, a fully masked row
    included: its loss and sums as the token loss's of the logits' logprobs and entropies."""
    g = torch.Generator().manual_seed(4)
    n, v = 9, 301
    logits = torch.randn(n, v, generator=g) * 2
    labels = torch.randint(0, v, (n,), generator=g)
    lp = torch.log_softmax(logits, -1).gather(-1, labels[:, None])[:, 0]
    ent = A.entropy_from_logits(logits)
    weights = torch.rand(n, generator=g) + 0.1
    weights[3] = 0.0
    old, adv = lp + 0.3 * torch.randn(n, generator=g), torch.randn(n, generator=g)
    ref = lp + 4 * torch.randn(n, generator=g)
    ref[3] = float("-inf")
    kw = dict(clip_low=0.2, clip_high=0.28, kl_coef=0.1, kl_kind=kind, entropy_coef=0.01)
    out = torch.empty_like(logits)
    loss, sums = triton_row_loss_and_grad(logits, labels, old, adv, weights, ref, 1.0, out=out, **kw)
    want = policy_loss_from_token_stats(lp, ent, old, adv, weights, ref, **kw)
    torch.testing.assert_close(loss, want[0], rtol=1e-5, atol=1e-5)
    for k in sums:
        torch.testing.assert_close(sums[k], want[3][k], rtol=1e-5, atol=1e-4, msg=k)
    out_k2 = torch.empty_like(logits)
    triton_row_loss_and_grad(logits, labels, old, adv, weights, ref, 1.0, out=out_k2, **dict(kw, kl_kind="k2"))
    assert torch.equal(out, out_k2) and (out[3] == 0).all()


# ----------------------------------------------------------------------------------------------
# The fused losses: from logits, and from hidden states and the LM head
# ----------------------------------------------------------------------------------------------


def batch(shape=(3, 7), vocab=257, dtype=torch.float32, seed=0, neg_inf_logits=False):
    """Per-token data of ``shape``, row 1 fully masked, masked positions holding NaN / -inf."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, vocab, shape, generator=g)
    if neg_inf_logits:
        labels.clamp_(min=10)
    lp_guess = -torch.rand(shape, generator=g) * 5
    data = dict(
        old_logprobs=lp_guess + 0.3 * torch.randn(shape, generator=g),
        advantages=torch.randn(shape, generator=g),
        mask=(torch.rand(shape, generator=g) > 0.25).float(),
        ref_logprobs=lp_guess + 3 * torch.randn(shape, generator=g),
    )
    data["mask"][1] = 0.0
    masked = data["mask"] == 0
    data["old_logprobs"][masked], data["advantages"][masked] = float("nan"), float("nan")
    data["ref_logprobs"][masked] = float("-inf")
    return labels, data


def reference_loss(logits64, labels, d, kind, kw):
    """verl's KL on float64 logprobs of the same logits, with fastrlhf.algorithms' policy loss and aggregation."""
    mask = d["mask"].double()
    keep = mask > 0
    old, adv, ref = (torch.where(keep, d[k].double(), 0.0) for k in ("old_logprobs", "advantages", "ref_logprobs"))
    lp = A.logprobs_from_logits(logits64, labels, kw["temperature"])
    ent = A.entropy_from_logits(logits64, kw["temperature"])
    loss, _ = A.policy_loss(lp, old, adv, mask, kw["clip_low"], kw["clip_high"], kw["dual_clip"], kw["agg"])
    loss = loss + kw["kl_coef"] * A.aggregate_loss(verl_kl_penalty(lp, ref, kind), mask, kw["agg"])
    return loss - kw["entropy_coef"] * A.aggregate_loss(ent, mask, kw["agg"])


LOSS_KW = dict(
    clip_low=0.2,
    clip_high=0.28,
    dual_clip=None,
    kl_coef=0.2,
    entropy_coef=0.01,
    temperature=0.9,
    agg="seq-mean-token-mean",
)
# vs the float64 reference: (loss, gradient relative to its largest entry); bf16 logits are rounded to bf16
TOLERANCE = {torch.float32: (1e-5, 1e-4), torch.bfloat16: (5e-3, 5e-2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("kind", PLUS_KINDS)
def test_fused_logits_loss(kind, backend, dtype):
    labels, d = batch(shape=(3, 5), vocab=37, seed=5, neg_inf_logits=True)
    logits = (torch.randn(3, 5, 37, generator=torch.Generator().manual_seed(6)) * 2).to(dtype)
    logits[0, :, :10] = float("-inf")

    def run(k):
        x = logits.clone().requires_grad_()
        loss, metrics = fused_policy_loss(x, labels, **d, kl_kind=k, backend=backend, **LOSS_KW)
        loss.backward()
        return loss, metrics, x.grad

    loss, metrics, grad = run(kind)
    plain, k2 = run(PLAIN[kind]), run("k2")
    torch.testing.assert_close(loss, plain[0], rtol=1e-6, atol=1e-7)
    assert torch.equal(metrics["kl"], plain[1]["kl"])
    assert torch.equal(grad, k2[2]) and not torch.equal(grad, plain[2])
    assert torch.isfinite(grad).all() and (grad[1] == 0).all()
    x64 = logits.double().requires_grad_()
    want = reference_loss(x64, labels, d, kind, LOSS_KW)
    want.backward()
    loss_tol, grad_tol = TOLERANCE[dtype]
    torch.testing.assert_close(loss.double(), want.detach(), rtol=loss_tol, atol=loss_tol)
    torch.testing.assert_close(grad.double(), x64.grad, rtol=0, atol=grad_tol * x64.grad.abs().max().item())


FUSED_LINEAR_PATHS = [("torch", True), ("triton", True), ("triton", False)]  # (backend, one_pass_rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("backend,one_pass_rows", FUSED_LINEAR_PATHS)
@pytest.mark.parametrize("kind", PLUS_KINDS)
def test_fused_linear_loss(kind, backend, one_pass_rows, dtype):
    """Odd sizes (21 tokens, H 24, V 257), chunks of 7 tokens: row 1, fully masked, is a skipped chunk."""
    labels, d = batch(shape=(3, 7), vocab=257, seed=7)
    g = torch.Generator().manual_seed(8)
    hidden = torch.randn(3, 7, 24, generator=g).to(dtype)
    weight = (torch.randn(257, 24, generator=g) * 2 / 24**0.5).to(dtype)
    bias = (torch.randn(257, generator=g) * 0.5).to(dtype)

    def run(k):
        leaves = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
        with fused_linear_paths(one_pass_rows=one_pass_rows):
            loss, metrics = fused_linear_policy_loss(
                *leaves[:2], labels, **d, kl_kind=k, bias=leaves[2], chunk_size=7, backend=backend, **LOSS_KW
            )
        loss.backward()
        return loss, metrics, [t.grad for t in leaves]

    loss, metrics, grads = run(kind)
    plain, k2 = run(PLAIN[kind]), run("k2")
    torch.testing.assert_close(loss, plain[0], rtol=1e-6, atol=1e-7)
    assert torch.equal(metrics["kl"], plain[1]["kl"])
    for got, want in zip(grads, k2[2], strict=True):
        assert got.dtype == dtype and torch.isfinite(got).all()
        assert torch.equal(got, want)
    assert not torch.equal(grads[1], plain[2][1])
    assert (grads[0][1] == 0).all()
    leaves64 = [t.double().requires_grad_() for t in (hidden, weight, bias)]
    logits64 = leaves64[0] @ leaves64[1].t() + leaves64[2]
    want = reference_loss(logits64, labels, d, kind, LOSS_KW)
    want.backward()
    loss_tol, grad_tol = TOLERANCE[dtype]
    torch.testing.assert_close(loss.double(), want.detach(), rtol=loss_tol, atol=loss_tol)
    for name, got, leaf in zip(("hidden", "weight", "bias"), grads, leaves64, strict=True):
        torch.testing.assert_close(
            got.double(), leaf.grad, rtol=0, atol=grad_tol * leaf.grad.abs().max().item(), msg=f"grad of {name}"
        )


# ----------------------------------------------------------------------------------------------
# A GRPO step (the KL in the loss, its logged value)
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fused_loss", [True, False])
def test_a_step_with_k3_plus_logs_k3_and_trains_as_k2(fused_loss):
    """trainer.kl_kind: k3+ through RLStep: the logged kl is k3's, and the update moves the actor exactly as k2's
    gradient does (same completions, scores and reference; plain SGD so that equal gradients give equal weights)."""
    from fastrlhf.rl.step import RLStep

    def step(kind):
        torch.manual_seed(0)
        actor = tiny_actor()
        rl = RLStep(
            make_config(GRPO, kl_kind=kind, fused_loss=fused_loss),
            actor,
            rollout=None,
            scorer=FixedScorer(SCORES),
            reference=tiny_actor(seed=7).eval(),
            actor_optimizer=torch.optim.SGD(actor.parameters(), lr=0.1),
            pad_token_id=PAD,
            rollout_shares_actor=True,
        )
        metrics = rl(PROMPTS, None, step=1, completions=fixed_completions(tiny_actor().eval(), GRPO["temperature"]))
        return metrics, [p.detach().clone() for p in actor.parameters()]

    (plus, plus_weights), (k3, k3_weights), (_, k2_weights) = step("k3+"), step("k3"), step("k2")
    assert plus["kl"] == k3["kl"] > 0
    assert all(torch.equal(a, b) for a, b in zip(plus_weights, k2_weights, strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(plus_weights, k3_weights, strict=True))


# The "+" kinds' kernel variants compile for sm_80 and sm_90 with each Triton of the gpu extra:
# tests/kernels/test_kernels_aot.py (kernels/_triton_aot.py lists them with the others).
