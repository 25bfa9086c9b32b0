"""Follow-ups of the packed attention (fastrlhf/sequences/packed_attention.py, packing.py; config/model_checks.py).

* the FlexAttention block mask of a packed row is built only when the flex backend reads it (once per row, not per
  layer): the sdpa and flash-attn backends never build it, and give the same outputs;
* Gemma-2's ``attn_logit_softcapping`` is applied by flex (against the model's own eager attention) and handed to
  flash-attn; sdpa, which would drop it, refuses it, as every packed path refuses gpt-oss's attention sinks;
* the config check refuses those combinations, naming the field.
"""

import importlib.machinery
import sys
import types

import pytest
import torch

from fastrlhf.config.errors import ConfigError
from fastrlhf.config.model_checks import check_logit_terms
from fastrlhf.modeling import use_attention
from fastrlhf.modeling.tiny import make_tiny_qwen2
from fastrlhf.rl.experience import build_experience
from fastrlhf.rl.forward import sequence_logprobs
from fastrlhf.rollout import Completion
from fastrlhf.sequences import packed_attention
from fastrlhf.sequences.packing import PackedLayout

VOCAB = 61


def experience():
    g = torch.Generator().manual_seed(1)
    prompts = [[11], [12, 13, 14], [15, 16], [17, 18, 19, 20]]
    lengths = [[3, 1], [0, 2], [9, 4], [2, 5]]
    completions = [[Completion(torch.randint(3, VOCAB, (n,), generator=g).tolist(), [-1.0] * n, "stop")
                    for n in row] for row in lengths]
    return build_experience(prompts, completions, 2)


def fake_flash_attn(monkeypatch, calls):
    """A stand-in for flash_attn: an sdpa call per sequence, recording the keyword arguments it gets."""

    def varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal,
               **extra):
        calls.append(extra)
        bounds = cu_seqlens_q.tolist()
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
        return torch.cat([torch.nn.functional.scaled_dot_product_attention(
            q[s:e].transpose(0, 1), k[s:e].transpose(0, 1), v[s:e].transpose(0, 1), is_causal=True,
            scale=softmax_scale).transpose(0, 1) for s, e in zip(bounds, bounds[1:], strict=False)])

    fake = types.ModuleType("flash_attn")
    fake.__spec__ = importlib.machinery.ModuleSpec("flash_attn", None)
    fake.flash_attn_varlen_func = varlen
    monkeypatch.setitem(sys.modules, "flash_attn", fake)


# ----------------------------------------------------------------------------------------------
# The block mask: built for flex only
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["sdpa", "flash_attention_2", "flex"])
def test_the_block_mask_is_built_only_for_flex_and_once_per_row(backend, cpu_flex, monkeypatch):
    """A 45k-token row's block mask cost 6 ms of host time per micro-batch (95 ms at 181k) for backends that never
    read it. Now sdpa and flash-attn never build it and give the padded layout's logprobs; flex builds it once for
    all its layers."""
    fake_flash_attn(monkeypatch, [])
    built, real = [], packed_attention.block_mask
    monkeypatch.setattr(packed_attention, "block_mask", lambda *a, **k: built.append(a[1]) or real(*a, **k))
    exp = experience()
    model = make_tiny_qwen2(seed=3, vocab_size=VOCAB, num_layers=2, hidden_size=64, num_heads=4)
    want, _ = sequence_logprobs(model, exp, micro_batch=exp.batch_size)
    use_attention(model, True, backend=backend)
    got, _ = sequence_logprobs(model, exp, packed=True, micro_batch=exp.batch_size)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert len(built) == (1 if backend == "flex" else 0), built


def test_the_unbuilt_mask_keeps_transformers_from_building_its_own():
    """Until read, the row's mask is to transformers an already prepared 4-D mask: no dense mask, no read of the
    position ids (find_packed_sequence_indices); read, it is the row's block mask."""
    from transformers.masking_utils import create_causal_mask

    layout = PackedLayout.build([3, 1, 5], [4, 2, 0])
    kwargs = layout.model_kwargs()
    mask = kwargs["attention_mask"]
    model = make_tiny_qwen2(seed=3, vocab_size=VOCAB, num_layers=1, hidden_size=32, num_heads=2)
    use_attention(model, True, backend="sdpa")
    embeds = torch.zeros(1, layout.num_tokens, 32)
    assert create_causal_mask(config=model.config, inputs_embeds=embeds, attention_mask=mask, past_key_values=None,
                              position_ids=kwargs["position_ids"]) is mask
    assert mask.shape == (1, 1, 15, 15) and mask._mask is None
    want = packed_attention.block_mask([(0, 7, 0, 0), (7, 10, 7, 7), (10, 15, 10, 10)], 15, "cpu")
    assert torch.equal(mask.kv_num_blocks, want.kv_num_blocks) and torch.equal(mask.to_dense(), want.to_dense())


# ----------------------------------------------------------------------------------------------
# Attention-logit softcapping (Gemma-2) and sinks (gpt-oss)
# ----------------------------------------------------------------------------------------------


def tiny_gemma2(softcap=0.5):
    """A random Gemma-2 with q/k weights large enough that the softcap changes the attention."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    config = Gemma2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=8, attn_logit_softcapping=softcap,
                          sliding_window=64, attn_implementation="eager")
    torch.manual_seed(0)
    model = Gemma2ForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "q_proj" in name or "k_proj" in name:
                p.mul_(40)
    return model


LENGTHS = [5, 9, 3]


def sequences():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (n,), generator=g) for n in LENGTHS]


def logits_and_grads(model, calls):
    model.zero_grad()
    logits = torch.cat([model(**kw).logits[0] for kw in calls])
    (logits * torch.linspace(-1, 1, logits.shape[-1])).sum().backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_flex_applies_gemma2s_softcap_as_its_eager_attention_does(cpu_flex):
    """Packed flex ran Gemma-2 without its attention softcap: logits off by 0.366 from eager here. Now they and the
    gradients are eager's (per sequence, unpacked)."""
    eager = tiny_gemma2()
    uncapped = tiny_gemma2(softcap=None)
    uncapped.load_state_dict(eager.state_dict())
    seqs = sequences()
    want = logits_and_grads(eager, [dict(input_ids=s[None]) for s in seqs])
    assert (logits_and_grads(uncapped, [dict(input_ids=s[None]) for s in seqs])[0] - want[0]).abs().max() > 0.1
    packed = tiny_gemma2()
    packed.load_state_dict(eager.state_dict())
    assert use_attention(packed, True, backend="flex") == "flex"
    got = logits_and_grads(packed, [dict(input_ids=torch.cat(seqs)[None],
                                         **PackedLayout.build(LENGTHS, [0] * 3).model_kwargs())])
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
    assert got[1].keys() == want[1].keys()
    for name, g in want[1].items():
        torch.testing.assert_close(got[1][name], g, rtol=1e-4, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")


def test_sdpa_refuses_gemma2s_softcap_and_flash_attn_is_given_it(monkeypatch):
    model = tiny_gemma2().eval()
    inputs = dict(input_ids=torch.cat(sequences())[None], **PackedLayout.build(LENGTHS, [0] * 3).model_kwargs())
    use_attention(model, True, backend="sdpa")
    with pytest.raises(ValueError, match=r"attn_logit_softcapping: 0\.5.*model\.attention: flex"):
        model(**inputs)
    calls = []
    fake_flash_attn(monkeypatch, calls)
    use_attention(model, True, backend="flash_attention_2")
    model(**inputs)
    assert calls == [dict(softcap=0.5)] * 2


def test_attention_sinks_are_refused_in_packed_rows():
    """gpt-oss hands its learned sinks to the attention as ``s_aux``; no packed path applies them."""
    module = types.SimpleNamespace(fastrlhf_attention="flex", training=False)
    q = torch.zeros(1, 2, 4, 8)
    rows = PackedLayout.build([2, 2], [0, 0]).model_kwargs()["fastrlhf_rows"]
    for fastrlhf_rows in (rows, None):
        with pytest.raises(ValueError, match="attention sinks.*trainer.packing: false"):
            packed_attention.packed_attention(module, q, q, q, None, fastrlhf_rows=fastrlhf_rows, s_aux=torch.zeros(2))


def test_the_config_check_refuses_what_packed_rows_would_drop():
    gemma2 = {"model_type": "gemma2", "attn_logit_softcapping": 50.0}
    with pytest.raises(ConfigError, match=r"model\.attention.*attn_logit_softcapping \(50\.0\)"):
        check_logit_terms(gemma2, True, "sdpa")
    with pytest.raises(ConfigError, match=r"trainer\.packing.*gpt_oss.*sinks"):
        check_logit_terms({"model_type": "gpt_oss"}, True, "flex")
    for config, packing, attention in ((gemma2, True, "flex"), (gemma2, True, "auto"), (gemma2, False, "sdpa"),
                                       ({"model_type": "qwen2"}, True, "sdpa"), ({}, True, "sdpa")):
        check_logit_terms(config, packing, attention)


@pytest.mark.parametrize("packing", [False, True])
def test_a_capped_head_is_refused_packed_or_not(packing):
    """Gemma-2's final_logit_softcapping: the logprob path (the fused kernels read the hidden states and the head's
    weight) did not apply it: on a tiny Gemma2 with cap 0.5, -8.31 where the model's own log_softmax gave -3.82."""
    with pytest.raises(ConfigError, match=r"critic\.path: .*final_logit_softcapping 30\.0"):
        check_logit_terms({"model_type": "gemma2", "final_logit_softcapping": 30.0}, packing, "flex", "critic.path")


def test_the_train_config_checks_every_model_folder(tmp_path):
    """The checks are called from the config's validation (they were written but called nowhere)."""
    from fastrlhf.config import parse_config
    from fastrlhf.modeling.tiny import save_tiny_qwen2

    save_tiny_qwen2(tmp_path / "model", vocab_size=64, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
                    intermediate_size=48)
    folder = tmp_path / "model" / "config.json"
    folder.write_text(folder.read_text().replace('"model_type": "qwen2"', '"model_type": "qwen2", '
                                                                         '"final_logit_softcapping": 30.0'))
    (tmp_path / "p.jsonl").write_text('{"prompt_ids": [1, 2]}\n')
    raw = {"algorithm": "grpo", "output_dir": str(tmp_path / "out"), "model": {"path": str(tmp_path / "model")},
           "reward": {"function": "length"}, "data": {"prompts": str(tmp_path / "p.jsonl")}, "rollout": {"n": 4},
           "trainer": {"max_steps": 1, "prompts_per_step": 4, "minibatch_size": 8}}
    with pytest.raises(ConfigError, match=r"model\.path: the model caps its logits"):
        parse_config(raw, on_gpu=False)
