"""The kernels at the 151,936 vocabulary against fp64 references (``fastrlhf.algorithms`` run on float64
copies), forward and backward, fp32 and bf16, both backends: on CUDA the compiled Triton kernels (and
the chunked torch path) at a real LM head (H=1536, 1,024 tokens), on the CPU the same checks at a
handful of tokens (Triton under its interpreter).

Each case holds a -inf logit (a banned token) and a fully masked row."""

import pytest
import torch
from fastrlhf.kernels import fused_linear_logprob_entropy, fused_linear_policy_loss, fused_policy_loss, logprob_entropy

from fastrlhf import algorithms as A

V = 151_936
DTYPES = [torch.float32, torch.bfloat16]
BACKENDS = ["triton", "torch"]
LOSS = dict(clip_low=0.2, clip_high=0.28, kl_coef=0.05, kl_kind="k3", entropy_coef=0.01, agg="token-mean")


def sizes(where):
    """(tokens, hidden) of the case."""
    return (1024, 1536) if where == "cuda" else (5, 16)


def case(where, dtype, n, h=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    data = dict(labels=torch.randint(0, V, (n,), generator=g), old=-torch.rand(n, generator=g) * 6,
                ref=-torch.rand(n, generator=g) * 6, adv=torch.randn(n, generator=g),
                mask=(torch.rand(n, generator=g) > 0.2).float())
    data["mask"][0] = 0.0  # a fully masked row
    banned = (int(data["labels"][1]) + 1) % V  # never a label: its logit is -inf
    data["labels"][data["labels"] == banned] = (banned + 1) % V
    if h is None:
        logits = torch.randn(n, V, generator=g) * 3
        logits[:, banned] = float("-inf")
        data["logits"] = logits
    else:
        data["hidden"] = torch.randn(n, h, generator=g)
        data["weight"] = torch.randn(V, h, generator=g) * 2 / h**0.5
        data["bias"] = torch.zeros(V)
        data["bias"][banned] = float("-inf")
    return {k: v.to(where) for k, v in data.items()}, banned


def leaf(t, dtype):
    return t.detach().to(dtype).requires_grad_()


def close(actual, expected, dtype, what):
    """fp32 against fp64: 1e-4; bf16 inputs: the reference ran on the same rounded inputs, the kernel
    rounds its GEMM outputs to bf16 (as any bf16 LM head does), so 3e-2 of the largest value."""
    actual, expected = actual.double(), expected.double()
    finite = torch.isfinite(expected)
    assert torch.equal(torch.isfinite(actual), finite), f"{what}: finite where the reference is not"
    actual, expected = actual[finite], expected[finite]
    scale = max(expected.abs().max().item(), 1e-6) if expected.numel() else 1.0
    tol = (1e-4, 1e-4 * scale) if dtype == torch.float32 else (3e-2, 3e-2 * scale)
    torch.testing.assert_close(actual, expected, rtol=tol[0], atol=tol[1], msg=lambda m: f"{what}: {m}")


def grads(out, inputs):
    out.backward()
    return [t.grad for t in inputs]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprob_entropy_at_v151936(where, backend, dtype, temperature):
    d, _ = case(where, dtype, sizes(where)[0])
    logits = leaf(d["logits"], dtype)
    lp, ent = logprob_entropy(logits, d["labels"], temperature, backend=backend)
    g = torch.randn_like(lp)
    got = grads((lp * g).sum() + (ent * g.flip(0)).sum(), [logits])
    ref = leaf(logits.detach().double(), torch.float64)
    lp_ref, ent_ref = A.logprobs_from_logits(ref, d["labels"], temperature), A.entropy_from_logits(ref, temperature)
    want = grads((lp_ref * g.double()).sum() + (ent_ref * g.flip(0).double()).sum(), [ref])
    close(lp.detach(), lp_ref.detach(), dtype, "logprobs")
    close(ent.detach(), ent_ref.detach(), dtype, "entropy")
    close(got[0], want[0], dtype, "grad of the logits")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("kl_kind", ["k3", "k3+"])  # k3+: verl's straight-through kind, k2's gradient
def test_fused_policy_loss_at_v151936(where, backend, dtype, kl_kind):
    d, _ = case(where, dtype, sizes(where)[0])
    logits = leaf(d["logits"], dtype)
    loss, _ = fused_policy_loss(logits, d["labels"], d["old"], d["adv"], d["mask"], ref_logprobs=d["ref"],
                                temperature=0.7, backend=backend, **{**LOSS, "kl_kind": kl_kind})
    got = grads(loss, [logits])
    ref = leaf(logits.detach().double(), torch.float64)
    want_loss = reference_loss(ref, d, temperature=0.7, kl_kind=kl_kind)
    want = grads(want_loss, [ref])
    close(loss.detach(), want_loss.detach(), dtype, "loss")
    close(got[0], want[0], dtype, "grad of the logits")


# Triton's chunk step as one row kernel (the default: a program per row; or on CUDA a program per SM looping over
# rows) and as the three launches it replaces; torch has one path.
@pytest.mark.parametrize("backend,paths", [("triton", {}), ("triton", dict(row_programs_per_sm=1)),
                                           ("triton", dict(one_pass_rows=False)), ("torch", {})],
                         ids=["triton", "triton-program-per-sm", "triton-three-launches", "torch"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_fused_linear_paths_at_v151936(where, backend, paths, dtype):
    from fastrlhf.kernels.fused_linear_chunks import fused_linear_paths

    n, h = sizes(where)
    d, _ = case(where, dtype, n, h)
    hidden, weight, bias = (leaf(d[k], dtype) for k in ("hidden", "weight", "bias"))
    with fused_linear_paths(**paths):
        loss, _ = fused_linear_policy_loss(hidden, weight, d["labels"], d["old"], d["adv"], d["mask"],
                                           ref_logprobs=d["ref"], bias=bias, backend=backend, **LOSS)
    lp, ent = fused_linear_logprob_entropy(hidden, weight, d["labels"], bias=bias, backend=backend)
    g = torch.randn_like(lp)
    got = grads(loss + (lp * g).sum() + (ent * g.flip(0)).sum(), [hidden, weight, bias])

    # The reference reads the logits as the kernel makes them: the GEMM in the input dtype, then fp64.
    rh, rw, rb = (leaf(t.detach(), dtype) for t in (hidden, weight, bias))
    logits = (rh @ rw.t() + rb).double()
    lp_ref, ent_ref = A.logprobs_from_logits(logits, d["labels"]), A.entropy_from_logits(logits)
    loss_ref = reference_loss(logits, d, temperature=1.0)
    want = grads(loss_ref + (lp_ref * g.double()).sum() + (ent_ref * g.flip(0).double()).sum(), [rh, rw, rb])
    close(loss.detach(), loss_ref.detach(), dtype, "loss")
    close(lp.detach(), lp_ref.detach(), dtype, "logprobs")
    close(ent.detach(), ent_ref.detach(), dtype, "entropy")
    for name, a, e in zip(("hidden", "weight", "bias"), got, want, strict=True):
        close(a, e, dtype, f"grad of the {name}")


def reference_loss(logits, d, temperature, kl_kind=LOSS["kl_kind"]):
    """``fastrlhf.algorithms``' actor loss (policy term + KL - entropy bonus), aggregated by token mean."""
    lp = A.logprobs_from_logits(logits, d["labels"], temperature)
    ent = A.entropy_from_logits(logits, temperature)
    loss, _, _ = A.actor_loss_per_token(lp, ent, d["old"].double(), d["adv"].double(), d["mask"].double(),
                                        d["ref"].double(), policy_loss="vanilla", clip_low=LOSS["clip_low"],
                                        clip_high=LOSS["clip_high"], dual_clip=None, kl_coef=LOSS["kl_coef"],
                                        kl_kind=kl_kind, entropy_coef=LOSS["entropy_coef"])
    return A.aggregate_loss(loss, d["mask"].double(), "token-mean")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_grad_cast_at_the_head_shape(where, dtype):
    """The fused head's last backward pass (kernels/grad_cast_triton.py) on grad_weight's [V, H] fp32 sum: on CUDA
    the compiled kernel writes torch's mul bit for bit, rounded to nearest even; on the CPU the interpreter
    (whose bf16 conversion truncates) is checked within one ulp by tests/kernels/test_kernels_grad_cast.py, and
    here in fp16 exactly and in bf16 to bf16's precision."""
    from fastrlhf.kernels.fused_linear_chunks import scale_and_cast
    from fastrlhf.kernels.grad_cast_triton import scale_cast

    h = sizes(where)[1]
    g = torch.Generator().manual_seed(0)
    acc = (torch.randn(V, h, generator=g) * 1e-3).to(where)
    acc[0, :3] = torch.tensor([float("inf"), float("nan"), -0.0])
    grad_output = torch.tensor(-0.75, device=where)
    got = scale_cast(acc, grad_output, dtype)
    want = scale_and_cast(acc.clone(), grad_output, dtype)  # torch's mul into a `dtype` out: the reference
    if where == "cuda" or dtype == torch.float16:
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)
    else:
        torch.testing.assert_close(got.float(), want.float(), rtol=2.0**-7, atol=0, equal_nan=True)
