"""``model.compile`` on CUDA: a Qwen2 of the 1.5B's hidden sizes (two layers, bf16, gradient checkpointing) with its
decoder layers compiled by Inductor (Triton kernels), against the same weights run eagerly: the hidden states, and
fastrlhf's fused GRPO loss on them with its gradients in every weight; then batches of other lengths reuse the
graphs (no recompile, nothing run eagerly past the recompile limit). Its CPU half, with the RL step, the packed
attention and HF generate, is tests/modeling/test_compile_layers.py."""

import pytest
import torch
from torch._dynamo.utils import counters

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: run `make test-gpu`")]

SHAPE = dict(vocab_size=151_936, hidden_size=1536, num_layers=2, num_heads=12, num_kv_heads=2,
             intermediate_size=8960, max_position_embeddings=2048)


def loss_and_grads(model, length: int, seed: int):
    from fastrlhf.kernels import fused_linear_policy_loss

    g = torch.Generator(device="cuda").manual_seed(seed)
    ids = torch.randint(0, SHAPE["vocab_size"], (4, length), device="cuda", generator=g)
    labels = torch.roll(ids, -1, dims=1)
    adv = torch.randn(4, 1, device="cuda", generator=g).expand(4, length).contiguous()
    mask = torch.ones(4, length, device="cuda")
    hidden = model.model(input_ids=ids).last_hidden_state
    loss, _ = fused_linear_policy_loss(hidden, model.lm_head.weight, labels, None, adv, mask, kl_coef=0.0)
    loss.backward()
    grads = {name: p.grad.float() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return hidden.detach().float(), loss.detach(), grads


def test_compiled_layers_match_eager_layers_and_compile_once():
    from fastrlhf.modeling.compile import compile_layers, past_recompile_limit
    from fastrlhf.modeling.tiny import make_qwen2_on

    torch._dynamo.reset()
    counters.clear()
    try:
        plain = make_qwen2_on("cuda", torch.bfloat16, seed=0, **SHAPE).train()
        compiled = make_qwen2_on("cuda", torch.bfloat16, seed=0, **SHAPE).train()
        for model in (plain, compiled):
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        assert compile_layers(compiled) == 2
        h_plain, loss_plain, grads_plain = loss_and_grads(plain, 512, seed=0)
        h_comp, loss_comp, grads_comp = loss_and_grads(compiled, 512, seed=0)
        # bf16 layers fused in another order: within a few bf16 steps of the largest value.
        torch.testing.assert_close(h_comp, h_plain, rtol=2e-2, atol=2e-2 * float(h_plain.abs().max()))
        torch.testing.assert_close(loss_comp, loss_plain, rtol=1e-2, atol=1e-3)
        for name, want in grads_plain.items():
            rel = float((grads_comp[name] - want).norm() / want.norm().clamp_min(1e-12))
            assert rel < 3e-2, f"grad of {name}: relative error {rel:.3g}"
        loss_and_grads(compiled, 384, seed=1)  # a second length: the graphs go dynamic here, at the latest
        graphs = counters["stats"]["unique_graphs"]
        for length in (448, 200, 1000):
            loss_and_grads(compiled, length, seed=length)
        assert counters["stats"]["unique_graphs"] == graphs > 0, dict(counters["stats"])
        assert not past_recompile_limit()
    finally:
        torch._dynamo.reset()
