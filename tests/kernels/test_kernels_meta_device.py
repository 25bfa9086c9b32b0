"""No host syncs in the kernels off the CPU, proven on ``device="meta"``; and the per-device chunk budget.

A meta tensor has a shape, a dtype and a device but no data: every op runs through its shape
rules, while reading a value into Python (``.item()``, ``.tolist()``, ``bool(t)``, ``float(t)``,
``if t``) raises. So a kernel call that completes on meta tensors, forward and backward, reads no
value on the host, which on a GPU would stall the host until the device drains its queue.
The torch backend stands in for Triton here (Triton cannot run on meta tensors); the chunk loops
around the primitives are the same code for both backends.

``pytest -k meta_device`` selects this file.
"""

import importlib

import pytest
import torch
from fastrlhf.kernels import fused_linear_logprob_entropy, fused_linear_policy_loss, fused_policy_loss, logprob_entropy
from fastrlhf.kernels.fused_linear import (
    CPU_CHUNK_BYTES,
    DEFAULT_CHUNK_BYTES,
    GPU_CHUNK_BYTES,
    MIN_CHUNK_TOKENS,
    MIN_CHUNK_TOKENS_GPU,
    call_chunk_size,
    default_chunk_size,
)

backend_module = importlib.import_module("fastrlhf.kernels._backend")
fl_module = importlib.import_module("fastrlhf.kernels.fused_linear")
checks_module = importlib.import_module("fastrlhf.kernels._checks")
le_torch_module = importlib.import_module("fastrlhf.kernels.logprob_entropy_torch")
pl_module = importlib.import_module("fastrlhf.kernels.policy_loss")

META = torch.device("meta")
QWEN_VOCAB = 151936
DTYPES = [torch.float32, torch.bfloat16]


def meta_head(shape, h, v, dtype, bias=True):
    """hidden ``shape + [h]``, weight ``[v, h]`` and bias ``[v]`` (leaves), labels of ``shape``: all on meta."""
    hidden = torch.empty(*shape, h, dtype=dtype, device=META, requires_grad=True)
    weight = torch.empty(v, h, dtype=dtype, device=META, requires_grad=True)
    b = torch.empty(v, dtype=dtype, device=META, requires_grad=True) if bias else None
    labels = torch.empty(shape, dtype=torch.long, device=META)
    return hidden, weight, b, labels


def per_token(shape):
    return torch.empty(shape, dtype=torch.float32, device=META)


def assert_meta(t, shape, dtype):
    assert t.device == META and tuple(t.shape) == tuple(shape) and t.dtype == dtype


def assert_grads_meta(*leaves):
    for t in leaves:
        assert t.grad is not None
        assert_meta(t.grad, t.shape, t.dtype)


def count_calls(monkeypatch, module, name):
    """Wrap ``module.name`` so that every call is counted; returns the list the calls land in."""
    calls = []
    original = getattr(module, name)

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


def run_policy_loss(hidden, weight, b, labels, chunk_size=None, **kw):
    shape = labels.shape
    return fused_linear_policy_loss(
        hidden, weight, labels, per_token(shape), per_token(shape), per_token(shape), ref_logprobs=per_token(shape),
        clip_low=0.2, clip_high=0.28, dual_clip=3.0, kl_coef=0.1, entropy_coef=0.01, temperature=0.9,
        agg="seq-mean-token-mean" if len(shape) == 2 else "token-mean", bias=b, chunk_size=chunk_size,
        backend="torch", **kw,
    )


# ----------------------------------------------------------------------------------------------
# Every entry point, forward and backward, on meta tensors
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_linear_policy_loss_meta_device_forward_backward(monkeypatch, dtype):
    # 4 x 10 tokens in chunks of 8: five chunks, the last one short. A meta mask holds no values,
    # so "fully masked" cannot be told apart here, and that is the point: off the CPU nothing may
    # read the mask to skip a chunk, so all five run (test_off_cpu_branches_match_the_cpu_path
    # checks on real values that a fully masked chunk then adds nothing).
    gemms = count_calls(monkeypatch, fl_module, "_logits_into")
    hidden, weight, b, labels = meta_head((4, 10), 16, 300, dtype)
    loss, metrics = run_policy_loss(hidden, weight, b, labels, chunk_size=8)
    assert_meta(loss, (), torch.float32)
    assert set(metrics) == {"clipfrac", "approx_kl", "entropy", "kl"}
    for m in metrics.values():
        assert_meta(m, (), torch.float32)
    (2.5 * loss).backward()
    assert_grads_meta(hidden, weight, b)
    assert len(gemms) == 5


@pytest.mark.parametrize("name, options", [("cispo", None), ("sapo", {"tau_pos": 0.8, "tau_neg": 1.3})])
def test_registered_token_level_losses_meta_device_forward_backward(name, options):
    # The losses other than vanilla run as torch per-token math in the chunk loop, on every device.
    hidden, weight, b, labels = meta_head((3, 7), 16, 300, torch.bfloat16)
    loss, _ = run_policy_loss(hidden, weight, b, labels, chunk_size=8, policy_loss=name, policy_loss_args=options)
    loss.backward()
    assert_meta(loss, (), torch.float32)
    assert_grads_meta(hidden, weight, b)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_linear_policy_loss_meta_device_on_policy_no_bias_token_mean(dtype):
    hidden, weight, _, labels = meta_head((40,), 8, 97, dtype, bias=False)
    loss, _ = fused_linear_policy_loss(hidden, weight, labels, None, per_token(40), per_token(40), chunk_size=16,
                                       entropy_coef=0.05, backend="torch")
    loss.backward()
    assert_grads_meta(hidden, weight)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("temperature", [1.0, 0.8])
def test_fused_linear_logprob_entropy_meta_device_forward_backward(dtype, temperature):
    hidden, weight, b, labels = meta_head((3, 10), 16, 257, dtype)
    lp, ent = fused_linear_logprob_entropy(hidden, weight, labels, bias=b, temperature=temperature, chunk_size=7,
                                           backend="torch")
    for t in (lp, ent):
        assert_meta(t, (3, 10), torch.float32)
    g_lp, g_ent = per_token((3, 10)), per_token((3, 10))
    ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
    assert_grads_meta(hidden, weight, b)


def test_fp32_logits_of_a_bf16_head_meta_device_forward_backward(monkeypatch):
    """``fp32_logits``: the fp32-output GEMM (meta has CUDA's, so its branch runs here), the fp32 chunk and its
    gradient rounded to bf16 for the head's GEMMs, in both ops: no host read."""
    gemms = count_calls(monkeypatch, fl_module, "_logits_into")
    hidden, weight, b, labels = meta_head((3, 10), 16, 257, torch.bfloat16)
    lp, ent = fused_linear_logprob_entropy(hidden, weight, labels, bias=b, chunk_size=7, backend="torch",
                                           fp32_logits=True)
    (lp.sum() + ent.sum()).backward()
    assert_grads_meta(hidden, weight, b)
    hidden, weight, b, labels = meta_head((4, 10), 16, 300, torch.bfloat16)
    loss, _ = run_policy_loss(hidden, weight, b, labels, chunk_size=8, fp32_logits=True)
    loss.backward()
    assert_grads_meta(hidden, weight, b)
    assert len(gemms) == 5 + 5 + 5  # forward and recompute of 5 chunks, then the loss's 5


def test_fused_linear_logprob_entropy_meta_device_one_output_used():
    hidden, weight, _, labels = meta_head((20,), 8, 50, torch.bfloat16, bias=False)
    _, ent = fused_linear_logprob_entropy(hidden, weight, labels, chunk_size=6, backend="torch")
    ent.sum().backward()
    assert_grads_meta(hidden, weight)


@pytest.mark.parametrize("dtype", DTYPES)
def test_logprob_entropy_meta_device_forward_backward(monkeypatch, dtype):
    # A [B, T, V] slice (one block per sequence) in several torch-path row chunks of its own.
    monkeypatch.setattr(backend_module, "GPU_CHUNK_BYTES", 4 * 3 * 130)
    logits = torch.empty(2, 9, 130, dtype=dtype, device=META, requires_grad=True)
    labels = torch.empty(2, 8, dtype=torch.long, device=META)
    lp, ent = logprob_entropy(logits[:, :-1], labels, temperature=1.3, backend="torch")
    for t in (lp, ent):
        assert_meta(t, (2, 8), torch.float32)
    (lp.sum() + 0.5 * ent.sum()).backward()
    assert_grads_meta(logits)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_policy_loss_meta_device_forward_backward(monkeypatch, dtype):
    monkeypatch.setattr(backend_module, "GPU_CHUNK_BYTES", 4 * 4 * 101)
    logits = torch.empty(3, 7, 101, dtype=dtype, device=META, requires_grad=True)
    labels = torch.empty(3, 6, dtype=torch.long, device=META)
    shape = labels.shape
    loss, metrics = fused_policy_loss(logits[:, :-1], labels, per_token(shape), per_token(shape), per_token(shape),
                                      per_token(shape), dual_clip=3.0, kl_coef=0.1, entropy_coef=0.01,
                                      temperature=0.9, agg="seq-mean-token-sum", backend="torch")
    assert_meta(loss, (), torch.float32)
    for m in metrics.values():
        assert_meta(m, (), torch.float32)
    (3.0 * loss).backward()
    assert_grads_meta(logits)


def test_policy_loss_from_token_stats_meta_device():
    vecs = [per_token(10) for _ in range(6)]
    loss, g_lp, g_ent, sums = pl_module.policy_loss_from_token_stats(*vecs, dual_clip=3.0, kl_coef=0.1,
                                                                    entropy_coef=0.01)
    assert_meta(loss, (), torch.float32)
    assert_meta(g_lp, (10,), torch.float32)
    assert_meta(g_ent, (10,), torch.float32)
    for m in pl_module.finalize_metrics(sums).values():
        assert_meta(m, (), torch.float32)


# ----------------------------------------------------------------------------------------------
# The meta check has teeth
# ----------------------------------------------------------------------------------------------


def test_meta_device_catches_a_sync_in_the_chunk_loop(monkeypatch):
    """A value read slipped into the chunk loop makes the meta run fail: the tests above can fail."""
    original = fl_module._logits_into

    def logits_into_then_read(*args):
        logits = original(*args)
        logits.max().item()  # the kind of data-dependent read the kernels must not make
        return logits

    monkeypatch.setattr(fl_module, "_logits_into", logits_into_then_read)
    hidden, weight, b, labels = meta_head((12,), 8, 40, torch.float32)
    with pytest.raises(RuntimeError, match="meta"):
        run_policy_loss(hidden, weight, b, labels, chunk_size=4)


@pytest.mark.parametrize("entry", ["fused_linear_policy_loss", "fused_policy_loss"])
def test_meta_device_catches_the_cpu_shortcuts_when_ungated(monkeypatch, entry):
    """Treating meta as the CPU turns the CPU-only shortcuts (masked-chunk skip, isfinite repair,
    label range ValueError, grad_output == 1 check) back on, and the meta run fails: the device
    gates are what keep the other devices free of syncs."""
    for module in (backend_module, checks_module, fl_module, le_torch_module, pl_module):
        monkeypatch.setattr(module, "on_cpu", lambda where: True)
    with pytest.raises(RuntimeError, match="meta"):
        if entry == "fused_linear_policy_loss":
            run_policy_loss(*meta_head((12,), 8, 40, torch.float32), chunk_size=4)
        else:
            logits = torch.empty(12, 40, device=META, requires_grad=True)
            labels = torch.empty(12, dtype=torch.long, device=META)
            fused_policy_loss(logits, labels, per_token(12), per_token(12), per_token(12), backend="torch")


def test_meta_device_isfinite_shortcut_is_a_host_read():
    z = torch.empty(3, 10, device=META)
    p = torch.empty(3, 10, device=META)
    with pytest.raises(RuntimeError, match="meta"):
        le_torch_module._products_and_dot(z, p, host_reads=True)
    pz, dot = le_torch_module._products_and_dot(z, p, host_reads=False)
    assert_meta(pz, (3, 10), torch.float32)
    assert_meta(dot, (3,), torch.float32)


# ----------------------------------------------------------------------------------------------
# The off-CPU branches compute the same numbers (run on CPU tensors by lifting the CPU gates)
# ----------------------------------------------------------------------------------------------


def lift_cpu_gates(monkeypatch):
    for module in (backend_module, checks_module, fl_module, le_torch_module, pl_module):
        monkeypatch.setattr(module, "on_cpu", lambda where: False)


def cpu_case(dtype, seed=0, n=24, h=12, v=90):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g).to(dtype)
    weight = (torch.randn(v, h, generator=g) / h**0.5).to(dtype)
    bias = torch.randn(v, generator=g).to(dtype)
    bias[7] = float("-inf")  # a banned token: p = 0, the isfinite repair on CPU, the floor elsewhere
    labels = torch.randint(0, v, (n,), generator=g)
    labels[labels == 7] = 8
    data = [-torch.rand(n, generator=g) * 5, torch.randn(n, generator=g), (torch.rand(n, generator=g) > 0.3).float(),
            -torch.rand(n, generator=g) * 5]
    data[2][8:16] = 0.0  # one fully masked chunk of 8
    return hidden, weight, bias, labels, data


def policy_loss_and_grads(dtype):
    hidden, weight, bias, labels, (old, adv, mask, ref) = cpu_case(dtype)
    leaves = [t.requires_grad_() for t in (hidden, weight, bias)]
    loss, metrics = fused_linear_policy_loss(hidden, weight, labels, old, adv, mask, ref_logprobs=ref, kl_coef=0.1,
                                             entropy_coef=0.02, temperature=0.9, bias=bias, chunk_size=8,
                                             backend="torch")
    (0.5 * loss).backward()
    logits = (hidden @ weight.t() + bias).detach().requires_grad_()
    loss2, _ = fused_policy_loss(logits, labels, old, adv, mask, ref, kl_coef=0.1, entropy_coef=0.02, backend="torch")
    (2.0 * loss2).backward()
    lp, ent = logprob_entropy(logits.detach().requires_grad_(), labels, 1.1, backend="torch")
    return [loss, *metrics.values(), loss2, lp, ent, logits.grad] + [t.grad for t in leaves]


@pytest.mark.parametrize("dtype", DTYPES)
def test_off_cpu_branches_match_the_cpu_path(monkeypatch, dtype):
    want = policy_loss_and_grads(dtype)
    lift_cpu_gates(monkeypatch)
    got = policy_loss_and_grads(dtype)
    for a, e in zip(got, want, strict=True):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, e, rtol=0, atol=0)


def test_off_cpu_label_check_is_a_device_assert(monkeypatch):
    """Off the CPU an out-of-range label trips torch._assert_async (synchronous on CPU tensors)."""
    lift_cpu_gates(monkeypatch)
    with pytest.raises(RuntimeError, match=r"labels must lie in \[0, 40\)"):
        fused_linear_logprob_entropy(torch.randn(3, 8), torch.randn(40, 8), torch.tensor([0, 40, 1]), chunk_size=2,
                                     backend="torch")


# ----------------------------------------------------------------------------------------------
# Chunk budget per device
# ----------------------------------------------------------------------------------------------


def test_cpu_chunk_budget_keeps_the_old_sizes():
    assert CPU_CHUNK_BYTES == DEFAULT_CHUNK_BYTES == 64 << 20
    for device in (None, "cpu", torch.device("cpu")):
        assert default_chunk_size(4096, 32768, device=device) == 512
        assert default_chunk_size(4096, QWEN_VOCAB, device=device) == 104
    assert default_chunk_size(4096, 10**9) == MIN_CHUNK_TOKENS


def test_gpu_chunk_budget_with_plenty_of_free_memory():
    budget = backend_module.chunk_budget_bytes("cuda", free_bytes=70 << 30)
    assert budget == GPU_CHUNK_BYTES
    rows = default_chunk_size(16384, QWEN_VOCAB, budget, device="cuda")
    assert rows >= 1000 and rows % 64 == 0 and rows * QWEN_VOCAB * 4 <= GPU_CHUNK_BYTES
    # meta: no free-memory query (it would need a CUDA device), the plain GPU budget
    assert default_chunk_size(16384, QWEN_VOCAB, device=META) == rows


def test_gpu_chunk_budget_is_capped_by_free_memory(monkeypatch):
    little = 800 << 20
    assert backend_module.chunk_budget_bytes("cuda", free_bytes=little) == little // 4
    monkeypatch.setattr(backend_module, "free_device_bytes", lambda device: little)
    rows = default_chunk_size(16384, 32768, device="cuda:0")
    fit = (little // 4) // (4 * 32768) // 64 * 64  # 1,600 tokens fill the capped budget: 11 balanced chunks
    assert rows == 1536 and rows <= fit < GPU_CHUNK_BYTES // (4 * 32768) and -(-16384 // rows) == -(-16384 // fit)
    # ... but never below the GEMM-efficiency floor of an accelerator
    assert default_chunk_size(16384, QWEN_VOCAB, device="cuda:0") == MIN_CHUNK_TOKENS_GPU
    assert default_chunk_size(100, QWEN_VOCAB, device="cuda:0") == 100  # nor above N


def test_free_memory_is_not_queried_for_cpu_or_meta(monkeypatch):
    def boom(device):
        raise AssertionError(f"free memory queried for {device}")

    monkeypatch.setattr(torch.cuda, "mem_get_info", boom)
    assert backend_module.free_device_bytes(META) is None
    assert backend_module.chunk_budget_bytes(META) == GPU_CHUNK_BYTES
    assert backend_module.chunk_budget_bytes("cpu") == CPU_CHUNK_BYTES


def test_chunk_bytes_and_chunk_size_override_the_budget(monkeypatch):
    assert default_chunk_size(4096, 1000, 4 * 1000 * 40) == 40
    assert default_chunk_size(4096, 1000, 4 * 1000 * 700, device=META) == 640
    gemms = count_calls(monkeypatch, fl_module, "_logits_into")
    hidden, weight, b, labels = meta_head((2000,), 8, 1000, torch.float32)
    fused_linear_logprob_entropy(hidden, weight, labels, bias=b, backend="torch", chunk_bytes=4 * 1000 * 700)
    assert len(gemms) == 4  # 640 tokens a chunk
    gemms.clear()
    fused_linear_logprob_entropy(hidden, weight, labels, bias=b, backend="torch", chunk_bytes=4 * 1000 * 700,
                                 chunk_size=1000)
    assert len(gemms) == 2  # chunk_size wins
    gemms.clear()
    # On the CPU (real tensors): chunk_bytes of 50 tokens' logits gives chunks of 48.
    x, w, y = torch.randn(100, 4), torch.randn(30, 4), torch.randint(0, 30, (100,))
    lp, _ = fused_linear_logprob_entropy(x, w, y, backend="torch", chunk_bytes=4 * 30 * 50)
    assert len(gemms) == 3
    torch.testing.assert_close(lp, fused_linear_logprob_entropy(x, w, y, backend="torch", chunk_size=100)[0])
    with pytest.raises(ValueError, match="chunk_bytes must be a positive int"):
        fused_linear_logprob_entropy(x, w, y, chunk_bytes=0)


def test_a_head_whose_gemms_sum_its_gradient_in_fp32_takes_longer_chunks(monkeypatch):
    """Where the head's fp32 gradient sums inside its GEMMs (meta stands for CUDA here), the [V, H] bf16 scratch
    is not allocated, and the chunk budget grows by it: the 7B head's 16,384 tokens take five chunks of 3,328
    instead of ten of 1,664, at no more memory. Not where that scratch never existed (no gradient, an fp32
    head, the CPU) nor where the caller set the budget."""
    v, h, n = 152_064, 3_584, 16_384
    hidden, weight, b, labels = meta_head((n,), h, v, torch.bfloat16)
    plain = default_chunk_size(n, v, device=META)
    assert plain == 1664 and call_chunk_size(n, weight) == 3328
    with torch.no_grad():
        assert call_chunk_size(n, weight) == plain  # no gradient: no scratch to spare
    assert call_chunk_size(n, weight.detach()) == plain
    assert call_chunk_size(n, weight.detach().float().requires_grad_()) == plain  # fp32: addmm_, no scratch
    assert call_chunk_size(n, weight, chunk_bytes=GPU_CHUNK_BYTES) == plain  # the caller's budget stands
    cpu_weight = torch.empty(v, h, dtype=torch.bfloat16, requires_grad=True)
    assert call_chunk_size(n, cpu_weight) == default_chunk_size(n, v)  # the CPU keeps its scratch
    gemms = count_calls(monkeypatch, fl_module, "_logits_into")
    loss, _ = run_policy_loss(hidden, weight, b, labels)
    assert len(gemms) == 5


@pytest.mark.parametrize("op", ["policy_loss", "logprob_entropy"])
def test_meta_device_16k_tokens_at_qwen_vocab_is_a_few_chunks(monkeypatch, op):
    """A 16k-token micro-batch at V=152k: ten GEMMs per pass on an accelerator (CPU budget: 158),
    and the torch path does not split a fused chunk further (one softmax pass per chunk)."""
    n = 16384
    rows = default_chunk_size(n, QWEN_VOCAB, device=META)
    expected = -(-n // rows)
    assert expected <= 16 and -(-n // default_chunk_size(n, QWEN_VOCAB)) > 150
    gemms = count_calls(monkeypatch, fl_module, "_logits_into")
    passes = count_calls(monkeypatch, le_torch_module, "_products_and_dot")
    hidden, weight, b, labels = meta_head((n,), 8, QWEN_VOCAB, torch.bfloat16)
    if op == "policy_loss":
        loss, _ = run_policy_loss(hidden, weight, b, labels)
        assert len(gemms) == len(passes) == expected
        loss.backward()
        assert len(gemms) == expected  # gradients were made in forward
    else:
        lp, ent = fused_linear_logprob_entropy(hidden, weight, labels, bias=b, backend="torch")
        assert len(gemms) == len(passes) == expected
        (lp.sum() + ent.sum()).backward()
        assert len(gemms) == 2 * expected  # backward recomputes each chunk's logits once
    assert_grads_meta(hidden, weight, b)
