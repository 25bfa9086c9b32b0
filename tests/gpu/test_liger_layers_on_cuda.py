"""``model.liger_kernels`` on CUDA: Liger-Kernel's RMSNorm, SwiGLU and rotary kernels in a Qwen2 of the 1.5B's
hidden sizes (two layers, bf16), against the same weights in transformers' own layers: the hidden states, and
fastrlhf's fused GRPO loss on them with its gradients in every weight. Liger's kernels cannot run under the
Triton interpreter (its RMSNorm casts a Python float), so this test has no CPU half; its wiring (which loaders
hand which model over, with which flags) is tests/modeling/test_liger_layers.py's, on the CPU."""

import importlib.util

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: run `make test-gpu`"),
              pytest.mark.skipif(importlib.util.find_spec("liger_kernel") is None,
                                 reason="needs liger-kernel (the gpu-bench extra)")]

SHAPE = dict(vocab_size=151_936, hidden_size=1536, num_layers=2, num_heads=12, num_kv_heads=2,
             intermediate_size=8960, max_position_embeddings=2048)


def loss_and_grads(model, ids, labels, adv, mask):
    from fastrlhf.kernels import fused_linear_policy_loss

    hidden = model.model(input_ids=ids).last_hidden_state
    loss, _ = fused_linear_policy_loss(hidden, model.lm_head.weight, labels, None, adv, mask, kl_coef=0.0)
    loss.backward()
    grads = {name: p.grad.float() for name, p in model.named_parameters()}
    return hidden.detach().float(), loss.detach(), grads


def test_liger_layers_match_transformers_layers(monkeypatch):
    from transformers.models.qwen2 import modeling_qwen2

    from fastrlhf.modeling.loading import apply_liger_layers
    from fastrlhf.modeling.tiny import make_qwen2_on

    # Liger replaces these for the whole process: restored after this test, so no later test gets its layers.
    for name in ("apply_rotary_pos_emb", "Qwen2RMSNorm", "Qwen2MLP"):
        monkeypatch.setattr(modeling_qwen2, name, getattr(modeling_qwen2, name))
    plain = make_qwen2_on("cuda", torch.bfloat16, seed=0, **SHAPE)
    liger = make_qwen2_on("cuda", torch.bfloat16, seed=0, **SHAPE)
    liger.load_state_dict(plain.state_dict())
    apply_liger_layers(liger)
    assert type(liger.model.layers[0].mlp).__name__ == "LigerSwiGLUMLP"
    g = torch.Generator(device="cuda").manual_seed(0)
    ids = torch.randint(0, SHAPE["vocab_size"], (4, 512), device="cuda", generator=g)
    labels = torch.roll(ids, -1, dims=1)
    adv = torch.randn(4, 1, device="cuda", generator=g).expand(4, 512).contiguous()
    mask = torch.ones(4, 512, device="cuda")
    h_plain, loss_plain, grads_plain = loss_and_grads(plain, ids, labels, adv, mask)
    h_liger, loss_liger, grads_liger = loss_and_grads(liger, ids, labels, adv, mask)
    # bf16 layers computed in another order: within a few bf16 steps of the largest value.
    torch.testing.assert_close(h_liger, h_plain, rtol=2e-2, atol=2e-2 * float(h_plain.abs().max()))
    torch.testing.assert_close(loss_liger, loss_plain, rtol=1e-2, atol=1e-3)
    for name, want in grads_plain.items():
        got = grads_liger[name]
        rel = float((got - want).norm() / want.norm().clamp_min(1e-12))
        assert rel < 3e-2, f"grad of {name}: relative error {rel:.3g}"
