"""fastrlhf.distributed.multinode without a second node: the start gate between threads of one process (rank 0 serves
the store, rank 1 is a client, as on two nodes), node identity from each launcher's variables, and the
lost-peer lines made from gloo's own messages. The two-node runs are in tests/distributed/test_multinode.py."""

import threading
import time

import pytest

from fastrlhf.distributed import free_port, multinode


@pytest.fixture
def rendezvous(monkeypatch):
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    for name in ("CROSS_RANK", "CROSS_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "TORCHELASTIC_USE_AGENT_STORE"):
        monkeypatch.delenv(name, raising=False)
    yield
    multinode.release_gate_store()


def gate_on_two_ranks(failures=(None, None), timeout_s=20.0, ranks=(0, 1)):
    """Each rank in ``ranks`` passes the gate in its own thread; returns {rank: exception or None}."""
    results = {}

    def rank_thread(rank):
        try:
            multinode.start_gate(failures[rank], timeout_s=timeout_s, rank=rank, world=2)
            results[rank] = None
        except Exception as exc:  # noqa: BLE001 -- the test looks at what each rank raised
            results[rank] = exc

    threads = [threading.Thread(target=rank_thread, args=(r,)) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=timeout_s + 30)
        assert not t.is_alive(), "the gate did not return"
    return results


def test_every_rank_passes_when_every_rank_passed_its_checks(rendezvous):
    assert gate_on_two_ranks() == {0: None, 1: None}


def test_a_rank_that_failed_its_checks_stops_the_others_with_its_line(rendezvous):
    line = "config error: model.path: path does not exist: /data/model"
    started = time.monotonic()
    results = gate_on_two_ranks(failures=(None, line))
    assert time.monotonic() - started < 10  # at once, not after the 20 s timeout
    assert results[1] is None  # the failing rank says its own line itself (fastrlhf.cli)
    assert isinstance(results[0], multinode.PeerFailedChecks) and results[0].exit_code == 2
    assert str(results[0]).startswith(f"{line} (on rank 1 on node 0 (host ")


def test_rank_0_failing_holds_the_store_until_the_others_have_read_it(rendezvous):
    line = "data error: prompts.jsonl:3: empty prompt"
    results = gate_on_two_ranks(failures=(line, None))
    assert results[0] is None
    assert isinstance(results[1], multinode.PeerFailedChecks) and str(results[1]).startswith(f"{line} (on rank 0")


def test_a_rank_that_never_comes_stops_rank_0_after_the_timeout(rendezvous):
    started = time.monotonic()
    results = gate_on_two_ranks(timeout_s=1.0, ranks=(0,))
    assert 1.0 <= time.monotonic() - started < 10
    assert isinstance(results[0], multinode.StartTimeout)
    assert str(results[0]).startswith("distributed error: rank(s) 1 of 2 did not start within 1 s")


def test_rank_1_without_a_rank_0_gives_up_after_the_timeout(rendezvous):
    results = gate_on_two_ranks(timeout_s=1.0, ranks=(1,))
    assert isinstance(results[1], multinode.StartTimeout)
    assert "could not reach the rendezvous at 127.0.0.1:" in str(results[1])


def test_one_rank_needs_no_gate(monkeypatch):
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    multinode.start_gate(timeout_s=0.1, rank=0, world=1)  # no store to reach: it must not try


@pytest.mark.parametrize("launcher, env, nodes, node", [
    ("deepspeed --no_ssh, node 1 of 2", {"CROSS_RANK": "1", "CROSS_SIZE": "2", "LOCAL_SIZE": "1"}, 2, 1),
    ("torchrun, node 2 of 3", {"GROUP_RANK": "2", "GROUP_WORLD_SIZE": "3", "LOCAL_WORLD_SIZE": "4"}, 3, 2),
    ("deepspeed, one node", {"LOCAL_SIZE": "2"}, 1, 0),
    ("WORLD_SIZE without a launcher", {}, 1, 0),
])
def test_node_identity_comes_from_the_launcher(monkeypatch, launcher, env, nodes, node):
    for name in ("CROSS_RANK", "CROSS_SIZE", "LOCAL_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert (multinode.num_nodes(), multinode.node_rank(), multinode.is_multi_node()) == (nodes, node, nodes > 1)


@pytest.mark.parametrize("message, line", [
    ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
     "[10.231.0.2]:56001. This is typically caused by a remote worker crashing.",
     "Connection closed by peer [10.231.0.2]:56001"),
    ("[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 30000ms "
     "for recv operation to complete", "Timed out waiting 30000ms for recv operation to complete"),
])
def test_a_lost_peer_is_one_line_from_the_gloo_message(monkeypatch, message, line):
    import torch.distributed as dist

    assert multinode.lost_peer_reason(RuntimeError(message)) is None  # no process group: not a lost peer
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    assert multinode.lost_peer_reason(RuntimeError(message)) == line
    assert multinode.lost_peer_reason(RuntimeError("size mismatch for weight")) is None
    assert multinode.lost_peer_reason(ValueError(message)) is None
