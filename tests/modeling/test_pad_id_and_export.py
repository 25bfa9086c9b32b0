"""A model whose config.json lists several eos ids (Llama-3's) pads with the first; the export replaces ``final/``
without a moment where neither the old nor the new folder is whole."""

import json
import os

import pytest
import torch

from fastrlhf.config import ModelConfig
from fastrlhf.modeling import export_hf, load_sequence_classifier
from fastrlhf.modeling.loading import pad_token_id
from fastrlhf.modeling.tiny import make_tiny_llama, save_tiny_llama

SHAPE = dict(vocab_size=64, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=48)


def test_a_classifier_over_a_model_with_a_list_of_eos_ids_pads_with_the_first(tmp_path):
    save_tiny_llama(tmp_path, **SHAPE)
    config = json.loads((tmp_path / "config.json").read_text())
    config.update(pad_token_id=None, eos_token_id=[5, 3])
    (tmp_path / "config.json").write_text(json.dumps(config))
    model = load_sequence_classifier(ModelConfig(path=str(tmp_path), dtype="float32"), num_labels=1)
    assert model.config.pad_token_id == 5
    ids = torch.tensor([[7, 8, 9], [7, 8, 5]])
    assert model(input_ids=ids).logits.shape == (2, 1)  # a batch pools by the pad id


@pytest.mark.parametrize("ids, expected", [
    (dict(pad_token_id=4, eos_token_id=[5, 3]), 4),
    (dict(pad_token_id=None, eos_token_id=[5, 3]), 5),
    (dict(pad_token_id=None, eos_token_id=[], bos_token_id=[6]), 6),
    (dict(pad_token_id=None, eos_token_id=None, bos_token_id=None), 0),
])
def test_pad_token_id(ids, expected):
    from types import SimpleNamespace

    assert pad_token_id(SimpleNamespace(**ids)) == expected


def test_an_export_that_fails_to_put_the_new_folder_in_place_keeps_the_old_one(tmp_path, monkeypatch):
    out = str(tmp_path / "final")
    export_hf(make_tiny_llama(seed=0, **SHAPE), out)
    before = (tmp_path / "final" / "model.safetensors").read_bytes()
    rename = os.rename

    def killed_before_the_new_folder_lands(src, dst):
        if str(src).endswith("final.tmp"):
            raise OSError(5, "Input/output error")
        rename(src, dst)

    monkeypatch.setattr(os, "rename", killed_before_the_new_folder_lands)
    with pytest.raises(OSError, match="Input/output error"):  # the injected failure, not another one
        export_hf(make_tiny_llama(seed=1, **SHAPE), out)
    assert (tmp_path / "final" / "model.safetensors").read_bytes() == before
    monkeypatch.setattr(os, "rename", rename)
    export_hf(make_tiny_llama(seed=1, **SHAPE), out)
    assert (tmp_path / "final" / "model.safetensors").read_bytes() != before
    assert sorted(os.listdir(tmp_path)) == ["final"]  # no final.tmp or final.old left beside it
