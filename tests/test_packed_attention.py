"""fastrlhf_packed_sdpa (fastrlhf/packed_attention.py): a packed row attends per sequence, exactly as
each sequence alone, with no [N, N] mask; padded batches and generation are sdpa's, unchanged."""

import copy

import pytest
import torch

from fastrlhf import packed_attention
from fastrlhf.modeling import use_packed_attention
from fastrlhf.tiny_models import make_tiny_llama, make_tiny_qwen2

VOCAB = 97
# Odd lengths, a 1-token sequence, one much longer than the rest.
LENGTHS = [7, 1, 23, 2, 60, 5]


def make(family, dtype=torch.float32, **kw):
    maker = make_tiny_llama if family == "llama" else make_tiny_qwen2
    shape = dict(hidden_size=64, num_heads=2) if family == "llama" else dict(hidden_size=128, num_heads=4)
    return maker(seed=3, vocab_size=VOCAB, num_layers=2, dtype=dtype, **shape, **kw)


def packed_row(seed=0):
    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(3, VOCAB, (n,), generator=g) for n in LENGTHS]
    ids = torch.cat(seqs)[None]
    positions = torch.cat([torch.arange(n) for n in LENGTHS])[None]
    return seqs, ids, positions


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
def test_a_packed_row_equals_each_sequence_alone_forward_and_backward(family, dtype):
    model = make(family, dtype).train()
    assert use_packed_attention(model, True) == packed_attention.NAME
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
    # transformers' own packed path (a block-diagonal [N, N] mask under sdpa) agrees as well.
    dense = copy.deepcopy(model)
    dense.set_attn_implementation("sdpa")
    torch.testing.assert_close(hidden_and_grads(dense, [dict(input_ids=ids, position_ids=positions)])[0], want, **tol)


def test_a_changed_sequence_changes_only_its_own_outputs():
    model = make("qwen2")
    use_packed_attention(model, True)
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


def test_packed_rows_build_no_dense_mask_and_run_one_sdpa_call_per_sequence(monkeypatch):
    import transformers.integrations.sdpa_attention as sdpa_module
    import transformers.masking_utils as masking

    model = make("llama")
    use_packed_attention(model, True)
    real_mask, real_sdpa = masking.sdpa_mask, sdpa_module.sdpa_attention_forward
    masks, calls = [], []
    monkeypatch.setattr(masking, "sdpa_mask", lambda **kw: masks.append(kw) or real_mask(**kw))
    monkeypatch.setattr(sdpa_module, "sdpa_attention_forward",
                        lambda module, q, *a, **kw: calls.append(q.shape[2]) or real_sdpa(module, q, *a, **kw))
    _, ids, positions = packed_row()
    with torch.no_grad():
        model.model(input_ids=ids, position_ids=positions, use_cache=False)
    assert masks == []
    assert calls == LENGTHS * 2  # 2 layers, one call per sequence of its own length


def test_padded_batches_and_generation_are_plain_sdpa():
    model = make("qwen2")
    reference = copy.deepcopy(model)
    use_packed_attention(model, True)
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
    use_packed_attention(model, True)
    _, ids, positions = packed_row()
    with pytest.raises(ValueError, match="longer than the model's sliding window"):
        model.model(input_ids=ids, position_ids=positions, use_cache=False)


def test_selection_and_the_saved_config(tmp_path):
    model = make("llama")
    assert use_packed_attention(model, False) is None
    assert model.config._attn_implementation == "sdpa"
    eager = make("llama", attn_implementation="eager")
    assert use_packed_attention(eager, True) == "eager"  # an explicit choice is kept
    use_packed_attention(model, True)
    model.save_pretrained(tmp_path)
    assert packed_attention.NAME not in (tmp_path / "config.json").read_text()


def test_shared_prompts_refuse_any_other_attention():
    import fastrlhf.rl.forward as forward
    from fastrlhf.rl.experience import build_experience
    from fastrlhf.rollout import Completion

    eager = make("llama", attn_implementation="eager")
    with pytest.raises(ValueError, match="trainer.share_prompts: needs the fastrlhf_packed_sdpa attention"):
        use_packed_attention(eager, True, share_prompts=True)
    # A shared-prompt row reaching a model on plain sdpa would attend across sequences: refused.
    plain = make("llama")
    exp = build_experience([[5, 6, 7]], [[Completion([8, 9], [-1.0, -1.0], "stop"),
                                          Completion([10], [-1.0], "stop")]], pad_token_id=2)
    with pytest.raises(ValueError, match="needs the fastrlhf_packed_sdpa attention"):
        forward.sequence_logprobs(plain, exp, packed="shared")
    use_packed_attention(plain, True, share_prompts=True)
    shared, _ = forward.sequence_logprobs(plain, exp, packed="shared")
    torch.testing.assert_close(shared, forward.sequence_logprobs(plain, exp)[0], rtol=1e-5, atol=1e-5)


def test_flash_attention_gets_the_layouts_varlen_arguments_at_every_layer():
    """On CUDA, flash_attention_2 takes cu_seq_lens / max_length from the layout (host lengths) instead
    of deriving them from the position ids with a device read per layer; a recording attention
    standing in for flash-attention checks they reach every layer, and a row built on the meta device
    proves the layout needs no device value to make them."""
    from transformers import AttentionInterface

    from fastrlhf.packing import PackedLayout

    seen = []

    def recording(module, query, key, value, attention_mask, **kwargs):
        seen.append(kwargs)
        return packed_attention.packed_sdpa_attention(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register("recording_varlen", recording)
    model = make("qwen2")
    model.set_attn_implementation("recording_varlen")
    prompt_lens, completion_lens = [3, 1, 5], [4, 2, 0]
    layout = PackedLayout.build(prompt_lens, completion_lens)
    ids = torch.randint(3, VOCAB, (1, layout.num_tokens), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model.model(input_ids=ids, use_cache=False, **layout.model_kwargs())
    assert len(seen) == 2
    for kwargs in seen:
        assert kwargs["cu_seq_lens_q"].tolist() == kwargs["cu_seq_lens_k"].tolist() == [0, 7, 10, 15]
        assert kwargs["cu_seq_lens_q"].dtype == torch.int32  # what flash_attn_varlen_func takes
        assert kwargs["max_length_q"] == kwargs["max_length_k"] == 7 and isinstance(kwargs["max_length_q"], int)
    meta = PackedLayout.build(prompt_lens, completion_lens, device="meta").model_kwargs()
    assert meta["cu_seq_lens_q"].device.type == "meta" and meta["max_length_q"] == 7
