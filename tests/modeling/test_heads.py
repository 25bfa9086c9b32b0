"""``model.fp32_logits`` in HF ``generate``: the head's logits as its GEMM's fp32 sums
(``fastrlhf.modeling.fp32_logits``), as the trainer's fused kernels make them
(``tests/kernels/test_kernels_fused_linear.py`` checks those)."""

import pytest
import torch

from fastrlhf.modeling.heads import fp32_logits_head
from fastrlhf.modeling.tiny import make_tiny_qwen2
from fastrlhf.rollout import HFEngine, SamplingConfig


def bf16_model():
    return make_tiny_qwen2(seed=2, vocab_size=301, hidden_size=64, num_heads=2, dtype=torch.bfloat16,
                           initializer_range=0.2)


def test_the_head_gives_fp32_sums_of_its_bf16_weight_inside_the_block_only():
    model = bf16_model()
    ids = torch.randint(3, 301, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        hidden = model.model(ids).last_hidden_state
        want = hidden.float() @ model.lm_head.weight.float().t()
        with fp32_logits_head(model):
            got = model(ids).logits
        after = model(ids).logits
    assert got.dtype == torch.float32 and torch.allclose(got, want, rtol=1e-6, atol=1e-6)
    assert after.dtype == torch.bfloat16 and (after.float() - want).abs().max() > 1e-4  # rounded to bf16 again
    assert "forward" not in vars(model.lm_head)  # the class's forward back


def test_an_fp32_head_is_left_alone_and_a_wrapped_head_is_refused():
    model = make_tiny_qwen2(seed=2, vocab_size=301, hidden_size=64, num_heads=2)
    with fp32_logits_head(model):
        assert "forward" not in vars(model.lm_head)
    wrapped = bf16_model()
    wrapped.lm_head = torch.nn.Sequential(wrapped.lm_head)
    wrapped.lm_head.weight = wrapped.lm_head[0].weight
    refused = r"^model.fp32_logits: the LM head is a torch\..*Sequential, not a torch.nn.Linear"
    with pytest.raises(ValueError, match=refused):
        with fp32_logits_head(wrapped):
            pass


@pytest.mark.parametrize("fp32_logits", [False, True])
def test_hf_generate_samples_from_the_heads_fp32_logits(fp32_logits):
    model = bf16_model()
    seen = []
    model.lm_head.register_forward_hook(lambda module, args, out: seen.append(out.dtype))
    results = HFEngine(model, fp32_logits=fp32_logits).generate(
        [[5, 6, 7], [8, 9]], SamplingConfig(n=2, temperature=1.0, max_new_tokens=4, seed=1, ignore_eos=True))
    assert all(len(c.token_ids) == 4 and all(lp <= 0 for lp in c.logprobs) for row in results for c in row)
    assert set(seen) == {torch.float32 if fp32_logits else torch.bfloat16}
    assert "forward" not in vars(model.lm_head)
