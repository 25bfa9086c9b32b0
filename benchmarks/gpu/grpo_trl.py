"""The TRL side of the GRPO races: TRL's ``GRPOTrainer`` on the race's model folder and prompts, matched setting by
setting to ``fastrlhf train`` (:func:`benchmarks.gpu.grpo_ours.run_fastrlhf`), its steps timed by stage."""

from __future__ import annotations

import functools
import json
import os
import time

import torch

from benchmarks.gpu.timing import GIB, sync
from benchmarks.gpu.workload import LOSS


def trl_grpo(spec: dict) -> dict:
    """TRL's ``GRPOTrainer`` on ``spec`` (a child process: it owns its allocator). Matched to ``run_fastrlhf``:
    the model folder loaded in fp32 with bf16 autocast (TRL's defaults, and like fastrlhf fp32 master weights
    under bf16 compute), group-std scaled rewards, k3 KL with the same beta, clip 0.2, ``dapo`` (token mean
    over the generation batch), AdamW at a constant learning rate, clip-norm 1.0, gradient checkpointing,
    HF generate, and one generation and one optimizer step per step: ``steps_per_generation`` =
    ``gradient_accumulation_steps`` micro-batches of fastrlhf's size, ``num_iterations`` 1 (no old-logprob
    pass, as fastrlhf skips it on-policy; with vLLM, no importance-sampling correction, whose default runs that
    pass). A callback times each optimizer step (= one GRPO step), and
    :func:`time_trl_stages` its generation, scoring and weight sync, named as fastrlhf's stages are."""
    import dataclasses

    import trl
    from datasets import Dataset
    from transformers import PreTrainedTokenizerFast, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from benchmarks.e2e_common import even_fraction_reward

    cuda = spec["device"] == "cuda"
    with open(spec["prompts_file"]) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    ids_of = {r["prompt"]: r["prompt_ids"] for r in rows}
    tokenizer = PreTrainedTokenizerFast.from_pretrained(spec["model_dir"])
    assert all(tokenizer(text=r["prompt"])["input_ids"] == r["prompt_ids"] for r in rows), "TRL would see other ids"

    def reward(prompts, completions, completion_ids, **kwargs):
        return [even_fraction_reward(ids_of[p], list(c)) for p, c in zip(prompts, completion_ids, strict=True)]

    batch, micro = spec["prompts"] * spec["n"], spec["prompts"] * spec["n"] // spec["grad_accum"]
    wanted = dict(
        output_dir=os.path.join(spec["work"], "trl"), seed=0, use_cpu=not cuda, bf16=cuda, fp16=False,
        model_init_kwargs={"dtype": "float32"}, gradient_checkpointing=True,
        per_device_train_batch_size=micro, gradient_accumulation_steps=batch // micro,
        steps_per_generation=batch // micro, num_iterations=1, num_generations=spec["n"],
        max_completion_length=spec["new_tokens"], max_prompt_length=spec["prompt_len"], temperature=1.0, top_p=1.0,
        learning_rate=1e-6, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
        optim="adamw_torch", beta=LOSS["kl_coef"], epsilon=LOSS["clip_low"], scale_rewards="group",
        loss_type="dapo", max_steps=spec["steps"], logging_steps=1, report_to="none", save_strategy="no",
        disable_tqdm=True, dataloader_num_workers=0, log_completions=False)
    fields = {f.name for f in dataclasses.fields(GRPOConfig)}
    if spec.get("vllm"):
        # TRL's colocated vLLM in the trainer's process, asleep during the update, at TRL's own
        # vllm_gpu_memory_utilization (its default, as a user starts with). Its importance-sampling correction
        # (on by default) recomputes the policy's logprobs of the whole batch after generation: a forward pass that
        # fastrlhf's on-policy step does not run (it corrects nothing), so off, for the same passes on both sides.
        wanted.update(use_vllm=True, vllm_mode="colocate", vllm_enable_sleep_mode=cuda,  # sleep mode needs CUDA
                      vllm_importance_sampling_correction=False)
    if spec.get("liger"):
        # TRL <= 1.x had use_liger_loss (Liger's fused GRPO loss); 1.16 keeps only use_liger_kernel (Liger's
        # layer kernels; the loss is TRL's own fused LM head either way).
        wanted["use_liger_loss" if "use_liger_loss" in fields else "use_liger_kernel"] = True
    missing = [k for k in ("use_vllm", "vllm_mode", "vllm_enable_sleep_mode") if k in wanted and k not in fields]
    if missing:  # dropped silently, the run would race HF generate under the name of TRL's vLLM
        raise RuntimeError(f"TRL {trl.__version__}'s GRPOConfig has no {', '.join(missing)}")
    args = GRPOConfig(**{k: v for k, v in wanted.items() if k in fields})
    steps: list[dict] = []
    device = torch.device("cuda" if cuda else "cpu")

    stages: dict = {}

    class Timer(TrainerCallback):
        def on_step_begin(self, a, state, control, **kw):
            sync(device)
            stages.clear()
            self.t0 = time.perf_counter()

        def on_step_end(self, a, state, control, **kw):
            sync(device)
            step_s = time.perf_counter() - self.t0
            steps.append({"step_s": step_s, **trl_step_stages(stages, step_s)})

    dataset = Dataset.from_dict({"prompt": [r["prompt"] for r in rows]})
    trainer = GRPOTrainer(model=spec["model_dir"], reward_funcs=reward, args=args, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[Timer()])
    time_trl_stages(trainer, device, stages)
    trainer.train()
    return dict(steps=steps, trl_version=trl.__version__, ignored_args=sorted(set(wanted) - fields),
                liger_flag=next((k for k in ("use_liger_loss", "use_liger_kernel") if wanted.get(k)), None),
                vllm_gpu_memory_utilization=getattr(args, "vllm_gpu_memory_utilization", None) if spec.get("vllm")
                else None,
                peak_gib=torch.cuda.max_memory_reserved() / GIB if cuda else None,
                weights_dtype=str(next(trainer.model.parameters()).dtype))


def time_trl_stages(trainer, device: torch.device, seconds: dict) -> dict:
    """Times the parts of a TRL ``GRPOTrainer`` step into ``seconds`` (each call adds to its key; the caller clears it
    each step): the whole generation and scoring (``gen_and_score``), and inside it the generation (vLLM's
    ``generate``, or HF generate's turn) and vLLM's weight sync (``sync``). Each timed call starts and ends with a
    device synchronize, as the step's own timer does. A method this TRL lacks is left as it is. Returns ``seconds``."""
    def timed(owner, method: str, key: str) -> None:
        fn = getattr(owner, method, None)
        if fn is None:
            return

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            sync(device)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                sync(device)
                seconds[key] = seconds.get(key, 0.0) + time.perf_counter() - t0

        setattr(owner, method, wrapper)

    timed(trainer, "_generate_and_score_completions", "gen_and_score")
    engine = getattr(trainer, "vllm_generation", None)
    if engine is not None:
        timed(engine, "generate", "generate")
        timed(engine, "sync_weights", "sync")
    else:
        timed(trainer, "_generate_single_turn", "generate")
    return seconds


def trl_step_stages(seconds: dict, step_s: float) -> dict:
    """One TRL step's ``generate_s``, ``score_s`` (rewards, reference and old logprobs: the rest of generation and
    scoring), ``train_s`` (the rest of the step) and ``sync_s``, as fastrlhf's metrics name its stages; nothing where
    the step did not generate through a timed method."""
    if "gen_and_score" not in seconds or "generate" not in seconds:
        return {}
    generate, sync_s = seconds["generate"], seconds.get("sync", 0.0)
    return dict(generate_s=generate, score_s=seconds["gen_and_score"] - generate - sync_s,
                train_s=step_s - seconds["gen_and_score"], sync_s=sync_s)
