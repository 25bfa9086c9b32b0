"""Several nodes: what a run on one host never shows, handled in one place.

- **The start gate.** Every command checks its config and data before the process group starts
  (one line, exit 2). On one host every rank sees the same files, so every rank fails alike. On
  several nodes a path may exist on node 0 only: node 1 fails its checks while node 0 would wait for
  it in the rendezvous until ``FASTRLHF_DIST_TIMEOUT``. So, before the process group, every rank
  passes a gate on the launcher's rendezvous store (``MASTER_ADDR:MASTER_PORT``, the store
  ``torch.distributed`` uses anyway): it posts "ok" or its error line and waits for every rank's
  word. One failed rank stops all of them at once (exit 2), rank 0 naming the rank and node that
  failed; a rank that never comes stops them after ``FASTRLHF_DIST_TIMEOUT`` with a line naming it.
- **One output_dir per job.** ``output_dir`` must be one folder every node sees at the same path (a
  shared filesystem): rank 0 writes the job's files there (``config.yaml``, ``metrics.jsonl``,
  ``eval/``, ``final/``, ``checkpoints/latest``), and every rank writes its own part of each
  checkpoint into the same ``checkpoints/.tmp-step-N/`` before rank 0 renames it. Nothing is written
  per node. :func:`check_shared_dir` proves it right after the process group starts, before any
  model loads: rank 0 writes a file there and every rank must read it back.
- **A lost peer.** A rank that dies closes its sockets, and its peers' next collective fails at once;
  a node that drops off the network (or a rank that hangs) fails it after ``FASTRLHF_DIST_TIMEOUT``.
  :func:`lost_peer_reason` recognises those errors so the command line can say so in one line, with
  the last complete checkpoint to resume from, instead of a traceback.

Node identity comes from the launcher: ``CROSS_RANK``/``CROSS_SIZE``/``LOCAL_SIZE`` (DeepSpeed) or
``GROUP_RANK``/``GROUP_WORLD_SIZE``/``LOCAL_WORLD_SIZE`` (torchrun). Importing this module needs no torch.
"""

from __future__ import annotations

import json
import os
import re
import socket
import time

__all__ = ["NodeError", "PeerFailedChecks", "StartTimeout", "NotShared", "node_rank", "num_nodes", "is_multi_node",
           "where", "start_gate", "timeout_problem", "dist_timeout_s", "check_shared_dir", "lost_peer_reason"]

GATE_POLL_S = 0.05


class NodeError(RuntimeError):
    """A failure of the job as a whole; ``str()`` is the line to print, ``exit_code`` the exit status,
    ``local``: this rank knows something rank 0 may not (print it on this node too)."""

    exit_code = 1
    local = False


class PeerFailedChecks(NodeError):
    """Another rank failed its checks before the start (its error line, and where it ran)."""

    exit_code = 2


class StartTimeout(NodeError):
    """A rank did not reach the start gate within the timeout (late, dead, or unreachable)."""


class NotShared(NodeError):
    """``output_dir`` is not one folder for every node."""

    exit_code = 2


def _env_int(*names: str) -> int | None:
    for name in names:
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value)
    return None


def launched_world() -> int:
    """WORLD_SIZE as the launcher set it (1 for a bare ``python -m fastrlhf``)."""
    return (_env_int("WORLD_SIZE") or 1) if "RANK" in os.environ else 1


def local_size() -> int | None:
    """The ranks on this node as the launcher says it (DeepSpeed: LOCAL_SIZE, torchrun: LOCAL_WORLD_SIZE), or None."""
    return _env_int("LOCAL_SIZE", "LOCAL_WORLD_SIZE")


def num_nodes() -> int:
    """The number of nodes of this launch (1 when the launcher does not say)."""
    nodes = _env_int("CROSS_SIZE", "GROUP_WORLD_SIZE")
    if nodes:
        return nodes
    local = local_size()
    return max(launched_world() // local, 1) if local else 1


def node_rank() -> int:
    return _env_int("CROSS_RANK", "GROUP_RANK") or 0


def is_multi_node() -> bool:
    return num_nodes() > 1


def where(rank: int | None = None, node: int | None = None, host: str | None = None) -> str:
    """``rank 1 on node 1 (host h)``: this rank's place, or the given one's."""
    rank = int(os.environ.get("RANK", "0")) if rank is None else rank
    node = node_rank() if node is None else node
    host = socket.gethostname() if host is None else host
    return f"rank {rank} on node {node} (host {host})"


def timeout_problem() -> str | None:
    """Why ``FASTRLHF_DIST_TIMEOUT`` cannot be used (not a number, or not above 0: every wait would time out at
    once, as "timed out after 0ms" from the rendezvous), or None."""
    value = os.environ.get("FASTRLHF_DIST_TIMEOUT")
    if value is None:
        return None
    try:
        if 0 < float(value) < float("inf"):  # "inf" overflows timedelta
            return None
    except ValueError:
        pass
    return f"config error: FASTRLHF_DIST_TIMEOUT: must be a number of seconds above 0, got {value!r}"


def dist_timeout_s(timeout_s: float | None = None) -> float:
    """``timeout_s``, else ``FASTRLHF_DIST_TIMEOUT`` (the default where it is unusable: see :func:`timeout_problem`)."""
    if timeout_s is not None:
        return float(timeout_s)
    from fastrlhf.distributed.ranks import DEFAULT_TIMEOUT_S

    if timeout_problem():  # the variable's own error line comes from init_distributed
        return float(DEFAULT_TIMEOUT_S)
    return float(os.environ.get("FASTRLHF_DIST_TIMEOUT", DEFAULT_TIMEOUT_S))


# Rank 0's gate store, kept until the process group starts: torch's rendezvous then reuses its server
# (both are multi-tenant TCPStores on MASTER_PORT) instead of binding the port a second time.
_held_store = None


def release_gate_store() -> None:
    global _held_store
    _held_store = None


def _open_store(rank: int, timeout_s: float):
    from datetime import timedelta

    from torch.distributed import TCPStore

    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    # Under torchrun the elastic agent already serves the store on MASTER_PORT: every rank is a client.
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    is_server = rank == 0 and not agent_store
    try:
        return TCPStore(addr, port, None, is_server, timedelta(seconds=timeout_s), wait_for_workers=False,
                        multi_tenant=True), is_server
    except Exception as exc:  # noqa: BLE001 -- torch raises DistStoreError, RuntimeError or OSError here
        error = StartTimeout(f"distributed error: {where(rank)} could not reach the rendezvous at {addr}:{port} within "
                             f"{timeout_s:.0f} s (FASTRLHF_DIST_TIMEOUT): node 0 failed, never started, or is not "
                             f"reachable from this node ({_first_line(exc)})")
        error.local = True  # only this node knows: rank 0, which would say it, is the one it cannot reach
        raise error from None


def start_gate(failure: str | None = None, timeout_s: float | None = None, rank: int | None = None,
               world: int | None = None) -> None:
    """Agree, before the process group starts, that every rank passed its checks.

    ``failure``: this rank's error line (it then tells the others and returns once they know, or
    after the timeout). Without it, returns when every rank has posted "ok"; raises
    :class:`PeerFailedChecks` when a rank posted a failure, :class:`StartTimeout` when one never came.
    ``rank``/``world``: the launcher's (``RANK``, ``WORLD_SIZE``) unless given. A no-op outside a
    launch of several ranks.
    """
    global _held_store
    world = launched_world() if world is None else world
    if world <= 1:
        return
    rank = int(os.environ["RANK"]) if rank is None else rank
    timeout_s = dist_timeout_s(timeout_s)
    store, is_server = _open_store(rank, timeout_s)
    prefix = f"fastrlhf/gate/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"
    keys = [f"{prefix}rank-{r}" for r in range(world)]
    failed_key = prefix + "failed"
    if failure is not None:
        # Before this rank's own key: whoever sees every key also sees the failure.
        store.set(failed_key, json.dumps({"where": where(rank), "message": failure}))
    store.set(keys[rank], "failed" if failure is not None else "ok")

    def posted_failure():
        return json.loads(store.get(failed_key)) if store.check([failed_key]) else None

    deadline = time.monotonic() + timeout_s
    peer = None
    try:
        while True:
            peer = posted_failure()
            if peer is not None:
                break
            if store.check(keys):
                peer = posted_failure()
                break
            if time.monotonic() > deadline:
                missing = [r for r in range(world) if not store.check([keys[r]])]
                raise StartTimeout(
                    f"distributed error: rank(s) {', '.join(map(str, missing))} of {world} did not start within "
                    f"{timeout_s:.0f} s (FASTRLHF_DIST_TIMEOUT): a node failed its checks (its own output says "
                    "why), died, or was launched with another hostfile, --num_nodes, --master_addr or --master_port")
            time.sleep(GATE_POLL_S)
    finally:
        store.add(prefix + "left", 1)
    if failure is not None or peer is not None:
        if is_server:
            # The others read the failure from this process's server: stay until they all have.
            while store.add(prefix + "left", 0) < world and time.monotonic() < deadline:
                time.sleep(GATE_POLL_S)
        if failure is None:
            raise PeerFailedChecks(f"{peer['message']} (on {peer['where']})")
        return
    if is_server:
        _held_store = store


def check_shared_dir(path: str, key: str = "output_dir") -> None:
    """Collective, after the process group starts: every rank must see the file rank 0 writes in ``path``.

    Raises :class:`NotShared` (on every rank) naming the ranks and nodes that do not.
    """
    import secrets

    from fastrlhf.distributed import comm
    from fastrlhf.distributed import ranks as D

    if D.world_size() <= 1:
        return
    token = secrets.token_hex(8) if D.is_main() else ""
    token = comm.gather_bytes(token.encode())[0].decode()
    probe = os.path.join(path, f".fastrlhf-shared-{token}")
    if D.is_main():
        os.makedirs(path, exist_ok=True)
        with open(probe, "w") as f:
            f.write(token)
            f.flush()
            os.fsync(f.fileno())
    comm.barrier()
    try:
        with open(probe) as f:
            seen = f.read() == token
    except OSError:
        seen = False
    answers = [json.loads(b) for b in comm.gather_bytes(json.dumps({"seen": seen, "where": where()}).encode())]
    comm.barrier()
    if D.is_main():
        os.remove(probe)
    blind = [a["where"] for a in answers if not a["seen"]]
    if blind:
        error = NotShared(f"config error: {key}: {path} is not shared between the nodes: {'; '.join(blind)} cannot "
                          "see the file rank 0 wrote there. It must be one folder that every node sees at the same "
                          "path (a shared filesystem): every rank writes its part of each checkpoint there")
        error.local = not seen
        raise error


# What gloo (and NCCL, and the store) say when a peer is gone or stopped answering.
_LOST_PEER = re.compile(r"Connection closed by peer|Connection reset by peer|Broken pipe|Timed out waiting|"
                        r"Socket Timeout|NCCL (communicator was aborted|error)|ProcessGroupNCCL.*(Watchdog|"
                        r"timeout)|gloo/transport", re.IGNORECASE)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    text = re.sub(r"^\[[^\]]*\]\s*", "", text)  # gloo's "[/path/pair.cc:553] " source prefix
    return text.split(". ")[0]


def lost_peer_reason(exc: BaseException) -> str | None:
    """The one-line cause when ``exc`` is a collective failing because a peer died or hung, else None."""
    import sys

    dist = sys.modules.get("torch.distributed")
    if dist is None or not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return None
    dist_error = getattr(dist, "DistError", ())
    if isinstance(exc, dist_error) or (isinstance(exc, RuntimeError) and _LOST_PEER.search(str(exc))):
        return _first_line(exc)
    return None
