"""The update's loss weights on several ranks (``fastrlhf.rl.update.run_updates``): each rank divides by every
rank's tokens together, found in one collective on the device for the whole update. The second rank is simulated
(its counts added by the collective); ``tests/algorithms`` checks that such weights average to the whole batch's
aggregate, and ``tests/sequences/test_packing.py`` runs two real ranks under the launcher."""

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
