"""The per-token policy loss in one Triton kernel (kernels/policy_loss_triton.py, run by TRITON_INTERPRET=1)
against its reference, policy_loss_from_token_stats (autograd through fastrlhf.algorithms): the loss, each
token's gradient in its logprob and entropy, and the metric sums, over every option the kernel covers, masked
tokens holding -inf and NaN, log-ratios past the clamp, k3 past its clamp, ties, and sizes around its block."""

import itertools

import pytest
import torch
from fastrlhf.kernels.policy_loss import METRIC_SUM_KEYS, policy_loss_from_token_stats, token_loss_function
from fastrlhf.kernels.policy_loss_triton import BLOCK, triton_policy_loss_from_token_stats


def token_inputs(n, seed=0, spread=1.0, on_policy=False, ties=False):
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(n, generator=g) * 5
    old = None if on_policy else lp + spread * torch.randn(n, generator=g)
    if ties and old is not None:
        old[::3] = lp[::3]  # ratio exactly 1: the clipped and unclipped terms tie
    ref = lp + spread * 2 * torch.randn(n, generator=g)  # k3 past its clamp where lp - ref < -2.6
    weights = torch.rand(n, generator=g) * (torch.rand(n, generator=g) > 0.2)
    masked = weights == 0
    lp, ent = lp.clone(), torch.rand(n, generator=g) * 3
    lp[masked], ent[masked] = float("-inf"), float("nan")  # what padding may hold: must reach no gradient
    if old is not None:
        old[masked] = float("nan")
    ref[masked] = float("-inf")
    return dict(logprobs=lp, entropy=ent, old_logprobs=old, advantages=torch.randn(n, generator=g), weights=weights,
                ref_logprobs=ref)


def assert_same(got, want, what):
    loss, g_lp, g_ent, sums = got
    rloss, rg_lp, rg_ent, rsums = want
    torch.testing.assert_close(loss, rloss, rtol=1e-5, atol=1e-5, msg=f"loss ({what})")
    torch.testing.assert_close(g_lp, rg_lp, rtol=1e-5, atol=1e-6, msg=f"grad logprobs ({what})")
    torch.testing.assert_close(g_ent, rg_ent, rtol=1e-5, atol=1e-6, msg=f"grad entropy ({what})")
    assert set(sums) == set(METRIC_SUM_KEYS)
    for k in METRIC_SUM_KEYS:
        torch.testing.assert_close(sums[k], rsums[k], rtol=1e-5, atol=1e-4, msg=f"{k} ({what})")
    assert torch.isfinite(g_lp).all() and torch.isfinite(g_ent).all()


CASES = list(itertools.product(
    [False, True],  # on-policy
    [None, "k1", "abs", "k2", "k3", "low_var_kl"],  # no reference, or its KL kind
    [None, 3.0],  # dual clip
    [0.0, 0.01],  # entropy coefficient
))


@pytest.mark.parametrize("on_policy,kl_kind,dual_clip,entropy_coef", CASES)
def test_token_loss_kernel_matches_the_reference(on_policy, kl_kind, dual_clip, entropy_coef):
    x = token_inputs(BLOCK + 237, seed=1, on_policy=on_policy, ties=True)
    if kl_kind is None:
        x["ref_logprobs"] = None
    kw = dict(clip_low=0.2, clip_high=0.28, dual_clip=dual_clip, kl_coef=0.1 if kl_kind else 0.0,
              kl_kind=kl_kind or "k3", entropy_coef=entropy_coef)
    assert_same(triton_policy_loss_from_token_stats(**x, **kw), policy_loss_from_token_stats(**x, **kw),
                f"on_policy={on_policy} kl={kl_kind} dual={dual_clip} ent={entropy_coef}")


LOSS_CASES = list(itertools.product(
    [("cispo", None), ("sapo", None), ("sapo", {"tau_pos": 0.6, "tau_neg": 1.7})],  # loss and its options
    [False, True],  # on-policy
    [None, "k3"],  # no reference, or k3
    [0.0, 0.01],  # entropy coefficient
))


@pytest.mark.parametrize("loss,on_policy,kl_kind,entropy_coef", LOSS_CASES)
def test_cispo_and_sapo_in_the_kernel_match_the_reference(loss, on_policy, kl_kind, entropy_coef):
    """The other token-level losses the kernel computes (LOSS_KIND). A dual clip is vanilla's: the others ignore it,
    unchecked, as the reference does; log-ratios past the clamp (spread 8) and exact ties included."""
    x = token_inputs(BLOCK + 237, seed=5, spread=8.0, on_policy=on_policy, ties=True)
    if kl_kind is None:
        x["ref_logprobs"] = None
    name, options = loss
    kw = dict(clip_low=0.2, clip_high=0.28, dual_clip=0.5, kl_coef=0.1 if kl_kind else 0.0, kl_kind=kl_kind or "k3",
              entropy_coef=entropy_coef, policy_loss=name, policy_loss_args=options)
    got = triton_policy_loss_from_token_stats(**x, **kw)
    assert_same(got, policy_loss_from_token_stats(**x, **kw), f"{loss} on_policy={on_policy} kl={kl_kind}")
    if name == "sapo":
        assert got[3]["clipped"] == 0  # a soft gate clips nothing
    elif not on_policy:
        assert got[3]["clipped"] > 0


def test_log_ratios_past_the_clamp_and_a_reference_kl_without_its_coefficient():
    # |lp - old| up to ~60: the ratio's clamp (20) cuts the gradient there, as autograd's clamp does.
    x = token_inputs(300, seed=2, spread=25.0)
    kw = dict(clip_low=0.1, clip_high=0.1, dual_clip=2.0, kl_coef=0.0, kl_kind="k3", entropy_coef=0.0)
    got = triton_policy_loss_from_token_stats(**x, **kw)
    assert_same(got, policy_loss_from_token_stats(**x, **kw), "wide log-ratios")
    assert got[3]["kl"] > 0  # the KL metric is summed with a zero coefficient too


@pytest.mark.parametrize("n", [0, 1, BLOCK, 2 * BLOCK + 1])
def test_sizes_around_the_block(n):
    x = token_inputs(n, seed=3)
    kw = dict(kl_coef=0.05, kl_kind="k2", entropy_coef=0.02)
    got = triton_policy_loss_from_token_stats(**x, **kw)
    assert got[1].shape == got[2].shape == (n,)
    assert_same(got, policy_loss_from_token_stats(**x, **kw), f"n={n}")


def test_every_token_masked_is_zero():
    x = token_inputs(50, seed=4)
    x["weights"] = torch.zeros(50)
    loss, g_lp, g_ent, sums = triton_policy_loss_from_token_stats(**x, kl_coef=0.1, entropy_coef=0.1)
    assert loss == 0 and not g_lp.any() and not g_ent.any() and all(v == 0 for v in sums.values())


def test_argument_errors_match_the_reference():
    x = token_inputs(8)
    for bad in (dict(kl_kind="k4", kl_coef=0.1), dict(dual_clip=1.0), dict(kl_coef=0.1, ref_logprobs=None),
                dict(policy_loss="sapo", policy_loss_args={"tau_pos": 0.0})):
        with pytest.raises(ValueError) as theirs:
            policy_loss_from_token_stats(**{**x, **bad})
        with pytest.raises(ValueError) as ours:
            triton_policy_loss_from_token_stats(**{**x, **bad})
        assert str(ours.value) == str(theirs.value), bad


def test_the_triton_backend_takes_the_kernel_for_the_losses_it_computes():
    for name in ("vanilla", "cispo", "sapo"):
        assert token_loss_function("triton", name) is triton_policy_loss_from_token_stats
        assert token_loss_function("torch", name) is policy_loss_from_token_stats
    assert token_loss_function("triton", "gspo") is policy_loss_from_token_stats  # whole sequences
    x = token_inputs(8)
    with pytest.raises(ValueError, match="fuses the vanilla, cispo, sapo policy losses, got 'gspo'"):
        triton_policy_loss_from_token_stats(**x, policy_loss="gspo")
    with pytest.raises(ValueError, match=r"the cispo policy loss takes no options, got \['tau_pos'\]"):
        triton_policy_loss_from_token_stats(**x, policy_loss="cispo", policy_loss_args={"tau_pos": 1.0})
