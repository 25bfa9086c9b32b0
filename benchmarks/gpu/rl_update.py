"""Race 2 (``make bench-gpu``'s ``rl_update``): ``RLStep.update`` of the 1.5B Qwen2 on DeepSpeed ZeRO-2 with gradient
checkpointing, in trained tokens/s and MFU against a bf16 GEMM rate measured in the same process; the actor's
engine as ``fastrlhf train`` builds it (also :mod:`benchmarks.gpu.layouts`'), and what the memory plan decides
for ``auto``."""

from __future__ import annotations

import dataclasses
import math
import statistics
import tempfile
import time

import torch

from benchmarks.gpu.timing import gemm_tflops, profile_kernels, sync
from benchmarks.gpu.workload import AGG, LOSS, model_shape


def actor_engine(dev, torch_dtype, model: dict, seed: int, lr: float, micro_batch: int, grad_accum: int,
                 gradient_checkpointing: bool = True, liger_kernels: bool = False, checkpoint_layers=None,
                 compiled: bool = False):
    """``(engine, reference, guard)`` as ``fastrlhf train`` builds them for GRPO: the actor from random init in a
    ZeRO-2 engine (bf16 with fp32 master weights on a GPU), gradient checkpointing (unless told otherwise; of the
    first ``checkpoint_layers`` layers where given), its frozen reference; with ``liger_kernels``, both with
    Liger-Kernel's layers (``model.liger_kernels``); with ``compiled``, both with each decoder layer torch.compiled
    (``model.compile``)."""
    from fastrlhf.config import DeepSpeedConfig
    from fastrlhf.engine.deepspeed import build_train_engine
    from fastrlhf.engine.guards import StepGuard
    from fastrlhf.modeling.loading import apply_liger_layers, checkpoint_first_layers
    from fastrlhf.modeling.tiny import make_qwen2_on

    actor = make_qwen2_on(dev, torch_dtype, seed=seed, **model).train()
    reference = make_qwen2_on(dev, torch_dtype, seed=seed, **model).requires_grad_(False)
    if liger_kernels:
        apply_liger_layers(actor)
        apply_liger_layers(reference)
    if compiled:
        from fastrlhf.modeling.compile import compile_layers

        compile_layers(actor)
        compile_layers(reference)
    if gradient_checkpointing:
        actor.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})  # as modeling.py
        if checkpoint_layers is not None:
            checkpoint_first_layers(actor, checkpoint_layers)
    actor.config.use_cache = False
    guard = StepGuard()
    engine = build_train_engine(actor, DeepSpeedConfig(zero_stage=2, bf16=torch_dtype == torch.bfloat16), lr=lr,
                                micro_batch_size=micro_batch, grad_accum=grad_accum, max_grad_norm=1.0, guard=guard)
    return engine, reference, guard


def rl_update_race(device: str = "cuda", shape: str = "qwen2-1.5b", dtype: str = "bfloat16", prompts: int = 8,
                   n: int = 8, prompt_len: int = 128, new_tokens: int = 256, grad_accum: int = 2, updates: int = 4,
                   gemm_size: int = 8192, seed: int = 0, gradient_checkpointing: bool = True,
                   liger_kernels: bool = False, profile: bool = True, checkpoint_layers: int | None = None,
                   compiled: bool = False, auto: bool = False) -> dict:
    """One GRPO step's update (``RLStep.update``: every micro-batch's forward + backward and the optimizer
    step) as the trainer builds it (tests/gpu/test_update_syncs.py): ZeRO-2, bf16 with fp32 master weights,
    gradient checkpointing, a reference model (KL in the loss), the HF engine sharing the actor (which
    generates nothing here). Full-length completions of random tokens, then ``updates`` steps on them, each
    timed around ``update`` only; the first is the warm-up (Triton compiles, DeepSpeed's buffers).

    MFU = 6 x params x trained tokens / update time / the measured GEMM rate, trained tokens being every real
    token of the sequences (prompt and completion: all run forward and backward; the LM head only sees the
    completion positions, so 6 x params over-counts its share on prompt tokens; ``mfu_head_on_completions`` counts
    the head there only, and the embedding lookup nowhere). ``mfu_with_recompute``
    counts the forward that gradient checkpointing repeats (8 x params x tokens, or 6 + 2 x the share of layers
    checkpointed with ``checkpoint_layers``; as MFU without it). With ``profile``, one more update's time by
    kernel (:func:`profile_kernels`): what it spends outside the GEMMs.
    ``liger_kernels``: the actor and reference with Liger-Kernel's RMSNorm, SwiGLU and rotary kernels; ``compiled``:
    with each decoder layer torch.compiled (``model.compile``; the warm-up update compiles). ``auto``: gradient
    checkpointing and the micro-batch as the memory plan decides them on this device for
    ``model.gradient_checkpointing: auto`` and ``trainer.max_tokens_per_microbatch: auto`` (:func:`plan_decided`),
    instead of ``gradient_checkpointing``, ``checkpoint_layers`` and ``grad_accum``."""
    from benchmarks.e2e_common import even_fraction_reward
    from fastrlhf import distributed as D
    from fastrlhf.memory.components import checkpointed_layers
    from fastrlhf.modeling.tiny import count_parameters
    from fastrlhf.rl.rewards import RewardScorer
    from fastrlhf.rl.step import RLStep
    from fastrlhf.rollout.hf_engine import HFEngine
    from fastrlhf.rollout.sampling import Completion

    D.init_distributed(timeout_s=120)
    dev = torch.device(device, torch.cuda.current_device()) if device == "cuda" else torch.device(device)
    torch_dtype, model = getattr(torch, dtype), model_shape(shape)
    batch = prompts * n
    decided = None
    if auto:
        decided = plan_decided(dev, model, dtype, prompts, n, prompt_len, new_tokens)
        gradient_checkpointing, checkpoint_layers = decided["gradient_checkpointing"], decided["checkpoint_layers"]
        grad_accum = decided["grad_accum"]
    config = update_config(dtype, prompts, n, prompt_len, new_tokens, grad_accum, updates, seed,
                           gradient_checkpointing=gradient_checkpointing, checkpoint_layers=checkpoint_layers,
                           compile=compiled)
    engine, reference, guard = actor_engine(dev, torch_dtype, model, seed, 1e-6, batch // grad_accum, grad_accum,
                                            gradient_checkpointing, liger_kernels, checkpoint_layers, compiled)
    actor, params = engine.module, count_parameters(engine.module)
    timed: list[dict] = []
    step_exp: list = []  # the last update's experience, profiled again at the end

    class TimedStep(RLStep):
        def update(self, exp, step):
            step_exp[:] = [exp]
            sync(self.device)
            t0 = time.perf_counter()
            metrics = super().update(exp, step)
            sync(self.device)
            parts = exp.token_parts()
            timed.append(dict(seconds=time.perf_counter() - t0, tokens=sum(p + c for p, c in parts),
                              completion_tokens=sum(c for _, c in parts)))
            return metrics

    step = TimedStep(config, engine, HFEngine(engine.module), RewardScorer(even_fraction_reward), reference=reference,
                     pad_token_id=actor.config.pad_token_id, rollout_shares_actor=True, device=engine.device,
                     guard=guard)
    g = torch.Generator().manual_seed(seed)
    prompt_ids = torch.randint(3, model["vocab_size"], (prompts, prompt_len), generator=g).tolist()
    # Full-length completions of random tokens, as a random-init model samples them (EOS never): the update's
    # cost does not depend on which tokens they are, and HF generate took 8-15 s of each variant's device time.
    uniform = -math.log(model["vocab_size"])
    completions = [[Completion(torch.randint(3, model["vocab_size"], (new_tokens,), generator=g).tolist(),
                               [uniform] * new_tokens, "length") for _ in range(n)] for _ in prompt_ids]
    metrics = [step(prompt_ids, None, step=i + 1, completions=completions) for i in range(updates)]
    measured = timed[1:] if len(timed) > 1 else timed
    update_s = statistics.median(t["seconds"] for t in measured)
    tokens = measured[-1]["tokens"]
    gemm = gemm_tflops(dev, gemm_size, torch_dtype)
    model_tflops = 6 * params * tokens / update_s / 1e12
    # The FLOPs the update runs: no GEMM for the embedding lookup, the LM head on completion positions only (6 x
    # params counts the head, tied or not, on every token: about 5% too many at 1.5B with 128-token prompts).
    embeddings = {id(m.weight): m.weight.numel() for m in (actor.get_input_embeddings(), actor.get_output_embeddings())}
    head, completion_tokens = actor.get_output_embeddings().weight.numel(), measured[-1]["completion_tokens"]
    head_tflops = 6 * ((params - sum(embeddings.values())) * tokens + head * completion_tokens) / update_s / 1e12
    layers = actor.config.num_hidden_layers  # the share of the forward that the backward repeats
    recomputed = checkpointed_layers(config.model, layers) / layers
    out = dict(shape=shape, params=params, sequences=batch, prompt_len=prompt_len, new_tokens=new_tokens,
               micro_batch=batch // grad_accum, optimizer_steps=metrics[-1].get("optimizer_steps"),
               trained_tokens=tokens, completion_tokens=completion_tokens,
               update_s=round(update_s, 4), update_s_all=[round(t["seconds"], 4) for t in timed],
               tokens_per_s=round(tokens / update_s, 1), gemm_tflops=round(gemm, 1),
               model_tflops=round(model_tflops, 2), mfu=round(model_tflops / gemm, 4),
               mfu_with_recompute=round(model_tflops * (6 + 2 * recomputed) / 6 / gemm, 4),
               mfu_head_on_completions=round(head_tflops / gemm, 4),
               mfu_target=0.45, gradient_checkpointing=gradient_checkpointing, liger_kernels=liger_kernels,
               checkpoint_layers=checkpoint_layers, compiled=compiled,
               skipped_steps=sum(m.get("skipped", 0) for m in metrics))
    if decided is not None:
        out["plan_decided"] = decided
    for key, name in (("memory/train_gib", "update_peak_allocated_gib"), ("memory/peak_reserved_gib",
                                                                         "step_peak_reserved_gib")):
        if key in metrics[-1]:  # CUDA only
            out[name] = round(metrics[-1][key], 2)
    if profile:
        out.update(profile_kernels(lambda: step.update(step_exp[0], updates + 1), engine.device))
    out["targets_met"] = out["mfu"] >= out["mfu_target"]
    return out


def update_config(dtype: str, prompts: int, n: int, prompt_len: int, new_tokens: int, grad_accum: int = 1,
                  updates: int = 1, seed: int = 0, path: str = "unused", **model_fields):
    """The ``TrainConfig`` of :func:`rl_update_race`'s GRPO run (the HF engine, sharing the actor), which
    :func:`plan_decided` plans as well; ``model_fields``: the ``ModelConfig``'s others."""
    from fastrlhf.config import DataConfig, ModelConfig, RewardConfig, RolloutConfig, TrainConfig, TrainerConfig

    trainer = TrainerConfig(max_steps=updates, prompts_per_step=prompts, minibatch_size=prompts * n,
                            grad_accum=grad_accum, ppo_epochs=1, lr=1e-6, kl_coef=LOSS["kl_coef"],
                            kl_kind=LOSS["kl_kind"], clip_low=LOSS["clip_low"], clip_high=LOSS["clip_high"], agg=AGG)
    return TrainConfig(output_dir="unused", model=ModelConfig(path=path, dtype=dtype, **model_fields),
                       data=DataConfig(prompts="unused", max_prompt_len=prompt_len), trainer=trainer,
                       algorithm="grpo", seed=seed,
                       rollout=RolloutConfig(engine="hf", n=n, max_new_tokens=new_tokens, max_logprob_mismatch=None),
                       reward=RewardConfig(function="target_token"))


def plan_decided(dev: torch.device, model: dict, dtype: str, prompts: int, n: int, prompt_len: int,
                 new_tokens: int, budget_bytes: int | None = None) -> dict:
    """What ``fastrlhf train`` with ``model.gradient_checkpointing: auto`` and ``trainer.max_tokens_per_microbatch:
    auto`` runs for :func:`rl_update_race`'s update on this device (``memory.auto``, from the plan of the whole run on
    one rank, :func:`update_config`: the actor's ZeRO-2 engine, its reference, the HF engine sharing the actor):
    checkpointing, the layers it covers, and the fewest micro-batches (a divisor of the batch) whose sequences fit
    the decided tokens. ``budget_bytes``: the plan's budget instead of the device's memory."""
    from fastrlhf.memory.auto import resolve_auto_settings
    from fastrlhf.memory.plan import plan_memory
    from fastrlhf.modeling.tiny import tiny_qwen2_config

    batch, length = prompts * n, prompt_len + new_tokens
    with tempfile.TemporaryDirectory(prefix="bench-gpu-plan-") as folder:
        tiny_qwen2_config(**model).save_pretrained(folder)  # config.json only: all the plan reads
        config = update_config(dtype, prompts, n, prompt_len, new_tokens, path=folder, gradient_checkpointing="auto")
        config = dataclasses.replace(config, trainer=dataclasses.replace(config.trainer,
                                                                          max_tokens_per_microbatch="auto"))
        plan = plan_memory(config, 1, budget_bytes, device=dev.type)
        decided, notes = resolve_auto_settings(config, plan)
    per_micro = max(1, int(decided.trainer.max_tokens_per_microbatch) // length)
    grad_accum = next(d for d in range(1, batch + 1) if batch % d == 0 and batch // d <= per_micro)
    return dict(gradient_checkpointing=bool(decided.model.gradient_checkpointing),
                checkpoint_layers=decided.model.checkpoint_layers, grad_accum=grad_accum,
                micro_tokens=int(decided.trainer.max_tokens_per_microbatch), plan_gib=round(plan.total / 2**30, 2),
                budget_gib=round(plan.budget / 2**30, 2), notes=notes)
