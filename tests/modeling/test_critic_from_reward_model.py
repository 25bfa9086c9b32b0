"""``critic.path`` at a reward model: PPO's critic starts from it, backbone and scalar head, as TRL and OpenRLHF
start theirs; its value at a sequence's last token is then the reward model's score of the sequence."""

import pytest
import torch

from fastrlhf.config import ModelConfig
from fastrlhf.modeling import load_sequence_classifier, load_value_model
from fastrlhf.modeling.tiny import save_tiny_llama, save_tiny_qwen2

SHAPE = dict(vocab_size=64, hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=48)


def reward_model_folder(tmp_path, arch: str, num_labels: int, shard: bool = False) -> str:
    """A causal LM folder, then a sequence classifier over it with a score head of its own, saved (as `fastrlhf rm`
    exports one)."""
    base = tmp_path / f"{arch}-lm"
    (save_tiny_llama if arch == "llama" else save_tiny_qwen2)(base, **SHAPE)
    classifier = load_sequence_classifier(ModelConfig(path=str(base), dtype="float32"), num_labels=num_labels)
    with torch.no_grad():
        classifier.score.weight.normal_(std=0.5, generator=torch.Generator().manual_seed(7))
    out = tmp_path / f"{arch}-rm{num_labels}"
    classifier.save_pretrained(out, **({"max_shard_size": "20KB"} if shard else {}))
    return str(out)


@pytest.mark.parametrize("arch, shard", [("llama", False), ("qwen2", False), ("llama", True)],
                         ids=["llama", "qwen2-tied", "llama-sharded"])
def test_a_one_label_reward_model_starts_the_critic_whose_last_value_is_its_score(tmp_path, arch, shard):
    from transformers import AutoModelForSequenceClassification

    folder = reward_model_folder(tmp_path, arch, num_labels=1, shard=shard)
    if shard:
        assert (tmp_path / "llama-rm1" / "model.safetensors.index.json").exists()
    rm = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    critic = load_value_model(ModelConfig(path=str(tmp_path / f"{arch}-lm"), dtype="float32"), folder).eval()
    torch.testing.assert_close(critic.v_head.weight.detach(), rm.score.weight.detach())
    assert float(critic.v_head.bias.detach().abs().max()) == 0.0  # the score layer has no bias
    ids = torch.randint(3, 64, (3, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        values = critic(ids)
        scores = rm(input_ids=ids).logits[:, 0]
    torch.testing.assert_close(values[:, -1], scores, rtol=1e-5, atol=1e-5)
    assert float(scores.abs().max()) > 0.1  # a head that scores, not one near zero


def test_a_classifier_of_several_labels_gives_its_backbone_and_a_fresh_head(tmp_path):
    folder = reward_model_folder(tmp_path, "llama", num_labels=3)
    critic = load_value_model(ModelConfig(path=folder, dtype="float32"), folder)
    fresh = load_value_model(ModelConfig(path=str(tmp_path / "llama-lm"), dtype="float32"))
    # The fresh head's small init (std 1 / (hidden + 1)), not one of the classifier's rows (std 0.5).
    assert float(critic.v_head.weight.detach().std()) < 0.1 and not critic.v_head.bias.detach().any()
    from transformers import AutoModelForSequenceClassification

    backbone = AutoModelForSequenceClassification.from_pretrained(folder).model.state_dict()
    mine = critic.lm.model.state_dict()
    assert mine.keys() == backbone.keys()
    assert all(torch.equal(mine[k], backbone[k]) for k in mine)
    assert fresh.v_head.weight.shape == critic.v_head.weight.shape
