"""The attention of packed rows (fastrlhf/sequences/packed_attention.py, chosen by fastrlhf/sequences/attention.py).

* every backend a CPU can run (sdpa per sequence; FlexAttention's reference path) gives a packed and a
  shared-prompt micro-batch the per-token logprobs, values and gradients of the padded layout, for
  Llama and Qwen2 (GQA, q/k/v biases, tied embeddings), with 1-token sequences, a row holding one
  sequence and a group whose completions are all empty;
* the block mask built on the host lists every tile a token may attend in, and marks full only tiles
  where every pair may;
* no dense ``[N, N]`` mask is built in a packed or shared forward: the mask builders transformers
  would call, and torch's own block-mask builder, are watched;
* flash-attention's variable-length call gets the layout's host-built ``cu_seqlens``;
* padded batches and generation stay plain sdpa; the saved config carries nothing of this.

torch refuses FlexAttention backward on a CPU (its compiled kernels are GPU-only); its eager path,
which these tests run with that check lifted, is the exact reference the GPU kernels are held to.
"""

import copy
import importlib.machinery
import sys
import types

import pytest
import torch

from fastrlhf.modeling import CausalLMWithValueHead, use_attention
from fastrlhf.modeling.tiny import make_tiny_llama, make_tiny_qwen2
from fastrlhf.rl.experience import build_experience
from fastrlhf.rl.forward import sequence_logprobs, token_values
from fastrlhf.rollout import Completion
from fastrlhf.sequences import packed_attention
from fastrlhf.sequences.packing import PackedLayout

VOCAB = 97
PAD = 2
# Odd lengths, a 1-token sequence, one much longer than the rest.
LENGTHS = [7, 1, 23, 2, 60, 5]


def make(family, dtype=torch.float32, **kw):
    if family == "llama":
        return make_tiny_llama(seed=3, vocab_size=VOCAB, num_layers=2, dtype=dtype, hidden_size=64, num_heads=2, **kw)
    # GQA (4 query heads, 2 key/value heads), q/k/v biases, tied embeddings.
    return make_tiny_qwen2(seed=3, vocab_size=VOCAB, num_layers=2, dtype=dtype, hidden_size=128, num_heads=4, **kw)


def packed_row(seed=0):
    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(3, VOCAB, (n,), generator=g) for n in LENGTHS]
    ids = torch.cat(seqs)[None]
    positions = torch.cat([torch.arange(n) for n in LENGTHS])[None]
    return seqs, ids, positions


# ----------------------------------------------------------------------------------------------
# Packed and shared micro-batches against the padded layout, every CPU backend
# ----------------------------------------------------------------------------------------------


def batch(single=False):
    """Prompts of 1-4 tokens with 4 samples each: 1-token sequences (a 1-token prompt with an empty
    completion), a group whose completions are all empty, one long completion; or one sequence alone."""
    if single:
        return build_experience([[5, 6, 7]], [[Completion([8, 9, 10, 11], [-1.0] * 4, "stop")]], PAD)
    g = torch.Generator().manual_seed(1)
    prompts = [[11], [12, 13, 14], [15, 16], [17, 18, 19, 20]]
    lengths = [[0, 3, 1, 2], [0, 0, 0, 0], [9, 1, 4, 2], [2, 0, 5, 1]]
    completions = [[Completion(torch.randint(3, VOCAB, (n,), generator=g).tolist(), [-1.0] * n, "stop")
                    for n in row] for row in lengths]
    return build_experience(prompts, completions, PAD)


def outputs(actor, critic, exp, packed):
    """Per-token logprobs and values of ``exp`` in one micro-batch, and the gradient of a weighted sum of
    both over every parameter."""
    for m in (actor, critic):
        m.zero_grad()
    weights = torch.linspace(-1, 1, exp.response_width)
    with torch.enable_grad():
        from fastrlhf.rl.forward import MicroBatch, _token_logprobs

        mb = MicroBatch(exp, packed)
        lp, _ = _token_logprobs(actor, mb, 1.0, None, None, True)
        lp = mb.rows(torch.where(mb.tokens(mb.exp.response_mask) > 0, lp, 0.0))
        values = token_values(critic, exp, grad=True, packed=packed)
        ((lp * weights).sum() + (values * weights.flip(0)).sum()).backward()
    grads = {f"actor.{n}": p.grad.clone() for n, p in actor.named_parameters() if p.grad is not None}
    grads.update({f"critic.{n}": p.grad.clone() for n, p in critic.named_parameters() if p.grad is not None})
    return lp.detach(), values.detach(), grads


def close(got, want, what):
    """fp32, relative 1e-5 of the compared tensor's scale (gradients sum tokens in another order)."""
    scale = max(float(want.abs().max()), 1e-3)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * scale, msg=lambda m: f"{what}: {m}")


@pytest.mark.parametrize("backend", ["sdpa", "flex"])
@pytest.mark.parametrize("layout", ["packed", "shared", "single"])
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_packed_and_shared_micro_batches_equal_the_padded_one(family, layout, backend, cpu_flex):
    actor = make(family).train()
    critic = CausalLMWithValueHead(make(family)).train()
    padded_actor, padded_critic = copy.deepcopy(actor), copy.deepcopy(critic)
    for model in (actor, critic.lm):
        assert use_attention(model, True, layout == "shared", backend) == backend
    exp = batch(single=layout == "single")
    want = outputs(padded_actor, padded_critic, exp, False)
    got = outputs(actor, critic, exp, "shared" if layout == "shared" else True)
    close(got[0], want[0], "logprobs")
    close(got[1], want[1], "values")
    assert got[2].keys() == want[2].keys() and len(want[2]) > 10
    for name, g in want[2].items():
        close(got[2][name], g, f"grad of {name}")


def test_flex_runs_each_row_through_its_block_mask(cpu_flex, monkeypatch):
    """The flex backend calls FlexAttention once per layer with the row's block mask (no sdpa call)."""
    import torch.nn.attention.flex_attention as flex

    model = make("qwen2")
    use_attention(model, True, backend="flex")
    real, masks = flex.flex_attention, []
    monkeypatch.setattr(flex, "flex_attention", lambda q, k, v, block_mask=None, **kw: masks.append(block_mask)
                        or real(q, k, v, block_mask=block_mask, **kw))
    exp = batch()
    sequence_logprobs(model, exp, packed=True)
    assert len(masks) == 2 and all(isinstance(m, flex.BlockMask) for m in masks)


# ----------------------------------------------------------------------------------------------
# The block mask
# ----------------------------------------------------------------------------------------------


def dense_allowed(segments, length):
    """The reference: token q may attend kv within its own segment (causally) or in its prefix."""
    allowed = torch.zeros(length, length, dtype=torch.bool)
    for start, end, prefix_start, prefix_end in segments:
        allowed[start:end, start:end] = torch.ones(end - start, end - start, dtype=torch.bool).tril()
        allowed[start:end, prefix_start:prefix_end] = True
    return allowed


def expand(mask, length, block):
    """The pairs a block mask lets attend: its full tiles whole, its partial tiles through its mask_mod."""
    kv_num, kv_idx = mask.kv_num_blocks[0, 0], mask.kv_indices[0, 0]
    full_num, full_idx = mask.full_kv_num_blocks[0, 0], mask.full_kv_indices[0, 0]
    q = torch.arange(length)[:, None]
    kv = torch.arange(length)[None, :]
    evaluated = mask.mask_mod(0, 0, q, kv)
    out = torch.zeros(length, length, dtype=torch.bool)
    tiles_full = torch.zeros(len(kv_num), len(kv_num), dtype=torch.bool)
    for i in range(len(kv_num)):
        rows = slice(i * block, min(length, (i + 1) * block))
        for j in kv_idx[i, :int(kv_num[i])].tolist():
            cols = slice(j * block, min(length, (j + 1) * block))
            out[rows, cols] = evaluated[rows, cols]
        for j in full_idx[i, :int(full_num[i])].tolist():
            cols = slice(j * block, min(length, (j + 1) * block))
            out[rows, cols] = True
            tiles_full[i, j] = True
    return out, tiles_full


@pytest.mark.parametrize("block", [4, 16])
@pytest.mark.parametrize("shared", [False, True], ids=["packed", "shared"])
def test_the_block_mask_is_the_attention_pattern(shared, block):
    g = torch.Generator().manual_seed(block)
    prompt_lens = torch.randint(1, 9, (10,), generator=g).tolist()
    completion_lens = torch.randint(0, 12, (10,), generator=g).tolist()
    groups = [i // 3 for i in range(10)] if shared else None
    completion_lens[7] = 45  # spans whole tiles: some are full
    if shared:  # members of a group share their prompt
        prompt_lens = [prompt_lens[3 * (i // 3)] for i in range(10)]
        completion_lens[3:6] = [0, 0, 0]  # a group whose completions are all empty
    layout = PackedLayout.build(prompt_lens, completion_lens, prompt_groups=groups)
    kwargs = layout.model_kwargs()
    rows = kwargs["fastrlhf_rows"]
    length = layout.num_tokens
    segments = rows.segments or [(s, e, s, s) for s, e in zip(rows.bounds, rows.bounds[1:], strict=False)]
    want = dense_allowed(segments, length)
    got, tiles_full = expand(packed_attention.block_mask(segments, length, "cpu", block=block), length, block)
    assert torch.equal(got, want)
    for i, j in tiles_full.nonzero().tolist():  # a full tile is attended whole: no mask is applied there
        assert want[i * block:(i + 1) * block, j * block:(j + 1) * block].all()
    assert tiles_full.any()  # the test saw full tiles, not only partial ones


# ----------------------------------------------------------------------------------------------
# No dense mask; flash-attention's arguments
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["sdpa", "flex"])
@pytest.mark.parametrize("shared", [False, True], ids=["packed", "shared"])
def test_a_packed_forward_builds_no_dense_mask(shared, backend, cpu_flex, monkeypatch):
    import torch.nn.attention.flex_attention as flex
    import transformers.masking_utils as masking

    def refuse(name):
        def builder(*args, **kwargs):
            raise AssertionError(f"{name} was called in a packed forward")
        return builder

    for name in ("sdpa_mask", "eager_mask", "flex_attention_mask", "find_packed_sequence_indices"):
        monkeypatch.setattr(masking, name, refuse(f"transformers' {name}"))
    monkeypatch.setattr(flex, "create_block_mask", refuse("torch's create_block_mask"))
    model = make("llama").train()
    use_attention(model, True, shared, backend)
    exp = batch()
    lp, _ = sequence_logprobs(model, exp, packed="shared" if shared else True)
    assert torch.isfinite(lp).all()
    from fastrlhf.rl.forward import MicroBatch, _token_logprobs

    lp, _ = _token_logprobs(model, MicroBatch(exp, "shared" if shared else True), 1.0, None, None, True)
    lp.sum().backward()  # the backward too


def test_flash_attention_gets_the_layouts_varlen_arguments(monkeypatch):
    """A stand-in for flash_attn (an sdpa call per sequence) checks what the varlen kernel is given: the
    layout's bounds as int32 cu_seqlens, the longest sequence, causal; and the outputs match sdpa's."""
    calls = []

    def varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal):
        calls.append(dict(cu=cu_seqlens_q.tolist(), same=cu_seqlens_k is cu_seqlens_q, dtype=cu_seqlens_q.dtype,
                          longest=max_seqlen_q, causal=causal))
        bounds = cu_seqlens_q.tolist()
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
        outs = [torch.nn.functional.scaled_dot_product_attention(
            q[s:e].transpose(0, 1), k[s:e].transpose(0, 1), v[s:e].transpose(0, 1), is_causal=True,
            scale=softmax_scale).transpose(0, 1) for s, e in zip(bounds, bounds[1:], strict=False)]
        return torch.cat(outs)

    fake = types.ModuleType("flash_attn")
    fake.__spec__ = importlib.machinery.ModuleSpec("flash_attn", None)
    fake.flash_attn_varlen_func = varlen
    monkeypatch.setitem(sys.modules, "flash_attn", fake)
    exp = batch()
    model = make("qwen2")
    want, _ = sequence_logprobs(model, exp, micro_batch=exp.batch_size)
    use_attention(model, True, backend="flash_attention_2")
    got, _ = sequence_logprobs(model, exp, packed=True, micro_batch=exp.batch_size)
    close(got, want, "logprobs")
    layout = exp.packed_layout()
    bounds = layout.model_kwargs()["fastrlhf_rows"].bounds
    longest = max(e - s for s, e in zip(bounds, bounds[1:], strict=False))
    assert longest == 11  # prompt [15, 16] and a 9-token completion
    assert len(calls) == 2 and all(c == dict(cu=bounds, same=True, dtype=torch.int32, longest=longest, causal=True)
                                   for c in calls), calls


def test_the_layouts_arguments_need_no_device_value():
    """Built on the meta device (no values at all): bounds and the block mask's tiles come from the host."""
    layout = PackedLayout.build([3, 1, 5], [4, 2, 0], device="meta")
    kwargs = layout.model_kwargs()
    assert kwargs["fastrlhf_rows"].bounds == [0, 7, 10, 15] and kwargs["fastrlhf_rows"].cu.device.type == "meta"
    assert kwargs["attention_mask"].kv_num_blocks.device.type == "meta"


# ----------------------------------------------------------------------------------------------
# Rows given by their position ids alone; padded batches; the saved config
# ----------------------------------------------------------------------------------------------


def hidden_and_grads(model, calls):
    """Sum of the last hidden states of ``calls`` (kwargs of model.model), and the q/k/v weight grads."""
    model.zero_grad()
    outs = [model.model(use_cache=False, **kw).last_hidden_state for kw in calls]
    flat = torch.cat([o.reshape(-1, o.shape[-1]) for o in outs])
    (flat.float() * torch.linspace(-1, 1, flat.shape[-1])).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if "self_attn" in n and p.grad is not None}
    return flat.detach(), grads


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_a_row_given_by_its_position_ids_equals_each_sequence_alone(family, dtype):
    model = make(family, dtype).train()
    assert use_attention(model, True) == "sdpa" and model.config._attn_implementation == packed_attention.NAME
    seqs, ids, positions = packed_row()
    got, got_grads = hidden_and_grads(model, [dict(input_ids=ids, position_ids=positions)])
    want, want_grads = hidden_and_grads(model, [dict(input_ids=s[None]) for s in seqs])
    tol = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got, want, **tol)
    assert want_grads and got_grads.keys() == want_grads.keys()
    for name, g in want_grads.items():  # sums over ~100 tokens in another order: a tolerance on their scale
        scale = float(g.abs().max())
        torch.testing.assert_close(got_grads[name], g, rtol=tol["rtol"], atol=tol["atol"] * max(scale, 1.0),
                                   msg=lambda m, name=name: f"{name}: {m}")


def test_a_changed_sequence_changes_only_its_own_outputs():
    model = make("qwen2")
    use_attention(model, True)
    seqs, ids, positions = packed_row(seed=1)
    changed = ids.clone()
    start = sum(LENGTHS[:2])
    changed[0, start:start + LENGTHS[2]] = (changed[0, start:start + LENGTHS[2]] + 5) % (VOCAB - 3) + 3
    with torch.no_grad():
        a = model.model(input_ids=ids, position_ids=positions).last_hidden_state[0]
        b = model.model(input_ids=changed, position_ids=positions).last_hidden_state[0]
    inside = torch.zeros(ids.shape[1], dtype=torch.bool)
    inside[start:start + LENGTHS[2]] = True
    assert torch.equal(a[~inside], b[~inside])
    assert not torch.allclose(a[inside], b[inside])


def test_the_sdpa_backend_runs_one_sdpa_call_per_sequence(monkeypatch):
    import transformers.integrations.sdpa_attention as sdpa_module

    model = make("llama")
    use_attention(model, True)
    real_sdpa, calls = sdpa_module.sdpa_attention_forward, []
    monkeypatch.setattr(sdpa_module, "sdpa_attention_forward",
                        lambda module, q, *a, **kw: calls.append(q.shape[2]) or real_sdpa(module, q, *a, **kw))
    layout = PackedLayout.build(LENGTHS, [0] * len(LENGTHS))
    _, ids, _ = packed_row()
    with torch.no_grad():
        model.model(input_ids=ids, use_cache=False, **layout.model_kwargs())
    assert calls == LENGTHS * 2  # 2 layers, one call per sequence of its own length


def test_padded_batches_and_generation_are_plain_sdpa():
    model = make("qwen2")
    reference = copy.deepcopy(model)
    use_attention(model, True)
    ids = torch.randint(3, VOCAB, (3, 9), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[0, :4] = 0  # left padding
    mask[2, :1] = 0
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        for kw in (dict(attention_mask=mask, position_ids=positions), dict()):
            torch.testing.assert_close(model(input_ids=ids, **kw).logits, reference(input_ids=ids, **kw).logits,
                                       rtol=0, atol=0)
        got = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=2)
        want = reference.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False,
                                  pad_token_id=2)
    assert torch.equal(got, want)


def test_a_sequence_longer_than_the_sliding_window_is_refused():
    model = make("qwen2", use_sliding_window=True, sliding_window=16, max_window_layers=0)
    use_attention(model, True)
    _, ids, positions = packed_row()
    with pytest.raises(ValueError, match="longer than the model's sliding window"):
        model.model(input_ids=ids, position_ids=positions, use_cache=False)


def test_selection_and_the_saved_config(tmp_path):
    model = make("llama")
    assert use_attention(model, False) is None
    assert model.config._attn_implementation == "sdpa"
    assert use_attention(model, True, backend="flex") == "flex"
    layers = [m for m in model.modules() if hasattr(m, "fastrlhf_attention")]
    assert layers and {m.fastrlhf_attention for m in layers} == {"flex"}
    model.save_pretrained(tmp_path)
    saved = (tmp_path / "config.json").read_text()
    assert packed_attention.NAME not in saved and "flex" not in saved


def test_a_packed_row_refuses_a_model_on_another_attention():
    # A packed row reaching a model on plain sdpa would misread its mask: refused, with the remedy.
    plain = make("llama")
    exp = build_experience([[5, 6, 7]], [[Completion([8, 9], [-1.0, -1.0], "stop"),
                                          Completion([10], [-1.0], "stop")]], pad_token_id=PAD)
    with pytest.raises(ValueError, match="needs the fastrlhf_packed attention"):
        sequence_logprobs(plain, exp, packed="shared")
    use_attention(plain, True, share_prompts=True)
    shared, _ = sequence_logprobs(plain, exp, packed="shared")
    close(shared, sequence_logprobs(plain, exp)[0], "logprobs")
