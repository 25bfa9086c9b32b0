"""Reward-model folders as the peers save them, and the peers' own scoring of them, for tests of what fastrlhf reads
from them (``reward.model_kind``, ``reward.normalize: stored``).

OpenRLHF (github:OpenRLHF/OpenRLHF at 3c3be62): ``openrlhf/models/model.py`` ``_get_reward_model`` (the
``RewardModel`` class: the base model under its ``base_model_prefix`` plus a bias-free ``nn.Linear(hidden, 1)`` named
``value_head_prefix``, ``score`` by default; ``mean``/``std`` buffers read from config.json; the reward at the last
attended position, ``(r - mean) / std`` in eval mode when ``normalize_reward``); ``openrlhf/cli/train_rm.py`` (sets
``config.value_head_prefix`` before saving); ``openrlhf/trainer/rm_trainer.py`` ``evaluate`` (sets ``config.mean`` and
``config.std``); ``openrlhf/utils/deepspeed/deepspeed.py`` ``save_model`` (``save_pretrained`` with the state dict,
then ``config.to_json_file``).

TRL (github:huggingface/trl at f2cd577): ``trl/trainer/reward_trainer.py`` (an
``AutoModelForSequenceClassification`` of ``num_labels=1``; ``model.config.pad_token_id`` set to the tokenizer's pad
id, its eos where it has none, before training; saved by ``save_pretrained``); ``trl/trainer/grpo_trainer.py``
``_calculate_rewards`` (a reward model scores right-padded rows as ``reward_func(**inputs).logits[:, 0]``).
"""

import json
import os

import torch
from torch import nn


def openrlhf_reward_model_class(config):
    """OpenRLHF's ``RewardModel`` for ``config``'s architecture, as ``get_llm_for_sequence_regression`` builds it
    (``openrlhf/models/model.py``; packing and ring attention left out: the tests run padded rows)."""
    from transformers import AutoModel

    base_llm_model = AutoModel._model_mapping[type(config)]
    base_pretrained_model = base_llm_model.__base__
    value_head_prefix = getattr(config, "value_head_prefix", "score")

    class RewardModel(base_pretrained_model):
        supports_gradient_checkpointing = True

        def __init__(self, config):
            super().__init__(config)
            setattr(self, self.base_model_prefix, base_llm_model(config))
            self.value_head_prefix = value_head_prefix
            setattr(self, value_head_prefix, nn.Linear(config.hidden_size, 1, bias=False))
            self.normalize_reward = getattr(config, "normalize_reward", False)
            self.register_buffer("mean", torch.zeros(1), persistent=False)
            self.register_buffer("std", torch.ones(1), persistent=False)
            if hasattr(config, "mean"):
                self.mean[0] = config.mean
                self.std[0] = config.std
            self.post_init()

        def forward(self, input_ids, attention_mask):
            eos_indices = attention_mask.size(1) - 1 - attention_mask.long().fliplr().argmax(dim=1, keepdim=True)
            position_ids = attention_mask.long().cumsum(-1) - 1
            position_ids.masked_fill_(attention_mask == 0, 1)
            outputs = getattr(self, self.base_model_prefix)(input_ids, attention_mask=attention_mask,
                                                            position_ids=position_ids)
            values = getattr(self, self.value_head_prefix)(outputs["last_hidden_state"]).squeeze(-1)
            reward = values.gather(dim=1, index=eos_indices).squeeze(1)
            if not self.training and self.normalize_reward:
                reward = (reward - self.mean) / self.std
            return reward

    return RewardModel


def save_openrlhf_reward_model(path, config, value_head_prefix: str = "score", mean: float | None = None,
                               std: float | None = None, seed: int = 0) -> str:
    """A random OpenRLHF reward model of ``config``'s architecture saved in ``path`` as ``train_rm`` leaves it:
    ``config.json`` with ``value_head_prefix`` (and ``mean``/``std`` where given: its eval pass measured them), the
    weights under the RewardModel's own names (``model.*`` and ``<value_head_prefix>.weight``)."""
    config = type(config).from_dict(config.to_dict())
    config.normalize_reward = False  # train_rm's get_llm_for_sequence_regression default
    config.value_head_prefix = value_head_prefix  # train_rm.py: "Save value_head_prefix in config"
    torch.manual_seed(seed)
    model = openrlhf_reward_model_class(config)(config)
    with torch.no_grad():  # a head of scale 1, so that the scores differ by more than rounding
        getattr(model, value_head_prefix).weight.normal_(0.0, 1.0)
    if mean is not None:  # rm_trainer.evaluate
        model.config.mean, model.config.std = mean, std
    # deepspeed.py save_model (ZeRO <= 2): the state dict, then the config file
    model.save_pretrained(path, state_dict={k: v.clone() for k, v in model.state_dict().items()})
    model.config.to_json_file(os.path.join(path, "config.json"))
    return str(path)


def openrlhf_rewards(path, input_ids: torch.Tensor, attention_mask: torch.Tensor, normalize: bool) -> torch.Tensor:
    """OpenRLHF's rewards of a batch: the RL run loads the folder with its ``--reward.normalize_enable`` as
    ``normalize_reward`` (``get_llm_for_sequence_regression``: ``config.normalize_reward = normalize_reward``)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    config.normalize_reward = normalize
    model = openrlhf_reward_model_class(config).from_pretrained(path, config=config, dtype=torch.float32).eval()
    # The buffers as __init__ fills them from config.json: transformers 5 builds the model on the meta device, and the
    # non-persistent buffers came out of from_pretrained holding garbage (this transformers; OpenRLHF pins its own)
    model.mean.fill_(getattr(config, "mean", 0.0))
    model.std.fill_(getattr(config, "std", 1.0))
    with torch.no_grad():
        return model(input_ids, attention_mask)


def save_trl_reward_model(path, config, pad_token_id: int | None, seed: int = 0) -> str:
    """A random one-label sequence classifier saved as TRL's RewardTrainer leaves it: ``pad_token_id``, the
    tokenizer's pad id (its eos where it has none), in the model's config before training."""
    from transformers import AutoModelForSequenceClassification

    fields = {k: v for k, v in config.to_dict().items() if k not in ("id2label", "label2id")}
    config = type(config).from_dict({**fields, "num_labels": 1})
    torch.manual_seed(seed)
    model = AutoModelForSequenceClassification.from_config(config)
    with torch.no_grad():
        model.score.weight.normal_(0.0, 1.0)
    model.config.pad_token_id = pad_token_id
    model.save_pretrained(path)
    return str(path)


def config_json(path) -> dict:
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)
