"""fastrlhf.modeling.tied_gradient: a tied embedding and LM head get one [V, H] gradient, equal to autograd's sum.

What would go wrong unseen: a gradient lost (the head's handed over and never taken), the padding
row given the lookup's gradient, bf16 summed differently, or the memory saving gone (two [V, H]
gradients alive at once again, which only shows as peak RSS on a large vocabulary).
"""

from __future__ import annotations

import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from fastrlhf.modeling.tied_gradient import tied_gradient_handoff
from fastrlhf.modeling.tiny import make_tiny_llama, make_tiny_qwen2

VOCAB, HIDDEN = 97, 16


class TiedLM(torch.nn.Module):
    def __init__(self, padding_idx=None, dtype=torch.float32):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(VOCAB, HIDDEN, padding_idx=padding_idx, dtype=dtype)
        self.body = torch.nn.Linear(HIDDEN, HIDDEN, dtype=dtype)
        self.head = torch.nn.Linear(HIDDEN, VOCAB, bias=False, dtype=dtype)
        self.head.weight = self.embed.weight


def loss_of(model, ids, targets, head_weight=None):
    hidden = torch.tanh(model.body(model.embed(ids)))
    weight = model.head.weight if head_weight is None else head_weight()
    logits = torch.nn.functional.linear(hidden, weight).float()
    return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def grads(model, ids, targets, handoff):
    model.zero_grad(set_to_none=True)
    if handoff:
        with tied_gradient_handoff(model.embed, model.head) as head_weight:
            loss = loss_of(model, ids, targets, head_weight)
    else:
        loss = loss_of(model, ids, targets)
    loss.backward()  # after the context closed, as the trainer's backward runs after the forward
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("padding_idx", [None, 3])
def test_the_tied_weight_gets_the_sum_of_the_head_and_lookup_gradients(dtype, padding_idx):
    model = TiedLM(padding_idx, dtype)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (3, 11), generator=g)
    ids[0, :4] = 3  # repeated rows, and the padding row when padding_idx is 3
    targets = torch.randint(0, VOCAB, (3, 11), generator=g)
    got, want = grads(model, ids, targets, handoff=True), grads(model, ids, targets, handoff=False)
    assert got.keys() == want.keys() == {"embed.weight", "body.weight", "body.bias"}
    for name in want:
        assert got[name].dtype == want[name].dtype == dtype
        tol = dict(rtol=1e-5, atol=1e-7) if dtype == torch.float32 else dict(rtol=2e-2, atol=1e-4)
        torch.testing.assert_close(got[name], want[name], **tol, msg=lambda m, name=name: f"{name}: {m}")
    # The lookup's share is really in it: the head's gradient alone differs at the looked-up rows.
    model.zero_grad(set_to_none=True)
    with torch.no_grad():
        hidden = torch.tanh(model.body(model.embed(ids)))
    head_only = torch.autograd.grad(loss_of_hidden(hidden, model.head.weight, targets), model.head.weight)[0]
    looked_up = ids.unique()
    assert not torch.allclose(got["embed.weight"][looked_up], head_only[looked_up])
    if padding_idx is not None:  # as nn.Embedding: the padding row gets the head's gradient only
        torch.testing.assert_close(got["embed.weight"][padding_idx], head_only[padding_idx], **tol)


def loss_of_hidden(hidden, weight, targets):
    return torch.nn.functional.cross_entropy(torch.nn.functional.linear(hidden, weight).float().reshape(-1, VOCAB),
                                           targets.reshape(-1))


class LiveVocabTensors(TorchDispatchMode):
    """The most [V, H] buffers (other than the weight's own) that ops have produced and that are alive
    at one time."""

    def __init__(self, weight):
        super().__init__()
        self.weight_storage = weight.untyped_storage().data_ptr()
        self.live, self.most = [], 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and tuple(t.shape) == (VOCAB, HIDDEN):
                self.live.append(weakref.ref(t))
        self.live = [r for r in self.live if r() is not None]
        self.most = max(self.most, len({r().untyped_storage().data_ptr() for r in self.live} - {self.weight_storage}))
        return out


@pytest.mark.parametrize("handoff", [True, False])
def test_one_vocab_sized_gradient_is_alive_at_a_time(handoff):
    model = TiedLM()
    ids = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(2))
    if handoff:
        with tied_gradient_handoff(model.embed, model.head) as head_weight:
            loss = loss_of(model, ids, ids, head_weight)
    else:
        loss = loss_of(model, ids, ids)
    with LiveVocabTensors(model.embed.weight) as mode:
        loss.backward()
    # Without the handoff, autograd holds the head's gradient while the lookup builds its own (and
    # their sum, a third, where it cannot add in place).
    assert mode.most == 1 if handoff else mode.most >= 2


@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
def test_a_tied_qwen2_rl_update_gets_the_same_gradients_through_the_handoff(monkeypatch, packing):
    """The RL update (fused loss kernel, HF Qwen2 with tied embeddings, gradient checkpointing, the
    trainer's RLStep): the same gradients and metrics with the handoff as with autograd's sum."""
    import contextlib

    from helpers.packing_case import PAD, RecordingSGD, make_config, ragged_batch
    from helpers.packing_case import VOCAB as PACK_VOCAB

    import fastrlhf.rl.forward as forward
    from fastrlhf.modeling import use_attention
    from fastrlhf.rl.step import RLStep

    config = make_config("grpo", "token-mean", packing=packing, max_tokens_per_microbatch=14 if packing else None)

    def run(handoff):
        actor = make_tiny_qwen2(seed=0, vocab_size=PACK_VOCAB, hidden_size=64, num_heads=2).train()
        reference = make_tiny_qwen2(seed=1, vocab_size=PACK_VOCAB, hidden_size=64, num_heads=2)
        actor.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        assert actor.get_input_embeddings().weight is actor.get_output_embeddings().weight
        for model in (actor, reference):
            use_attention(model, packing, False)
        if not handoff:
            head = actor.get_output_embeddings()
            monkeypatch.setattr(forward, "tied_gradient_handoff",
                                lambda *_: contextlib.nullcontext(lambda: head.weight))
        opt = RecordingSGD(list(actor.named_parameters()), lr=0.5)
        prompts, completions = ragged_batch(seed=4)
        scores = torch.linspace(-1.0, 1.0, 12)
        rl = RLStep(config, actor, rollout=None, scorer=lambda exp, *a: scores.clone(), reference=reference,
                    actor_optimizer=opt, pad_token_id=PAD, rollout_shares_actor=True)
        metrics = rl(prompts, None, step=2, completions=completions)
        monkeypatch.undo()
        return metrics, opt.grads

    (got, got_grads), (want, want_grads) = run(True), run(False)
    assert got["optimizer_steps"] == want["optimizer_steps"] == 4.0
    for key in ("policy_loss", "grad_norm", "entropy", "kl"):
        assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), key
    assert len(got_grads) == len(want_grads) == 4
    for g, w in zip(got_grads, want_grads, strict=True):
        assert g.keys() == w.keys() and "model.embed_tokens.weight" in w
        for name in w:
            torch.testing.assert_close(g[name], w[name], rtol=1e-5, atol=1e-7, msg=lambda m, name=name: f"{name}: {m}")


def test_nothing_changes_where_the_weight_is_not_a_trained_tied_one():
    untied = make_tiny_llama(seed=0, vocab_size=64, hidden_size=32, num_heads=1)
    frozen = TiedLM()
    frozen.embed.weight.requires_grad_(False)
    for embed, head in ((untied.get_input_embeddings(), untied.get_output_embeddings()), (frozen.embed, frozen.head)):
        with tied_gradient_handoff(embed, head) as head_weight:
            assert "forward" not in vars(embed)  # the module's own forward, not the handoff's lookup
            assert head_weight() is head.weight


def test_a_head_without_a_lookup_and_a_lookup_without_the_head_keep_their_gradients():
    model = TiedLM()
    ids = torch.arange(5)
    hidden = torch.randn(5, HIDDEN)
    with tied_gradient_handoff(model.embed, model.head) as head_weight:
        loss = loss_of_hidden(hidden, head_weight(), ids)  # no lookup in this graph
    (got,) = torch.autograd.grad(loss, model.head.weight)
    (want,) = torch.autograd.grad(loss_of_hidden(hidden, model.head.weight, ids), model.head.weight)
    torch.testing.assert_close(got, want)
    with tied_gradient_handoff(model.embed, model.head) as head_weight:
        looked = model.embed(ids).square().sum()  # no head in this graph
    (got,) = torch.autograd.grad(looked, model.embed.weight)
    want = torch.zeros(VOCAB, HIDDEN)
    want[ids] = 2 * model.embed.weight.detach()[ids]
    torch.testing.assert_close(got, want)
