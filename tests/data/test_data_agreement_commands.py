"""Each command checks that every rank loaded the same data as its process group starts, before any model
loads (``fastrlhf.data.check_same_data``): a node with another copy of the data stops the run in seconds, not
after the models and the engine have loaded (or never, had nothing checked it)."""

import types

import pytest

from fastrlhf import distributed as D
from fastrlhf.rl import trainer
from fastrlhf.supervised import reward_model, sft


class Stop(Exception):
    pass


def record_order(monkeypatch, module, loader: str, agreement_in=None) -> list[str]:
    calls: list[str] = []
    monkeypatch.setattr(D, "init_distributed", lambda **kw: calls.append("group"))
    monkeypatch.setattr(agreement_in or module, "check_same_data", lambda: calls.append("agreement"))

    def load(*args, **kwargs):
        calls.append("model")
        raise Stop

    monkeypatch.setattr(module, loader, load)
    return calls


@pytest.mark.parametrize("module, loader", [(sft, "load_causal_lm"), (reward_model, "load_sequence_classifier")])
def test_supervised_commands_agree_on_the_data_before_the_model_loads(monkeypatch, module, loader):
    calls = record_order(monkeypatch, module, loader)
    monkeypatch.setattr(module, "load_examples", lambda config: [])
    monkeypatch.setattr(module, "load_eval_examples", lambda config: None)
    monkeypatch.setattr(module, "seed_everything", lambda seed: None)
    monkeypatch.setattr(module, "engine_config", lambda config: None)
    config = types.SimpleNamespace(seed=0, output_dir="unused", model=None, resolved_num_labels=1)
    with pytest.raises(Stop):
        module.run(config)
    assert calls == ["group", "agreement", "model"]


def test_rl_agrees_on_the_data_before_the_models_load(monkeypatch):
    import fastrlhf.data as data

    calls = record_order(monkeypatch, trainer, "build_rl_step", agreement_in=data)  # run() imports it locally
    prepared = types.SimpleNamespace(examples=[], tokenizer=None, plan=None, text_rewards=(), reward_tokenizer=None,
                                     toolbox=None)
    monkeypatch.setattr(trainer, "preflight", lambda config: prepared)
    monkeypatch.setattr(trainer, "_with_auto_decided", lambda config, plan: config)
    config = types.SimpleNamespace(trainer=types.SimpleNamespace(max_skipped_steps=3), output_dir="unused", seed=0)
    with pytest.raises(Stop):
        trainer.run(config)
    assert calls == ["group", "agreement", "model"]
