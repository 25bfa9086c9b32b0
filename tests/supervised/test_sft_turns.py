"""SFT on a chat's every assistant turn: the tokens between turns are read, not trained, in the padded and
the packed layout, with the fused head and without; each equal to the log-likelihood summed by hand."""

import pytest
import torch

from fastrlhf.config import ModelConfig, SFTConfig, SFTDataConfig, SFTTrainerConfig
from fastrlhf.data import SFTExample
from fastrlhf.modeling import use_attention
from fastrlhf.modeling.tiny import make_tiny_llama
from fastrlhf.supervised import sft

VOCAB = 48


def examples():
    g = torch.Generator().manual_seed(1)

    def ids(n):
        return torch.randint(3, VOCAB, (n,), generator=g).tolist()

    return [SFTExample(ids(3), ids(7), [1, 1, 0, 0, 0, 1, 1]),  # two turns with a user turn between them
            SFTExample(ids(2), ids(4)),  # one turn: every response token
            SFTExample([], ids(5), [1, 0, 0, 1, 1])]  # no prompt: nothing predicts the first token


def by_hand(model, example):
    """Sum over trained response tokens of log p(token | everything before it), one sequence at a time."""
    mask = [1] * len(example.response_ids) if example.response_mask is None else example.response_mask
    ids = torch.tensor([example.prompt_ids + example.response_ids])
    with torch.no_grad():
        logprobs = torch.log_softmax(model(input_ids=ids).logits[0].double(), -1)
    p = len(example.prompt_ids)
    return sum(logprobs[p + i - 1, t].item() for i, (t, m) in enumerate(zip(example.response_ids, mask, strict=True))
               if m and p + i > 0)


@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("fused", [False, True], ids=["plain", "fused"])
def test_sft_loss_trains_only_the_masked_in_tokens(packing, fused):
    model = make_tiny_llama(seed=2, vocab_size=VOCAB, hidden_size=32, num_layers=2, num_heads=1).eval()
    batch = examples()
    want = -sum(by_hand(model, e) for e in batch)
    config = SFTConfig(output_dir="unused", model=ModelConfig(path="unused", attention="sdpa"),
                       data=SFTDataConfig(path="unused"),
                       trainer=SFTTrainerConfig(max_steps=1, packing=packing, fused_loss=fused, loss_chunk_size=4))
    use_attention(model, packing, backend="sdpa")
    job = sft.build_job(config, model, batch)
    with torch.no_grad():
        loss, metrics = job.loss_fn(model, batch, 1.0)
    assert loss.item() == pytest.approx(want, rel=1e-4)
    # 2 + 2 trained tokens, 4, and 2 of the third (its first token has nothing before it).
    assert metrics == {"response_tokens": 10.0}
    assert [job.weight_of(e) for e in batch] == [4, 4, 2]
    # Reading the whole response instead would change the loss: the mask has power here.
    unmasked = [SFTExample(e.prompt_ids, e.response_ids) for e in batch]
    with torch.no_grad():
        assert sft.build_job(config, model, unmasked).loss_fn(model, unmasked, 1.0)[0].item() > want + 1.0


def test_collate_puts_the_turn_mask_under_the_response():
    batch = sft.collate_sft([SFTExample([3, 4], [5, 6, 7], [1, 0, 1]), SFTExample([8], [9])], pad_id=0)
    assert batch["loss_mask"].tolist() == [[0, 0, 1, 0, 1], [0, 1, 0, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]
