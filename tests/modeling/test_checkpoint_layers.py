"""``model.checkpoint_layers``: under gradient checkpointing only the first N decoder layers recompute their forward in
the backward; the later ones keep their activations. The gradients are those of a model without checkpointing."""

import pytest
import torch

from fastrlhf.config.schema import ModelConfig
from fastrlhf.modeling.loading import load_causal_lm, load_value_model
from fastrlhf.modeling.tiny import make_tiny_llama

LAYERS = 4


def _forwards_per_layer(model, ids):
    """How often each decoder layer's forward ran for one forward + backward, and the gradients."""
    calls = [0] * LAYERS
    for i, layer in enumerate(model.model.layers):
        layer.register_forward_pre_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
    model.zero_grad(set_to_none=True)
    model(input_ids=ids, labels=ids).loss.backward()
    return calls, {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("checkpoint_layers", [None, 1, 3, LAYERS])
def test_the_first_layers_recompute_and_the_gradients_are_unchanged(tmp_path, checkpoint_layers):
    make_tiny_llama(vocab_size=64, hidden_size=32, num_heads=2, num_layers=LAYERS).save_pretrained(tmp_path)
    plain = load_causal_lm(ModelConfig(path=str(tmp_path), dtype="float32"))
    checkpointed = load_causal_lm(ModelConfig(path=str(tmp_path), dtype="float32", gradient_checkpointing=True,
                                              checkpoint_layers=checkpoint_layers))
    recomputed = LAYERS if checkpoint_layers is None else checkpoint_layers
    assert [layer.gradient_checkpointing for layer in checkpointed.model.layers] == \
        [i < recomputed for i in range(LAYERS)]
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(0))
    calls, grads = _forwards_per_layer(checkpointed, ids)
    assert calls == [2] * recomputed + [1] * (LAYERS - recomputed)
    plain_calls, want = _forwards_per_layer(plain, ids)
    assert plain_calls == [1] * LAYERS
    for name, grad in want.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-6, msg=name)


def test_a_model_with_fewer_layers_checkpoints_all_of_them(tmp_path):
    """A PPO critic from another folder may have fewer layers than the actor, whose count the config check holds
    ``checkpoint_layers`` to (tests/config): all of its layers recompute."""
    make_tiny_llama(vocab_size=64, hidden_size=32, num_heads=2, num_layers=2).save_pretrained(tmp_path)
    critic = load_value_model(ModelConfig(path="unused", gradient_checkpointing=True, checkpoint_layers=3),
                              str(tmp_path))
    assert [layer.gradient_checkpointing for layer in critic.lm.model.layers] == [True, True]
