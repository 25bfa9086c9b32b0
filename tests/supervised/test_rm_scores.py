"""Where ``fastrlhf rm`` reads a sequence's score: at its last token, as the RL step reads the trained reward model
(``fastrlhf.rl.forward.reward_model_scores``), in both layouts, when that token is the pad id too."""

import pytest
import torch

from fastrlhf.modeling import use_attention
from fastrlhf.modeling.tiny import tiny_llama_config
from fastrlhf.supervised.reward_model import scores

PAD = EOS = 2  # a config without a pad id: the loader pads with the eos, which ends every scored chat row
SEQUENCES = [[5, 6, 7, EOS], [8, 9, EOS], [10, 11, 12, 13, 14]]


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_the_score_is_read_at_the_last_token_even_where_it_is_the_pad_id(packed):
    from transformers import LlamaForSequenceClassification

    torch.manual_seed(0)
    model = LlamaForSequenceClassification(tiny_llama_config(vocab_size=64, hidden_size=32, num_heads=1, num_labels=1,
                                                             pad_token_id=PAD, eos_token_id=EOS)).eval()
    with torch.no_grad():
        alone = torch.cat([model.score(model.model(input_ids=torch.tensor([s])).last_hidden_state[:, -1])
                           for s in SEQUENCES])
        use_attention(model, packed, backend="sdpa")
        got = scores(model, SEQUENCES, PAD, packed=packed)
        if not packed:  # transformers' own pooling skips a closing pad id: what this read before
            ids = torch.tensor([s + [PAD] * (5 - len(s)) for s in SEQUENCES])
            pooled = model(input_ids=ids, attention_mask=(torch.arange(5) < torch.tensor([4, 3, 5])[:, None]).long())
            assert not torch.allclose(pooled.logits[:2], alone[:2], atol=1e-3)
    torch.testing.assert_close(got, alone, rtol=1e-5, atol=1e-5)
