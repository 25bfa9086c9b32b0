"""Two nodes for real: ``fastrlhf train`` through DeepSpeed's launcher (``--no_ssh --node_rank i``) in two
network namespaces, one rank each (GRPO, ZeRO-3, a vLLM engine per rank, gloo over the veth pair).

- The job on 2 nodes x 1 rank gives the metrics and weights of the same job on 1 node x 2 ranks, and
  writes each job file once (one ``metrics.jsonl``, one ``final/``, the same files as on one node).
- Node 1 lost mid-step 3 (killed, or off the network and then killed): node 0 stops within
  ``FASTRLHF_DIST_TIMEOUT`` with one line naming the checkpoint to resume from; resumed on 2 nodes
  from it, step 3 comes out as in the uninterrupted run.
- Node 1 without the model folder or the data, or with an ``output_dir`` of its own: both nodes stop
  before any work, with a line naming the path and the node; a node that never starts stops node 0
  after the timeout, with a line naming the missing rank.

Not in ``make test`` (several minutes): ``make test-multinode``, which ``.ci/run`` also runs. Needs root
(namespaces); skipped with the reason otherwise.
"""

import os
import re
import shutil
import time

import pytest
import torch
import yaml
from helpers.launch import kill_group, start_group, wait_groups
from helpers.netns import TwoNodes, unavailable
from helpers.rl_runs import DEEPSPEED, final_weights, launch_env, make_tiny, metrics_by_step

from fastrlhf.distributed import free_port

pytestmark = [pytest.mark.multinode, pytest.mark.slow]

# Short, so that the lost-node test ends soon; every wait in a healthy run is far shorter on this model.
TIMEOUT_S = 30
# What a step measures about itself (not a result of the run, so not compared): times and memory.
TIMINGS = ("time/", "step_time", "wall_time", "tokens_per_second", "memory/")
_port = iter(range(29600, 29700))


@pytest.fixture(scope="module")
def nodes():
    why = unavailable()
    if why:
        pytest.skip(why)
    try:
        made = TwoNodes().__enter__()
    except RuntimeError as exc:
        pytest.skip(str(exc))
    yield made
    made.__exit__(None, None, None)
    assert made.mine() == [], "the test's network namespaces outlived it"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = make_tiny(tmp_path_factory.mktemp("multinode"))
    (root / "hostfile").write_text("node0 slots=1\nnode1 slots=1\n")
    return root


def config(tiny, name, **overrides):
    """GRPO, 3 steps, ZeRO-3, vLLM on every rank, checkpoints at step 2 (and the final one)."""
    c = {"algorithm": "grpo", "output_dir": str(tiny / "out" / name), "seed": 3,
         "model": {"path": str(tiny / "model")},
         "reward": {"function": "kill_reward:reward"},
         "data": {"prompts": str(tiny / "prompts.jsonl"), "max_prompt_len": 16},
         "rollout": {"engine": "vllm", "n": 2, "max_new_tokens": 5, "kv_cache_bytes": 16 << 20},
         "trainer": {"max_steps": 3, "prompts_per_step": 2, "minibatch_size": 4, "lr": 1e-2, "kl_coef": 0.05,
                     "save_every": 2},
         "deepspeed": {"zero_stage": 3}}
    for key, value in overrides.items():
        c[key] = {**c[key], **value}
    path = tiny / f"{name}.yaml"
    path.write_text(yaml.safe_dump(c))
    return str(path)


def node_env(nodes, node, **extra):
    # gloo finds its address from the hostname, which resolves to 127.0.0.1 here: name the interface
    # that reaches the other node instead (as on a real cluster with several networks).
    return launch_env(**{"FASTRLHF_DIST_TIMEOUT": str(TIMEOUT_S), "GLOO_SOCKET_IFNAME": nodes.ifnames[node], **extra})


def start_node(nodes, tiny, node, cfg, log, *extra, env=None, hide=(), port):
    argv = [DEEPSPEED, "--hostfile", tiny / "hostfile", "--no_ssh", "--node_rank", node,
            "--master_addr", nodes.addresses[0], "--master_port", port, "--module", "fastrlhf", "train",
            "--config", cfg, *extra]
    return start_group(nodes.command(node, argv, hide=hide), log, env=env or node_env(nodes, node))


def run_two_nodes(nodes, tiny, cfg, name, *extra, timeout=420, envs=(None, None), hides=((), ())):
    """Both nodes' launchers at once; returns (exit codes, logs' text, wall seconds)."""
    port = next(_port)
    logs = [tiny / f"{name}-node{i}.log" for i in range(2)]
    started = time.monotonic()
    procs = [start_node(nodes, tiny, i, cfg, logs[i], *extra, env=envs[i], hide=hides[i], port=port)
             for i in range(2)]
    codes = wait_groups(procs, timeout, logs)
    return codes, [p.read_text() for p in logs], time.monotonic() - started


def compared(metrics):
    return {k: v for k, v in metrics.items() if not k.startswith(TIMINGS) and isinstance(v, (int, float))}


def files_under(folder):
    return sorted(os.path.relpath(os.path.join(d, f), folder) for d, _, names in os.walk(folder) for f in names)


@pytest.fixture(scope="module")
def two_node_run(nodes, tiny):
    codes, outs, seconds = run_two_nodes(nodes, tiny, config(tiny, "two"), "two")
    assert codes == [0, 0], f"{outs[0][-3000:]}\n--- node 1:\n{outs[1][-3000:]}"
    print(f"2 nodes x 1 rank: {seconds:.0f} s")
    return tiny / "out" / "two"


@pytest.mark.timeout(900)
def test_two_nodes_give_the_one_node_run_and_write_each_job_file_once(nodes, tiny, two_node_run):
    one = tiny / "out" / "one"
    log = tiny / "one.log"
    started = time.monotonic()
    proc = start_group([DEEPSPEED, "--num_gpus", "2", "--master_port", str(free_port()), "--module", "fastrlhf",
                        "train", "--config", config(tiny, "one")], log, env=launch_env(FASTRLHF_DIST_TIMEOUT="60"))
    assert wait_groups([proc], 420, [log]) == [0], log.read_text()[-3000:]
    print(f"1 node x 2 ranks: {time.monotonic() - started:.0f} s")

    a, b = metrics_by_step(one), metrics_by_step(two_node_run)
    assert sorted(a) == sorted(b) == [1, 2, 3]
    for step in a:
        assert compared(a[step]).keys() == compared(b[step]).keys()
        for key, value in compared(a[step]).items():
            assert b[step][key] == pytest.approx(value, rel=1e-5, abs=1e-7), (step, key)
    assert a[3]["generated_tokens"] > 0 and a[3]["grad_norm"] > 0
    wa, wb = final_weights(one), final_weights(two_node_run)
    assert wa.keys() == wb.keys()
    for name in wa:
        assert torch.allclose(wa[name], wb[name], atol=1e-6), name

    # Per job, not per node: the same files as the one-node run (each written once, by the rank that
    # owns it), among them one metrics.jsonl and one final/, and nothing left of the sharing probe.
    files = files_under(two_node_run)
    assert files == files_under(one)
    assert [f for f in files if os.path.basename(f) == "metrics.jsonl"] == ["metrics.jsonl"]
    assert sorted({f.split(os.sep)[0] for f in files}) == ["checkpoints", "config.yaml", "final", "metrics.jsonl"]
    assert (two_node_run / "checkpoints" / "latest").read_text().strip() == "step-3"
    assert sorted(os.listdir(two_node_run / "checkpoints")) == ["latest", "step-2", "step-3"]
    assert sorted(f for f in os.listdir(two_node_run / "checkpoints" / "step-2") if f.startswith("rank-")) == [
        "rank-0.pt", "rank-1.pt"]


@pytest.mark.timeout(900)
@pytest.mark.parametrize("how", ["killed", "unplugged"])
def test_lost_node_stops_node_0_in_time_and_the_run_resumes_on_two_nodes(nodes, tiny, two_node_run, how):
    """Node 1 hangs in step 3's reward (after the step-2 checkpoint); then its launcher and ranks are
    killed: their sockets close and node 0's next collective fails at once. Unplugged, node 1 first
    leaves the network, so nothing of its end arrives: node 0 must time out."""
    name = f"lost-{how}"
    cfg = config(tiny, name)
    out = tiny / "out" / name
    marker = tiny / f"{name}.hung"
    logs = [tiny / f"{name}-node{i}.log" for i in range(2)]
    port = next(_port)
    # One prompt x 2 samples per rank per step: the reward's 5th call on rank 1 is in step 3.
    hang = node_env(nodes, 1, FASTRLHF_TEST_HANG_AFTER_CALLS="4", FASTRLHF_TEST_HANG_MARKER=str(marker))
    started = time.monotonic()
    procs = [start_node(nodes, tiny, 0, cfg, logs[0], port=port),
             start_node(nodes, tiny, 1, cfg, logs[1], env=hang, port=port)]
    try:
        while not marker.exists():
            assert time.monotonic() - started < 420, logs[0].read_text()[-3000:]
            assert procs[0].poll() is None, logs[0].read_text()[-3000:]
            time.sleep(0.2)
        if how == "unplugged":
            nodes.unplug(1)
        lost = time.monotonic()
        kill_group(procs[1])
        # Node 0 stopping in time is this bound: a node 0 that waited past FASTRLHF_DIST_TIMEOUT fails the test here,
        # on a machine of any speed (measured: 6 s after the kill, on a busy 2-core machine).
        code = wait_groups(procs[:1], TIMEOUT_S + 60, logs[:1])[0]
        stopped = time.monotonic() - lost
    finally:
        for proc in procs:
            kill_group(proc)
        nodes.plug(1)
    print(f"node 1 {how} at {lost - started:.0f} s; node 0 stopped {stopped:.1f} s later "
          f"(FASTRLHF_DIST_TIMEOUT={TIMEOUT_S})")
    text = logs[0].read_text()
    assert code == 1, text[-3000:]
    lines = [line for line in text.splitlines() if line.startswith("distributed error: ")]
    assert len(lines) == 1, text[-3000:]
    assert "lost contact with another rank" in lines[0]
    if how == "killed":  # the closed connection, not the timeout (a wall-clock bound failed on slow machines)
        assert re.search(r"lost contact with another rank \([^)]*(closed|reset) by peer", lines[0]), lines[0]
    assert f"the last complete checkpoint is {out / 'checkpoints' / 'step-2'}: restart every node with --resume" \
        in lines[0], lines[0]
    # No uncaught exception (vLLM logs a harmless traceback of its own as a WARNING at start-up).
    assert not [x for x in text.splitlines() if "Traceback" in x and "WARNING" not in x], text[-3000:]
    assert (out / "checkpoints" / "latest").read_text().strip() == "step-2"
    assert not (out / "final").exists()
    if how == "killed":
        return

    codes, outs, seconds = run_two_nodes(nodes, tiny, cfg, f"{name}-resume", "--resume")
    assert codes == [0, 0], f"{outs[0][-3000:]}\n--- node 1:\n{outs[1][-3000:]}"
    print(f"resumed on 2 nodes from step 2: {seconds:.0f} s")
    a, b = metrics_by_step(two_node_run), metrics_by_step(out)
    assert sorted(b) == [1, 2, 3]
    for key, value in compared(a[3]).items():
        assert b[3][key] == pytest.approx(value, rel=1e-6, abs=1e-9), key
    wa, wb = final_weights(two_node_run), final_weights(out)
    for n in wa:
        assert torch.allclose(wa[n], wb[n], atol=1e-6), n


@pytest.mark.timeout(300)
@pytest.mark.parametrize("missing", ["model", "data"])
def test_a_path_node_1_cannot_see_stops_both_nodes_before_any_work(nodes, tiny, missing):
    only_node0 = tiny / f"node0-only-{missing}"
    only_node0.mkdir()
    key, path = {"model": ("model.path", only_node0 / "model"),
                 "data": ("data.prompts", only_node0 / "prompts.jsonl")}[missing]
    if missing == "model":
        shutil.copytree(tiny / "model", path)
        cfg = config(tiny, f"hidden-{missing}", model={"path": str(path)})
    else:
        shutil.copy(tiny / "prompts.jsonl", path)
        cfg = config(tiny, f"hidden-{missing}", data={"prompts": str(path)})
    codes, outs, seconds = run_two_nodes(nodes, tiny, cfg, f"hidden-{missing}", timeout=240,
                                         hides=((), (only_node0,)))
    print(f"node 1 without the {missing}: both nodes stopped in {seconds:.0f} s")
    line = f"config error: {key}: path does not exist: {path}"
    assert codes == [2, 2], f"{outs[0][-3000:]}\n--- node 1:\n{outs[1][-3000:]}"
    # Node 1 says it in its own output; node 0, which has the path, says which node lacks it.
    assert [x for x in outs[1].splitlines() if "error: " in x and "launch.py" not in x] == [line], outs[1][-3000:]
    ours = [x for x in outs[0].splitlines() if "error: " in x and "launch.py" not in x]
    assert len(ours) == 1 and ours[0].startswith(f"{line} (on rank 1 on node 1 (host "), outs[0][-3000:]
    assert not (tiny / "out" / f"hidden-{missing}").exists()


@pytest.mark.timeout(300)
def test_an_output_dir_node_1_does_not_share_stops_both_nodes_before_any_work(nodes, tiny):
    parent = tiny / "out-node0"
    parent.mkdir()
    out = parent / "run"
    cfg = config(tiny, "unshared")
    with open(cfg) as f:
        c = yaml.safe_load(f)
    c["output_dir"] = str(out)
    with open(cfg, "w") as f:
        yaml.safe_dump(c, f)
    codes, outs, seconds = run_two_nodes(nodes, tiny, cfg, "unshared", timeout=240, hides=((), (parent,)))
    print(f"output_dir not shared: both nodes stopped in {seconds:.0f} s")
    assert codes == [2, 2], f"{outs[0][-3000:]}\n--- node 1:\n{outs[1][-3000:]}"
    line = (f"config error: output_dir: {out} is not shared between the nodes: rank 1 on node 1 (host ")
    for text in outs:
        errors = [x for x in text.splitlines() if "error: " in x and "launch.py" not in x]
        assert len(errors) == 1 and errors[0].startswith(line), text[-3000:]
        assert "must be one folder that every node sees at the same path" in errors[0]
    # Before any model loaded: no metrics, no config, and the probe file is gone.
    assert os.listdir(out) == []


@pytest.mark.timeout(300)
def test_a_node_that_never_starts_stops_node_0_after_the_timeout(nodes, tiny):
    log = tiny / "alone.log"
    started = time.monotonic()
    env = node_env(nodes, 0, FASTRLHF_DIST_TIMEOUT="10")
    proc = start_node(nodes, tiny, 0, config(tiny, "alone"), log, env=env, port=next(_port))
    code = wait_groups([proc], 200, [log])[0]
    seconds = time.monotonic() - started
    print(f"node 0 alone: stopped {seconds:.0f} s after its start (FASTRLHF_DIST_TIMEOUT=10)")
    text = log.read_text()
    assert code == 1, text[-3000:]
    errors = [x for x in text.splitlines() if "error: " in x and "launch.py" not in x]
    assert errors == ["distributed error: rank(s) 1 of 2 did not start within 10 s (FASTRLHF_DIST_TIMEOUT): a node "
                      "failed its checks (its own output says why), died, or was launched with another hostfile, "
                      "--num_nodes, --master_addr or --master_port"], text[-3000:]
