"""The masks a padded or unpadded forward is given (``fastrlhf.sequences.masks``) give the outputs transformers' own
masks give: causal, padding keys masked, sliding windows kept; and each model gets the route it can take without a
device read. Compared at real tokens (a padding query attends to itself here, not in transformers' masks)."""

import pytest
import torch

from fastrlhf.modeling import CausalLMWithValueHead
from fastrlhf.modeling.tiny import make_tiny_llama, make_tiny_qwen2
from fastrlhf.rl.forward import attention_mask_for
from fastrlhf.sequences import masks

VOCAB = 97


def make(family, attention="sdpa", **kw):
    if family == "llama":
        return make_tiny_llama(seed=3, vocab_size=VOCAB, num_layers=2, hidden_size=64, num_heads=2,
                               attn_implementation=attention, **kw)
    if family == "mistral":  # every layer slides
        from transformers import MistralConfig, MistralForCausalLM

        torch.manual_seed(3)
        config = MistralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                               num_attention_heads=2, num_key_value_heads=1, attn_implementation=attention, **kw)
        return MistralForCausalLM(config).eval()
    return make_tiny_qwen2(seed=3, vocab_size=VOCAB, num_layers=2, hidden_size=64, num_heads=2,
                           attn_implementation=attention, **kw)


def rows(padded: bool, length: int = 11):
    ids = torch.randint(3, VOCAB, (3, length), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    if padded:
        mask[0, :4] = 0  # a left-padded prompt
        mask[2, -3:] = 0  # a short completion
    return ids, mask


def hidden(model, ids, mask, given):
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        return model.get_decoder()(input_ids=ids, attention_mask=given, position_ids=positions).last_hidden_state


def same_at_real_tokens(got, want, mask):
    real = mask.bool()
    torch.testing.assert_close(got[real], want[real], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("padded", [True, False], ids=["padded", "unpadded"])
def test_each_model_gets_the_route_it_can_take_without_a_read(family, padded):
    """With padding: the causal mask, padding keys masked. Without: Qwen2 (masks taken prepared) None per layer
    type, sdpa's causal kernels; Llama the causal mask; eager (causal only through its mask) transformers' masks."""
    ids, mask = rows(padded)
    for attention in ("sdpa", "eager"):
        model = make(family, attention)
        given = attention_mask_for(model, mask, padded)
        if attention == "eager":
            assert given is (mask if padded else None)
        elif family == "qwen2" and not padded:
            assert given == {"full_attention": None}
        else:
            assert given.shape == (3, 1, 11, 11) and given.dtype == torch.bool
        same_at_real_tokens(hidden(model, ids, mask, given), hidden(model, ids, mask, mask), mask)
    # A value-head critic is read through to its decoder.
    critic = CausalLMWithValueHead(make(family))
    given = attention_mask_for(critic, mask, padded)
    assert isinstance(given, dict if family == "qwen2" and not padded else torch.Tensor)


@pytest.mark.parametrize("padded", [True, False], ids=["padded", "unpadded"])
def test_a_sliding_window_shorter_than_the_rows_is_kept(padded):
    """Mistral (every layer slides): the windowed mask. Qwen2 with its first layer full and the second sliding
    (layer types, masks taken prepared): one mask per type. A window the rows fit in changes nothing."""
    ids, mask = rows(padded)
    mistral = make("mistral", sliding_window=4)
    given = attention_mask_for(mistral, mask, padded)
    assert given.shape == (3, 1, 11, 11) and not given[1, 0, 10, 6] and given[1, 0, 10, 7]
    same_at_real_tokens(hidden(mistral, ids, mask, given), hidden(mistral, ids, mask, mask), mask)
    assert not torch.equal(given, masks.padded_causal_mask(mask))  # the window matters at this length

    qwen2 = make("qwen2", use_sliding_window=True, sliding_window=4, max_window_layers=1)
    assert masks.sliding_window(qwen2.config) == (4, False)
    given = attention_mask_for(qwen2, mask, padded)
    assert set(given) == {"full_attention", "sliding_attention"}
    same_at_real_tokens(hidden(qwen2, ids, mask, given), hidden(qwen2, ids, mask, mask), mask)

    wide = make("mistral", sliding_window=64)
    assert masks.sliding_window(wide.config) == (64, True)
    given = attention_mask_for(wide, mask, padded)
    assert torch.equal(given, masks.padded_causal_mask(mask))
    same_at_real_tokens(hidden(wide, ids, mask, given), hidden(wide, ids, mask, mask), mask)


def test_mixed_layers_on_a_decoder_that_takes_one_mask_get_transformers_masks(monkeypatch):
    """A decoder with full and sliding layers that takes one mask for all: the 2D mask, from which transformers
    builds both (it reads the device for that: a correct forward first)."""
    ids, mask = rows(True)
    qwen2 = make("qwen2", use_sliding_window=True, sliding_window=4, max_window_layers=1)
    monkeypatch.setattr(masks, "_takes_prepared_masks", lambda cls: False)
    assert attention_mask_for(qwen2, mask) is mask
    assert attention_mask_for(qwen2, mask[:, :4], True).shape == (3, 1, 4, 4)  # within the window: one mask


def test_the_window_is_transformers_sliding_window_overlay():
    from transformers.masking_utils import sliding_window_overlay

    overlay = sliding_window_overlay(3)
    got = masks.padded_causal_mask(torch.ones(1, 7, dtype=torch.long), window=3)[0, 0]
    want = torch.tensor([[overlay(0, 0, q, k) and k <= q for k in range(7)] for q in range(7)])
    assert torch.equal(got, want)
