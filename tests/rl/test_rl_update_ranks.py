"""What the step computes over several ranks, with the second rank simulated (its values added by the collective):
the update's loss weights (``fastrlhf.rl.update.run_updates``: each rank divides by every rank's tokens together,
found in one collective on the device for the whole update; ``tests/algorithms`` checks that such weights average
to the whole batch's aggregate, ``tests/sequences/test_packing.py`` runs two real ranks under the launcher) and the
step's token means (``fastrlhf.rl.step_metrics``)."""

import pytest
import torch

from fastrlhf.distributed import comm
from fastrlhf.engine.guards import StepGuard
from fastrlhf.rl.experience import build_experience
from fastrlhf.rl.update import Minibatch, TorchLearner, run_updates
from fastrlhf.rollout import Completion

OTHER_RANK_TOKENS = 9.0  # the simulated rank's kept tokens in each minibatch


def _batch():
    completions = [[Completion([3, 4], [0.0, 0.0], "stop"), Completion([5], [0.0], "stop")],
                   [Completion([6, 7, 8], [0.0] * 3, "stop"), Completion([9, 10], [0.0] * 2, "stop")]]
    exp = build_experience([[1, 2], [1]], completions, 0)
    exp.advantages = torch.zeros_like(exp.response_mask)
    return exp


@pytest.mark.parametrize("averages", [True, False], ids=["averaging-learner", "torch-learner"])
def test_each_rank_divides_by_every_ranks_tokens(monkeypatch, averages):
    calls = []

    def all_reduce_(t, op="sum", group=None):
        if not t.is_floating_point():  # the guard's flags: the other rank agrees
            return t
        calls.append((t.clone(), op))
        return t.add_(OTHER_RANK_TOKENS)

    monkeypatch.setattr(comm, "world_size", lambda: 2)
    monkeypatch.setattr(comm, "all_reduce_", all_reduce_)
    weight = torch.nn.Parameter(torch.ones(()))
    learner = TorchLearner(torch.nn.Linear(1, 1), torch.optim.SGD([weight], lr=0.0), guard=StepGuard())
    learner.averages_ranks = averages  # a DeepSpeed engine averages its ranks' gradients; a lone module does not
    seen = []

    def loss_fn(module, mb):
        seen.append(mb.loss_weights.sum())
        return weight * mb.loss_weights.sum(), {}

    order = [Minibatch(torch.tensor([0, 1]), [[0, 1]]), Minibatch(torch.tensor([2, 3]), [[0], [1]])]
    run_updates(learner, _batch(), loss_fn, order, "token-mean")
    if not averages:  # each rank on its own: its own tokens
        assert calls == [] and [float(s) for s in seen] == pytest.approx([1.0, 0.6, 0.4])
        return
    (local, op), = calls  # one collective for the whole update
    assert op == "sum" and local.tolist() == [3.0, 5.0]
    # each minibatch's weights: its tokens over the mean of both ranks' (3 + 9) / 2 and (5 + 9) / 2
    assert [float(s) for s in seen] == pytest.approx([3 / 6, 3 / 7, 2 / 7])


def test_the_steps_token_means_weigh_each_rank_by_its_tokens(monkeypatch):
    """``kl`` (what the adaptive KL controller reads) over two ranks of 10 and 1,000 completion tokens: the mean
    over all their tokens, not the mean of the two ranks' means (0.30 here instead of 0.496)."""
    from types import SimpleNamespace

    from fastrlhf.rl.step_metrics import reduce_step_metrics

    def rank(tokens, kl):
        exp = SimpleNamespace(scores=torch.zeros(1), response_mask=torch.ones(1, tokens), batch_size=1)
        return exp, {"kl": torch.tensor(kl), "policy_loss": kl}

    times = {"generate": 1.0, "score": 1.0, "train": 1.0, "sync": 1.0}
    sent = []
    monkeypatch.setattr(comm, "all_reduce_", lambda t, op="sum", group=None: sent.append(t.clone()) or t)
    other_exp, other_local = rank(1000, 0.5)
    reduce_step_metrics(other_exp, other_local, times, 1, skipped=False, skipped_total=0, world=1)
    other = sent[0]  # what the other rank puts into the collectives
    monkeypatch.setattr(comm, "all_reduce_", lambda t, op="sum", group=None: t.add_(other) if op == "sum"
                        else torch.maximum(t, other, out=t))
    exp, local = rank(10, 0.1)
    metrics = reduce_step_metrics(exp, local, times, 1, skipped=False, skipped_total=0, world=2)
    assert metrics["kl"] == pytest.approx((0.1 * 10 + 0.5 * 1000) / 1010)
    assert metrics["policy_loss"] == pytest.approx(0.3)  # the others stay the mean of the ranks'
