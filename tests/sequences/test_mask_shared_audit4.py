"""One FlexAttention block mask per packed layout and batch, read by every model that runs it.

Under ``model.attention: flex`` the actor's old logprobs, the reference, the critic and each epoch's actor and critic
updates each built their own block mask for the same micro-batch (host time growing with the row, copies and kernels
on a GPU): a tiny packed PPO step built 42 masks for 8 layouts. Now the batch holds them
(``Experience.block_masks``), keyed by what the mask is a function of, and they go with the batch.
"""

import gc
import weakref

import pytest
import torch
from helpers.flexmask_ppo import count_builds, flex_on_cpu, ppo_step

from fastrlhf.rl.experience import build_experience
from fastrlhf.rollout import Completion
from fastrlhf.sequences import packed_attention
from fastrlhf.sequences.packed_attention import LazyBlockMask, SharedBlockMasks
from fastrlhf.sequences.packing import PackedLayout


def layout_kwargs(prompts, completions, shared, groups=None):
    return PackedLayout.build(prompts, completions, prompt_groups=groups).model_kwargs(shared)


def test_a_packed_ppo_step_builds_each_layout_once_with_the_same_results(monkeypatch):
    """Actor, reference and critic, two PPO epochs: every layout is built once (it was 42 builds for 8 layouts),
    and the logprobs, values and trained weights are those of a batch that shares nothing."""
    flex_on_cpu(monkeypatch)
    built = count_builds(monkeypatch)
    monkeypatch.setattr(packed_attention, "SHARED_MASK_BYTES", 0)  # nothing held: a mask per model, as before
    _, want, actor_want, critic_want = ppo_step(old_logprobs="recompute")
    unshared = len(built)
    monkeypatch.undo()
    flex_on_cpu(monkeypatch)
    built = count_builds(monkeypatch)
    keys = []
    real_get = SharedBlockMasks.get
    monkeypatch.setattr(
        SharedBlockMasks, "get", lambda self, s, n, *a: keys.append((tuple(s), n)) or real_get(self, s, n, *a)
    )
    _, got, actor, critic = ppo_step(old_logprobs="recompute")
    assert len(built) == len(set(keys)) < unshared, (len(built), len(set(keys)), unshared)
    for name in ("old_logprobs", "ref_logprobs", "values"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    for model, reference in ((actor, actor_want), (critic, critic_want)):
        for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
            assert torch.equal(p, q), name


def test_models_of_one_micro_batch_read_one_mask_and_other_layouts_their_own():
    shared = SharedBlockMasks()
    a, b = (layout_kwargs([3, 2], [2, 1], shared)["attention_mask"] for _ in range(2))
    assert isinstance(a, LazyBlockMask) and a is not b and a._mask is None  # still lazy: sdpa never builds it
    assert a.built() is b.built() and len(shared) == 1
    # The same bounds, the second sequence seeing a prefix: another mask (token 6 sees token 1 there only).
    plain, prefixed = [(0, 5, 0, 0), (5, 8, 5, 5)], [(0, 5, 0, 0), (5, 8, 0, 3)]
    c, d = shared.get(plain, 8, "cpu"), shared.get(prefixed, 8, "cpu")
    assert c is a.built() and d is not c and len(shared) == 2
    q, kv = torch.tensor(6), torch.tensor(1)
    assert not c.mask_mod(0, 0, q, kv) and d.mask_mod(0, 0, q, kv)
    want = packed_attention.block_mask([(0, 5, 0, 0), (5, 8, 5, 5)], 8, "cpu")
    assert torch.equal(a.to_dense(), want.to_dense()) and torch.equal(a.kv_indices, want.kv_indices)
    # Without a batch's masks (a layout used on its own), each mask is its own, as before.
    e, f = (layout_kwargs([3, 2], [2, 1], None)["attention_mask"] for _ in range(2))
    assert e.built() is not f.built() and torch.equal(e.to_dense(), a.to_dense())


def test_the_key_holds_device_and_tile(monkeypatch):
    shared, built = SharedBlockMasks(), count_builds(monkeypatch)
    segments = [(0, 300, 0, 0), (300, 400, 300, 300)]
    first = shared.get(segments, 400, "cpu")
    assert shared.get(segments, 400, torch.device("cpu")) is first
    assert shared.get(segments, 400, "meta") is not first and shared.get(segments, 400, "cpu", block=64) is not first
    assert len(built) == 3 and len(shared) == 3


def test_the_masks_go_with_the_batch_and_stay_under_the_budget():
    """Every batch taken from a step's batch holds its masks, a new batch has none, and they are freed with it."""
    completions = [
        [Completion([7, 8, 9], [0.0] * 3, "stop"), Completion([7], [0.0], "stop")],
        [Completion([5, 6], [0.0] * 2, "stop")],
    ]
    exp = build_experience([[3, 4], [5, 6, 7]], completions, 0)
    assert exp.select([0, 2]).trimmed().block_masks is exp.block_masks
    assert build_experience([[3, 4]], completions[:1], 0).block_masks is not exp.block_masks
    mask = exp.select([0, 2]).packed_layout().model_kwargs(exp.block_masks)["attention_mask"].built()
    assert len(exp.block_masks) == 1 and exp.block_masks.held == packed_attention._mask_bytes(mask) > 0
    gone = weakref.ref(mask)
    del exp, mask
    gc.collect()
    assert gone() is None
    small = SharedBlockMasks(budget=1)  # over its budget: built for each use, none held
    assert small.get([(0, 4, 0, 0)], 4, "cpu") is not small.get([(0, 4, 0, 0)], 4, "cpu")
    assert len(small) == 0 and small.held == 0


@pytest.mark.parametrize("share", [False, True])
def test_compiled_flex_compiles_no_more_for_a_shared_mask(share, monkeypatch):
    """The flex backend's compiled FlexAttention (CUDA only in a run; aot_eager here) given the shared mask by two
    models of other head counts, over micro-batches of several layouts: the graphs of unshared masks, nothing more."""
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch.nn.attention.flex_attention import flex_attention

    flex_on_cpu(monkeypatch)
    torch._dynamo.reset()
    try:
        backend = CompileCounterWithBackend("aot_eager")
        fn = torch.compile(flex_attention, backend=backend, dynamic=True)
        shared, g = SharedBlockMasks(), torch.Generator().manual_seed(0)
        for lens in ([4, 5], [4, 5], [6, 2, 3], [9, 1, 1, 2]):
            mask = layout_kwargs([3] * len(lens), lens, shared if share else None)["attention_mask"]
            for heads in (2, 4):
                q, k, v = (torch.randn(1, heads, mask.shape[-1], 8, generator=g) for _ in range(3))
                want = flex_attention(q, k, v, block_mask=packed_attention.block_mask(*mask._args))
                torch.testing.assert_close(fn(q, k, v, block_mask=mask.built()), want)
        assert backend.frame_count == 2  # static shapes, then dynamic: every later layout and model reuses them
        assert len(shared) == (3 if share else 0)
    finally:
        torch._dynamo.reset()
