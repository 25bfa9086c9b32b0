"""Kernel benchmarks on CPU: naive PyTorch against the fused / chunked ops, time and peak memory.

Shape: N=4096 tokens, H=512, V=32768, fp32, forward + backward, torch backend, 2 threads. Each
variant runs in its own fresh child process (``benchmarks/memory.py``): peak resident memory above
a baseline taken after the inputs exist, over a warm-up and the timed runs; time is the fastest
timed run (the warm-up is excluded), reported with the median and the slowest run (``time_s_median``,
``time_s_max``, and the ratio of medians ``time_ratio_median`` beside the asserted ``time_ratio``).
Naive means what a user writes: materialise the logits, then ``log_softmax``, ``gather``, a
full-softmax entropy and the loss, and let autograd do the rest.

Targets (asserted: a miss fails ``make bench``):

====================================  ========================  ===============
op                                    peak extra memory         time
====================================  ========================  ===============
fused_linear_policy_loss              <= 1/8 of naive           <= 1.0x naive
fused_linear_logprob_entropy          <= 1/8 of naive           <= 1.4x naive
logprob_entropy (from logits)         <= 1/2 of naive           <= 1.0x naive
fused_policy_loss (from logits)       <= 1/2 of naive           <= 1.0x naive
====================================  ========================  ===============

From logits, the caller's ``[N, V]`` logits are an input (part of the baseline) and their
``[N, V]`` gradient is an output that both variants must allocate; the naive path adds its
log-softmax, probabilities and autograd's saved tensors on top.

What the Triton kernels cost on a GPU (``kernels/logprob_entropy_triton.py``), per token with vocabulary
V and logits of ``b`` bytes per element: the stats kernel reads the row once (``V*b`` bytes) and
writes 12 bytes (logprob, entropy, lse in fp32); the grad kernel reads the row once and writes the
gradient once (``2*V*b`` bytes). Forward + backward from logits therefore move ``3*V*b`` bytes per
token, against the naive path's many ``[N, V]`` fp32 round trips. At V=152k (Qwen's 151,936) in
bf16 that is 3 * 151,936 * 2 = 0.91 MB per token, so on an H100 (about 3 TB/s of HBM bandwidth)
the bound is about 0.30 us per token: 8192 tokens in at least ~2.5 ms (stats ~0.8 ms, grad
~1.7 ms). The fused-linear ops read no logits from memory at all (each chunk's logits are produced
by the GEMM and consumed while hot only if the chunk fits in L2; otherwise the same 3*V*b per
token, written once by the GEMM, applies), and are bound by the LM-head GEMMs: 3 (policy loss) or 4
(logprob + entropy, one recompute) GEMMs of 2*N*H*V flops each.
"""

from __future__ import annotations

import os

import pytest

N, H, V = 4096, 512, 32768
PARAMS = dict(n=N, h=H, v=V, seed=0)
THREADS = 2
REPEATS = 3
GIB = float(1 << 30)

# ---------------------------------------------------------------------------------------------
# Variants: each make_* allocates the inputs and returns step() = one forward + backward.
# They run inside the child process (imported from this file by path).
# ---------------------------------------------------------------------------------------------

POLICY_KW = dict(clip_low=0.2, clip_high=0.28, kl_coef=0.01, kl_kind="k3", entropy_coef=0.01, agg="token-mean")


def _inputs(n, h, v, seed, logits=False):
    import torch

    g = torch.Generator().manual_seed(seed)
    data = dict(
        hidden=torch.randn(n, h, generator=g).requires_grad_(),
        weight=(torch.randn(v, h, generator=g) * h**-0.5).requires_grad_(),
        labels=torch.randint(0, v, (n,), generator=g),
        grad_lp=torch.randn(n, generator=g),
        grad_ent=torch.randn(n, generator=g),
        old_logprobs=-torch.rand(n, generator=g) * 12,
        ref_logprobs=-torch.rand(n, generator=g) * 12,
        advantages=torch.randn(n, generator=g),
        mask=(torch.rand(n, generator=g) > 0.1).float(),
    )
    if logits:
        with torch.no_grad():
            data["logits"] = (data["hidden"] @ data["weight"].t()).requires_grad_()
        del data["hidden"], data["weight"]
    return data


def _naive_lp_ent(logits, labels):
    import torch

    logp = torch.log_softmax(logits, dim=-1)
    lp = logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    return lp, ent


def _naive_policy_loss(logits, d):
    from fastrlhf import algorithms as A

    lp, ent = _naive_lp_ent(logits, d["labels"])
    kw = POLICY_KW
    loss, _ = A.policy_loss(lp, d["old_logprobs"], d["advantages"], d["mask"], kw["clip_low"], kw["clip_high"],
                            agg=kw["agg"])
    kl = A.kl_penalty(lp, d["ref_logprobs"], kw["kl_kind"])
    loss = loss + kw["kl_coef"] * A.aggregate_loss(kl, d["mask"], kw["agg"])
    return loss - kw["entropy_coef"] * A.aggregate_loss(ent, d["mask"], kw["agg"])


def _clear(*tensors):
    for t in tensors:
        t.grad = None


def make_naive_linear_logprob_entropy(**p):
    d = _inputs(**p)

    def step():
        lp, ent = _naive_lp_ent(d["hidden"] @ d["weight"].t(), d["labels"])
        (lp * d["grad_lp"] + ent * d["grad_ent"]).sum().backward()
        _clear(d["hidden"], d["weight"])

    return step


def make_fused_linear_logprob_entropy(**p):
    from fastrlhf.kernels import fused_linear_logprob_entropy

    chunk_size = p.pop("chunk_size", None)
    d = _inputs(**p)

    def step():
        lp, ent = fused_linear_logprob_entropy(d["hidden"], d["weight"], d["labels"], chunk_size=chunk_size,
                                               backend="torch")
        (lp * d["grad_lp"] + ent * d["grad_ent"]).sum().backward()
        _clear(d["hidden"], d["weight"])

    return step


def make_naive_linear_policy_loss(**p):
    d = _inputs(**p)

    def step():
        _naive_policy_loss(d["hidden"] @ d["weight"].t(), d).backward()
        _clear(d["hidden"], d["weight"])

    return step


def make_fused_linear_policy_loss(**p):
    from fastrlhf.kernels import fused_linear_policy_loss

    chunk_size = p.pop("chunk_size", None)
    d = _inputs(**p)

    def step():
        loss, _ = fused_linear_policy_loss(
            d["hidden"], d["weight"], d["labels"], d["old_logprobs"], d["advantages"], d["mask"],
            ref_logprobs=d["ref_logprobs"], chunk_size=chunk_size, backend="torch", **POLICY_KW,
        )
        loss.backward()
        _clear(d["hidden"], d["weight"])

    return step


def make_naive_logprob_entropy(**p):
    d = _inputs(**p, logits=True)

    def step():
        lp, ent = _naive_lp_ent(d["logits"], d["labels"])
        (lp * d["grad_lp"] + ent * d["grad_ent"]).sum().backward()
        _clear(d["logits"])

    return step


def make_logprob_entropy(**p):
    from fastrlhf.kernels import logprob_entropy

    d = _inputs(**p, logits=True)

    def step():
        lp, ent = logprob_entropy(d["logits"], d["labels"], backend="torch")
        (lp * d["grad_lp"] + ent * d["grad_ent"]).sum().backward()
        _clear(d["logits"])

    return step


def make_naive_policy_loss(**p):
    d = _inputs(**p, logits=True)

    def step():
        _naive_policy_loss(d["logits"], d).backward()
        _clear(d["logits"])

    return step


def make_fused_policy_loss(**p):
    from fastrlhf.kernels import fused_policy_loss

    d = _inputs(**p, logits=True)

    def step():
        loss, _ = fused_policy_loss(d["logits"], d["labels"], d["old_logprobs"], d["advantages"], d["mask"],
                                    ref_logprobs=d["ref_logprobs"], backend="torch", **POLICY_KW)
        loss.backward()
        _clear(d["logits"])

    return step


# ---------------------------------------------------------------------------------------------
# Benchmarks
# ---------------------------------------------------------------------------------------------

_results: dict[str, dict] = {}


def _run(name: str) -> dict:
    # Imported here, not at the top: the child process loads this file by path, outside the package.
    from benchmarks.memory import measure

    if name not in _results:
        _results[name] = measure(os.path.abspath(__file__), f"make_{name}", PARAMS, threads=THREADS, repeats=REPEATS)
    return _results[name]


def _record(benchmark, name: str, naive: str | None = None) -> dict:
    """Measure ``name`` (one child process, wrapped by pytest-benchmark) and record its figures."""
    _results.pop(name, None)
    result = benchmark.pedantic(_run, args=(name,), rounds=1, iterations=1, warmup_rounds=0)
    info = benchmark.extra_info
    info.update(time_s=round(result["time_s"], 4), time_s_median=round(result["time_s_median"], 4),
                time_s_max=round(result["time_s_max"], 4), peak_extra_gib=round(result["peak_extra_bytes"] / GIB, 4),
                threads=result["threads"], shape=f"N={N} H={H} V={V} fp32")
    if naive is not None:
        base = _run(naive)
        result["time_ratio"] = result["time_s"] / base["time_s"]
        result["memory_ratio"] = result["peak_extra_bytes"] / max(1, base["peak_extra_bytes"])
        info.update(vs=naive, time_ratio=round(result["time_ratio"], 3), memory_ratio=round(result["memory_ratio"], 4),
                    time_ratio_median=round(result["time_s_median"] / base["time_s_median"], 3))
    return result


def _check(result, max_time_ratio, max_memory_ratio):
    assert result["memory_ratio"] <= max_memory_ratio, (
        f"peak extra memory is {result['memory_ratio']:.3f} of naive; the target is <= {max_memory_ratio:.3f}"
    )
    assert result["time_ratio"] <= max_time_ratio, (
        f"time is {result['time_ratio']:.3f}x naive; the target is <= {max_time_ratio:.2f}x"
    )


@pytest.mark.parametrize("name", ["naive_linear_policy_loss", "naive_linear_logprob_entropy",
                                  "naive_policy_loss", "naive_logprob_entropy"])
def test_naive(benchmark, name):
    _record(benchmark, name)


def test_fused_linear_policy_loss(benchmark):
    _check(_record(benchmark, "fused_linear_policy_loss", "naive_linear_policy_loss"), 1.0, 1 / 8)


def test_fused_linear_logprob_entropy(benchmark):
    _check(_record(benchmark, "fused_linear_logprob_entropy", "naive_linear_logprob_entropy"), 1.4, 1 / 8)


def test_fused_policy_loss(benchmark):
    _check(_record(benchmark, "fused_policy_loss", "naive_policy_loss"), 1.0, 1 / 2)


def test_logprob_entropy(benchmark):
    _check(_record(benchmark, "logprob_entropy", "naive_logprob_entropy"), 1.0, 1 / 2)
