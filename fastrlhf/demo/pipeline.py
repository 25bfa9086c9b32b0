"""The demo pipeline: every stage runs the real trainer commands, on CPU, from a bare checkout.

1. data + tokenizer + a random-init Llama (``fastrlhf.demo.data``)
2. pretrain with ``fastrlhf sft`` on unprefixed data (``examples/demo/pretrain.yaml``)
3. prepare the pretrained model for prefixed prompts (new-token embedding init, see ``prepare_for_prefixes``)
4. (``--reward model``) train the script classifier with ``fastrlhf rm`` (``examples/demo/rm.yaml``)
5. evaluate: greedy exact-match accuracy on 1000 held-out prefixed prompts
6. RL with ``deepspeed --num_gpus 2 --module fastrlhf train`` (``examples/demo/{grpo,ppo}.yaml``)
7. evaluate again, write ``report.md`` / ``report.json`` and PNG plots

Stages 1-4 are cached under the work directory (a stamp records the configs, seeds and code they came
from, see ``pretrain_key``), so a second run goes straight to evaluation and RL; ``--fresh`` redoes
everything. Child processes write their logs to ``<workdir>/logs/``; the progress bars here follow their
``metrics.jsonl``.
"""

from __future__ import annotations

import inspect
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass, field

from fastrlhf.demo import data as demo_data
from fastrlhf.demo.stages import child_env, resolved_config, run_stage, stamp_key
from fastrlhf.distributed import free_port

__all__ = ["DemoOptions", "run_demo", "prepare_for_prefixes", "pretrain_key"]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG_DIR = os.path.join(ROOT, "examples", "demo")
# The code that shapes the cached data, tokenizer and initial model: the task (vocabulary, prompt format) and data.py.
PRETRAIN_CODE = (demo_data.task.__file__, demo_data.__file__)


@dataclass
class DemoOptions:
    algo: str = "grpo"  # grpo | ppo
    reward: str = "rule"  # rule | model
    fresh: bool = False
    workdir: str = "runs/demo"
    # Extra ``--set key=value`` for the stages (tests use these to shrink the run).
    pretrain_set: list[str] = field(default_factory=list)
    rm_set: list[str] = field(default_factory=list)
    rl_set: list[str] = field(default_factory=list)
    model_shape: dict = field(default_factory=dict)  # overrides of data.MODEL_SHAPE
    ranks: int = 2
    progress: bool = True
    pretrain_seed: int = 0  # data order, model init and pretraining
    rl_seed: int = 0  # RL sampling and minibatch order
    threads: int = 2  # torch threads per single-process stage (pretrain, RM, evaluation); RL: threads // ranks


# ----------------------------------------------------------------------------------------------- helpers


def _config(name: str) -> str:
    return os.path.join(CONFIG_DIR, name)


def _cached(folder: str, key: str) -> bool:
    try:
        with open(os.path.join(folder, "demo_stamp.json")) as f:
            return json.load(f)["key"] == key
    except (OSError, ValueError, KeyError):
        return False


def _write_stamp(folder: str, key: str, **info) -> None:
    with open(os.path.join(folder, "demo_stamp.json"), "w") as f:
        json.dump({"key": key, **info}, f, indent=1)


def pretrain_key(opts: DemoOptions) -> str:
    """The stamp of stages 1-3: their config and options, and the code that writes the data, the tokenizer and the
    initial model and prepares it. Without the code a cached model made with another vocabulary (token ids) or
    prompt format would be reused against data and rewards of the new one."""
    return stamp_key(_config("pretrain.yaml"), opts.pretrain_set, opts.model_shape, demo_data.MODEL_SHAPE,
                     opts.pretrain_seed, opts.threads, demo_data.split_numbers(), *PRETRAIN_CODE,
                     inspect.getsource(prepare_for_prefixes), "v3")


def _pretrain_cached(paths: dict, key: str) -> bool:
    """The stamp matches and the data files the later stages read are still there (they sit beside the model)."""
    data = [os.path.join(paths["data"], f"{name}.jsonl") for name in ("rl_prompts", "val", "eval")]
    return _cached(paths["pretrained"], key) and all(os.path.isfile(p) for p in data)


def _run_info(opts: DemoOptions, paths: dict, pre_key: str, pre_cached: bool) -> dict:
    """The report's record of what the run came from (``report.json["run"]``)."""
    try:
        with open(os.path.join(paths["pretrained"], "demo_stamp.json")) as f:
            pretrain_seconds = json.load(f).get("pretrain_seconds")
    except (OSError, ValueError):
        pretrain_seconds = None
    return {"pretrain_seed": opts.pretrain_seed, "rl_seed": opts.rl_seed, "threads": opts.threads,
            "ranks": opts.ranks, "pretrain_key": pre_key, "pretrained_cached": pre_cached,
            "pretrain_seconds": pretrain_seconds, "pretrain_set": list(opts.pretrain_set),
            "rm_set": list(opts.rm_set), "rl_set": list(opts.rl_set)}


def _say(opts: DemoOptions, text: str) -> None:
    if opts.progress:
        from tqdm import tqdm

        tqdm.write(text)
    else:
        print(text, flush=True)


def _stage_env(threads: int, **extra) -> dict:
    """``child_env`` for the demo's child stages, with OpenMP's idle threads sleeping (``OMP_WAIT_POLICY=
    PASSIVE``) unless the environment chooses a policy. With libgomp's default, a thread that waits at the
    end of a parallel region spins; on a loaded 2-core machine it spins away the time slice its peer needs.
    Measured on 2 vCPUs, 100 pretraining steps of the demo (2 threads), the same weights either way: with
    two busy loops beside it 68 s wall and 54 s of CPU by default against 37 s and 15 s passive; unloaded
    24-36 s against 15 s (benchmarks/results/history/2026-11-26-demo-test-under-load.md)."""
    if "OMP_WAIT_POLICY" not in os.environ:
        extra = {"OMP_WAIT_POLICY": "PASSIVE", **extra}
    return child_env(threads, **extra)


# ----------------------------------------------------------------------------------------------- stages


def prepare_for_prefixes(src: str, dst: str) -> None:
    """Copy the pretrained model ``src`` to ``dst`` with the prefix characters' embeddings set to ``_``'s.

    Why: pretraining only ever shows the prefix ``__``, so the characters of the real prefixes
    (数 字 小 写 大) never occur and their input embeddings are still random. A prompt holding them
    is out of distribution and derails the model (it then gets the number wrong a third of the time).
    The standard fix when a model meets new tokens is to initialise their embeddings from a known
    token's; ``_`` is the token they stand in for. The model then treats prefixed prompts like
    unprefixed ones (right number, random script), and RL separates the prefix embeddings through
    the different gradients they receive.
    """
    import torch
    from transformers import AutoModelForCausalLM

    from fastrlhf.demo import script_doubling as task

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    emb = model.get_input_embeddings().weight
    with torch.no_grad():
        for ch in sorted(set("".join(task.PREFIXES.values()))):
            emb[task.TOKEN_ID[ch]] = emb[task.TOKEN_ID["_"]]
    tmp = f"{dst.rstrip(os.sep)}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    for name in os.listdir(src):
        if name.startswith("tokenizer") or name == "special_tokens_map.json":
            shutil.copy2(os.path.join(src, name), os.path.join(tmp, name))
    shutil.rmtree(dst, ignore_errors=True)
    os.replace(tmp, dst)


def _config_args(config_path: str, sets: list[str]) -> list[str]:
    return ["--config", config_path, *(a for s in sets for a in ("--set", s))]


def _rollout_engine(rl_config, model_dir: str) -> str:
    """What the trainer's ``rollout.engine`` resolves to (``auto``: ``choose_engine_kind``, as the trainer does)."""
    kind = rl_config.rollout.engine
    if kind != "auto":
        return kind
    from safetensors import safe_open

    from fastrlhf.rollout import choose_engine_kind

    with safe_open(os.path.join(model_dir, "model.safetensors"), "pt") as f:
        num_params = sum(_prod(f.get_slice(k).get_shape()) for k in f.keys())
    return f"{choose_engine_kind(num_params, 'cpu')} (auto: {num_params / 1e6:.2f}M parameters on CPU)"


def _prod(shape) -> int:
    out = 1
    for d in shape:
        out *= int(d)
    return out


def run_demo(opts: DemoOptions) -> dict:
    """Run the whole demo; returns the report dict (also written to ``<workdir>/<run>/report.json``)."""
    if opts.algo not in ("grpo", "ppo"):
        raise ValueError(f"--algo must be grpo or ppo, got {opts.algo!r}")
    if opts.reward not in ("rule", "model"):
        raise ValueError(f"--reward must be rule or model, got {opts.reward!r}")
    try:  # our own bars only: not one per from_pretrained / save_pretrained
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except ImportError:
        pass
    import torch

    torch.set_num_threads(opts.threads)  # the evaluations run in this process
    w = opts.workdir
    os.makedirs(w, exist_ok=True)
    py = sys.executable
    paths = {
        "data": os.path.join(w, "data"), "init": os.path.join(w, "init"), "pretrain": os.path.join(w, "pretrain"),
        "pretrained": os.path.join(w, "pretrained"), "rm": os.path.join(w, "rm"), "logs": os.path.join(w, "logs"),
    }
    run_name = f"{opts.algo}-{opts.reward}"
    run_dir = os.path.join(w, run_name)
    times: dict[str, float] = {}
    stages = ["data + model init", "pretrain (fastrlhf sft)", "prepare for prefixed prompts"]
    if opts.reward == "model":
        stages.append("reward model (fastrlhf rm)")
    stages += ["evaluate before RL", f"RL: {opts.algo.upper()} (deepspeed, {opts.ranks} ranks)", "evaluate after RL",
               "report"]
    stage_no = iter(range(1, len(stages) + 1))

    def announce(name: str, note: str = ""):
        _say(opts, f"[{next(stage_no)}/{len(stages)}] {name}{note}")

    # ---- 1-3: data, init, pretrain, prepare (cached together)
    pretrain_cfg = _config("pretrain.yaml")
    pre_key = pretrain_key(opts)
    pre_cached = not opts.fresh and _pretrain_cached(paths, pre_key)
    if pre_cached:
        for name in stages[:3]:
            announce(name, f": cached in {paths['pretrained']} (make demo FRESH=1 redoes it)")
    else:
        announce(stages[0])
        t0 = time.perf_counter()
        demo_data.write_data(paths["data"], seed=opts.pretrain_seed)
        num_params = demo_data.make_initial_model(paths["init"], seed=opts.pretrain_seed, **opts.model_shape)
        times["data"] = time.perf_counter() - t0
        _say(opts, f"    Llama {num_params / 1e6:.2f}M parameters, character tokenizer -> {paths['init']}")

        announce(stages[1])
        sets = [f"output_dir={paths['pretrain']}", f"model.path={paths['init']}",
                f"data.path={os.path.join(paths['data'], 'pretrain.jsonl')}", f"seed={opts.pretrain_seed}",
                *opts.pretrain_set]
        pre_steps = resolved_config("sft", pretrain_cfg, sets).trainer.max_steps
        cmd = [py, "-m", "fastrlhf", "sft", *_config_args(pretrain_cfg, sets), "--overwrite"]
        times["pretrain"] = run_stage("pretrain", cmd, os.path.join(paths["logs"], "pretrain.log"),
                                       os.path.join(paths["pretrain"], "metrics.jsonl"), pre_steps, opts.progress,
                                       env=_stage_env(opts.threads))

        announce(stages[2])
        t0 = time.perf_counter()
        prepare_for_prefixes(os.path.join(paths["pretrain"], "final"), paths["pretrained"])
        times["prepare"] = time.perf_counter() - t0
        _write_stamp(paths["pretrained"], pre_key, pretrain_seconds=times["pretrain"])
    data_file = {name: os.path.join(paths["data"], f"{name}.jsonl")
                 for name in ("rl_prompts", "val", "eval", "classifier")}

    # ---- 4: the learned reward (cached on the pretrained model's stamp)
    env_extra = {}
    if opts.reward == "model":
        rm_cfg = _config("rm.yaml")
        rm_key = stamp_key(pre_key, rm_cfg, opts.rm_set, "classifier-data-v2")
        rm_final = os.path.join(paths["rm"], "final")
        if not opts.fresh and _cached(rm_final, rm_key):
            announce(stages[3], f": cached in {rm_final}")
        else:
            announce(stages[3])
            demo_data.write_classifier_data(data_file["classifier"])
            sets = [f"output_dir={paths['rm']}", f"model.path={paths['pretrained']}",
                    f"data.path={data_file['classifier']}", *opts.rm_set]
            rm_steps = resolved_config("rm", rm_cfg, sets).trainer.max_steps
            cmd = [py, "-m", "fastrlhf", "rm", *_config_args(rm_cfg, sets), "--overwrite"]
            times["reward_model"] = run_stage("reward model", cmd, os.path.join(paths["logs"], "rm.log"),
                                               os.path.join(paths["rm"], "metrics.jsonl"), rm_steps, opts.progress,
                                               env=_stage_env(opts.threads))
            _write_stamp(rm_final, rm_key)
        env_extra["FASTRLHF_DEMO_CLASSIFIER"] = os.path.abspath(rm_final)

    # ---- 5: evaluate before
    from fastrlhf.demo.evaluate import evaluate

    announce(stages[-4])
    t0 = time.perf_counter()
    before = evaluate(paths["pretrained"], data_file["eval"], progress=opts.progress, desc="evaluate (before)")
    times["evaluate_before"] = time.perf_counter() - t0
    _say(opts, f"    accuracy before RL: {before['accuracy']:.1%} exact match "
               f"(right number in some script: {before['right_number']:.1%})")

    # ---- 6: RL
    announce(stages[-3])
    rl_cfg = _config(f"{opts.algo}.yaml")
    if opts.reward == "model" and os.path.exists(_config(f"{opts.algo}_learned_reward.yaml")):
        rl_cfg = _config(f"{opts.algo}_learned_reward.yaml")
    sets = [f"output_dir={run_dir}", f"model.path={paths['pretrained']}", f"data.prompts={data_file['rl_prompts']}",
            f"eval.data={data_file['val']}", f"seed={opts.rl_seed}"]
    shutil.rmtree(run_dir, ignore_errors=True)  # a new run, not a continuation of the last one
    os.makedirs(run_dir)
    exact_log = os.path.join(run_dir, "exact_match.log")
    if opts.reward == "model":
        sets += ["reward.function=fastrlhf.demo.rewards:script_classifier"]  # a no-op for *_learned_reward.yaml
        env_extra["FASTRLHF_DEMO_EXACT_LOG"] = os.path.abspath(exact_log)
    sets += opts.rl_set
    rl_config = resolved_config("train", rl_cfg, sets)
    deepspeed = os.path.join(os.path.dirname(py), "deepspeed")
    cmd = [deepspeed, "--num_gpus", str(opts.ranks), "--master_port", str(free_port()), "--module", "fastrlhf",
           "train", *_config_args(rl_cfg, sets)]
    times["rl"] = run_stage(f"RL {opts.algo}", cmd, os.path.join(paths["logs"], f"{run_name}.log"),
                             os.path.join(run_dir, "metrics.jsonl"), rl_config.trainer.max_steps, opts.progress,
                             env=_stage_env(max(1, opts.threads // opts.ranks), **env_extra))

    # ---- 7: evaluate after
    announce(stages[-2])
    t0 = time.perf_counter()
    after = evaluate(os.path.join(run_dir, "final"), data_file["eval"], progress=opts.progress,
                     desc="evaluate (after)")
    times["evaluate_after"] = time.perf_counter() - t0

    # ---- 8: report
    announce(stages[-1])
    from fastrlhf.demo.report import write_report

    per_rank_calls = None
    if opts.reward == "model":
        per_rank_calls = rl_config.trainer.prompts_per_step * rl_config.rollout.n // opts.ranks
    engine = _rollout_engine(rl_config, paths["pretrained"])
    report = write_report(run_dir, algo=opts.algo, reward=opts.reward, before=before, after=after,
                          stage_seconds=times, exact_log=exact_log if opts.reward == "model" else None,
                          exact_calls_per_step=per_rank_calls, ranks=opts.ranks, rollout_engine=engine,
                          run=_run_info(opts, paths, pre_key, pre_cached))
    return report
