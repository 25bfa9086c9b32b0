"""Audit of the sequence layouts (packing, packed attention, masks, the RL forward pass): what the other tests in
tests/sequences/ leave open.

* ``model.attention`` follows the dtype the forward passes compute in, not the weights' dtype: fp32 weights under
  ``deepspeed.bf16`` run bf16 (DeepSpeed casts the module; the reference and reward models load in it), where
  flash-attn's varlen kernel runs;
* packed, shared-prompt and token-budget micro-batches give the padded logprobs and entropies at a temperature
  other than 1, fused and unfused, for Llama and Qwen2, with GRPO groups of one (n = 1) whose prompts differ in
  length, empty completions and sequences longer than the budget;
* flash-attn's varlen kernel gets what its CUDA code requires (half dtype, unit last stride, int32 contiguous
  cu_seqlens on the device, an int max_seqlen) from a bf16 GQA model;
* HF generate's unpadded prefill (position ids, no mask) reads the positions once per layer, not once per row;
* the shared-prompt block mask costs the host O(N + tiles^2), not O(N x tiles).
"""

import itertools

import pytest
import torch
from helpers.model_folders import fake_model_folder

from fastrlhf.config import ConfigError, parse_config
from fastrlhf.modeling import use_attention
from fastrlhf.modeling.tiny import make_tiny_llama, make_tiny_qwen2
from fastrlhf.rl.experience import build_experience
from fastrlhf.rl.forward import sequence_logprobs
from fastrlhf.rollout import Completion
from fastrlhf.sequences import attention
from fastrlhf.sequences.packing import token_budget_groups

VOCAB = 97
PAD = 2

# ----------------------------------------------------------------------------------------------
# The attention backend follows the compute dtype
# ----------------------------------------------------------------------------------------------


def train_config(tmp_path, dtype="float32", bf16=True, **model):
    fake_model_folder(tmp_path / "model")
    (tmp_path / "prompts.jsonl").write_text('{"prompt_ids": [1, 2]}\n')
    return {"algorithm": "grpo", "output_dir": str(tmp_path / "out"),
            "model": {"path": str(tmp_path / "model"), "dtype": dtype, **model}, "reward": {"function": "length"},
            "data": {"prompts": str(tmp_path / "prompts.jsonl")}, "rollout": {"n": 4},
            "trainer": {"max_steps": 2, "prompts_per_step": 4, "minibatch_size": 8, "packing": True},
            "deepspeed": {"bf16": bf16}}


def test_flash_attention_follows_the_compute_dtype_not_the_weights(tmp_path, monkeypatch):
    """fp32 weights with deepspeed.bf16 compute in bf16: auto takes flash-attn and an explicit choice of it is
    kept (it was flex, and a config error saying the run is float32)."""
    monkeypatch.setattr(attention, "_flash_attn_installed", lambda: True)
    assert parse_config(train_config(tmp_path), on_gpu=True).model.attention == "flash_attention_2"
    explicit = parse_config(train_config(tmp_path, attention="flash_attention_2"), on_gpu=True)
    assert explicit.model.attention == "flash_attention_2"
    # fp32 compute (no DeepSpeed bf16): flex, and flash-attn is refused naming the field.
    assert parse_config(train_config(tmp_path, bf16=False), on_gpu=True).model.attention == "flex"
    with pytest.raises(ConfigError, match="model.attention.*compute.*float32"):
        parse_config(train_config(tmp_path, bf16=False, attention="flash_attention_2"), on_gpu=True)


# ----------------------------------------------------------------------------------------------
# Every layout at a temperature, fused and unfused
# ----------------------------------------------------------------------------------------------


def ragged(lengths):
    """Prompts of 1, 6, 2 and 3 tokens with completions of ``lengths`` (0: empty)."""
    g = torch.Generator().manual_seed(0)
    prompts = [[5], [6, 7, 8, 9, 10, 11], [12, 13], [14, 15, 16]]
    completions = [[Completion(torch.randint(3, VOCAB, (n,), generator=g).tolist(), [-1.0] * n, "stop")
                    for n in row] for row in lengths]
    return build_experience(prompts, completions, PAD)


@pytest.mark.parametrize("family,lengths", [("llama", [[0, 1, 3], [2, 0, 7], [1, 1, 1], [5, 0, 2]]),
                                            ("qwen2", [[0], [7], [1], [5]])], ids=["llama-n3", "qwen2-n1"])
def test_every_layout_gives_the_padded_logprobs_at_a_temperature(family, lengths):
    make = make_tiny_llama if family == "llama" else make_tiny_qwen2
    model = make(vocab_size=VOCAB, hidden_size=64, num_heads=2, num_layers=2)
    use_attention(model, True, True, "sdpa")
    exp = ragged(lengths)
    parts = exp.token_parts()
    want = sequence_logprobs(model, exp, temperature=0.7, micro_batch=exp.batch_size, fused=False)
    # A budget of 5 tokens: the longest sequences are alone in their micro-batch, some packs are exactly full.
    for mode, fused in itertools.product([False, True, "shared"], [True, False]):
        keys = exp.prompt_keys() if mode == "shared" else None
        groups = token_budget_groups(parts, 5, bool(mode), keys=keys) if mode else None
        got = sequence_logprobs(model, exp, temperature=0.7, micro_batch=2, groups=groups, packed=mode, fused=fused)
        for name, a, b in zip(("logprobs", "entropy"), got, want, strict=True):
            what = f"{mode} {fused} {name}"
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda m, what=what: f"{what}: {m}")


# ----------------------------------------------------------------------------------------------
# What flash-attn's varlen kernel requires
# ----------------------------------------------------------------------------------------------


def strict_varlen(calls):
    """A stand-in for ``flash_attn.flash_attn_varlen_func`` that refuses what its CUDA kernel refuses
    (``mha_varlen_fwd``: half dtypes, one dtype and device for all, a unit last stride, int32 contiguous
    ``cu_seqlens``, whole heads of K/V per query group), then computes causal sdpa per sequence."""

    def varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal):
        assert q.dtype in (torch.bfloat16, torch.float16) and k.dtype == v.dtype == q.dtype, (q.dtype, k.dtype)
        assert all(t.dim() == 3 and t.stride(-1) == 1 for t in (q, k, v)), [t.stride() for t in (q, k, v)]
        assert q.shape[1] % k.shape[1] == 0 and k.shape == v.shape and q.shape[0] == k.shape[0]
        for cu in (cu_seqlens_q, cu_seqlens_k):
            assert cu.dtype == torch.int32 and cu.is_contiguous() and cu.device == q.device
        bounds = cu_seqlens_q.tolist()  # the stand-in's own read: the kernel reads them on the device
        assert bounds[0] == 0 and bounds[-1] == q.shape[0]
        assert type(max_seqlen_q) is int and max_seqlen_q == max(b - a for a, b in itertools.pairwise(bounds))
        calls.append(bounds)
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
        return torch.cat([torch.nn.functional.scaled_dot_product_attention(
            q[s:e].transpose(0, 1), k[s:e].transpose(0, 1), v[s:e].transpose(0, 1), is_causal=causal,
            scale=softmax_scale).transpose(0, 1) for s, e in itertools.pairwise(bounds)])

    return varlen


def test_flash_attention_gets_what_its_kernel_requires_from_a_bf16_gqa_model(monkeypatch):
    import importlib.machinery
    import sys
    import types

    calls = []
    fake = types.ModuleType("flash_attn")
    fake.__spec__ = importlib.machinery.ModuleSpec("flash_attn", None)
    fake.flash_attn_varlen_func = strict_varlen(calls)
    monkeypatch.setitem(sys.modules, "flash_attn", fake)
    # GQA (4 query heads, 2 key/value heads), q/k/v biases, bf16.
    model = make_tiny_qwen2(vocab_size=VOCAB, hidden_size=128, num_heads=4, num_layers=2, dtype=torch.bfloat16)
    exp = ragged([[0, 1, 3], [2, 0, 7], [1, 1, 1], [5, 0, 2]])
    want, _ = sequence_logprobs(model, exp, temperature=0.7)
    use_attention(model, True, backend="flash_attention_2")
    got, _ = sequence_logprobs(model, exp, temperature=0.7, packed=True)
    assert len(calls) == 2 and calls[0] == exp.packed_layout().model_kwargs()["fastrlhf_rows"].bounds
    torch.testing.assert_close(got, want, rtol=0, atol=3e-2)  # bf16: sdpa per sequence vs one masked sdpa


# ----------------------------------------------------------------------------------------------
# Rows given by their position ids alone: one device read per layer, not one per row
# ----------------------------------------------------------------------------------------------


def test_unpadded_generation_reads_the_positions_once_per_forward_not_per_layer_or_row(monkeypatch):
    """HF generate on unpadded prompts (transformers drops their all-ones mask) reaches the attention with position
    ids and no mask: their bounds are read once per forward for the whole batch (it was once per row and layer, then
    once per layer, a GPU stall each), and the tokens are plain sdpa's."""
    import copy

    from fastrlhf.sequences import packed_attention

    model = make_tiny_qwen2(vocab_size=VOCAB, hidden_size=64, num_heads=2, num_layers=3)
    reference = copy.deepcopy(model)
    use_attention(model, True)
    reads = []
    original = packed_attention.sequence_bounds
    monkeypatch.setattr(packed_attention, "sequence_bounds", lambda pos: reads.append(pos.shape) or original(pos))
    ids = torch.randint(3, VOCAB, (4, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False,
                             pad_token_id=PAD)
        want = reference.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=4,
                                  do_sample=False, pad_token_id=PAD)
    assert torch.equal(got, want)
    assert len(reads) == 1, reads  # the prefill: 3 layers, all 4 rows, one read
    # Rows that do pack several sequences still get one sdpa call per sequence, from the same single read.
    assert original(torch.tensor([[0, 1, 0, 1, 2], [0, 1, 2, 3, 4]])) == [[0, 2, 5], [0, 5]]


# ----------------------------------------------------------------------------------------------
# The shared-prompt block mask's host cost
# ----------------------------------------------------------------------------------------------


def largest_tensor_made(fn):
    """``fn()`` and the element count of the largest tensor any torch op made while it ran."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Watch(TorchDispatchMode):
        largest = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in out if isinstance(out, (tuple, list)) else (out,):
                if isinstance(t, torch.Tensor):
                    Watch.largest = max(Watch.largest, t.numel())
            return out

    with Watch():
        result = fn()
    return result, Watch.largest


def test_the_shared_prompt_block_mask_grows_with_the_row_not_the_row_times_its_tiles():
    """Built per segment, not per token x key tile: a 123k-token shared row took 1.1 s and ~2 GB of host temporaries
    per micro-batch ([N, N / 128] masks and their int64 copies), now ~50 ms. The tiles it lists are unchanged (the
    pattern tests in test_packed_attention.py)."""
    from fastrlhf.sequences.packed_attention import BLOCK_SIZE, block_mask
    from fastrlhf.sequences.packing import PackedLayout

    groups, n, prompt, completion = 4, 4, 300, 400  # 7,600 tokens, 60 tiles
    layout = PackedLayout.build([prompt] * groups * n, [completion] * groups * n,
                                prompt_groups=[i // n for i in range(groups * n)])
    mask, largest = largest_tensor_made(lambda: block_mask(layout.segments, layout.num_tokens, "cpu"))
    blocks = -(-layout.num_tokens // BLOCK_SIZE)
    assert mask.kv_num_blocks.shape[-1] == blocks
    assert largest <= max(blocks * BLOCK_SIZE, blocks * blocks), (largest, layout.num_tokens, blocks)
