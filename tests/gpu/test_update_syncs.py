"""One whole RL update (every micro-batch, backward and optimizer step of the actor) on the production
learner, a DeepSpeed ZeRO-2 engine, reads the device once per optimizer step: the guard's decision,
named ``the optimizer step's skip decision and metrics`` (``fastrlhf.engine.guards``), which brings the
losses' and gradients' finiteness, the gradient norm and the step's metrics in one transfer. The rest of
the step (scoring, old and reference logprobs, advantages, metrics) reads twice: the update's inputs'
check before it and the step's metrics after it.

On CUDA the step but its generation runs under ``torch.cuda.set_sync_debug_mode("error")``: any other host read
(``.item()``, a blocking copy, ``nonzero``, DeepSpeed's or transformers' own) raises there. On the CPU
the same step runs at tiny shapes and checks the named reads; the unnamed ones a CPU cannot see are
``tests/engine/test_device_placement.py``'s to catch (an emulated second device).
"""

import pytest
import torch
from helpers.cuda_sync import sync_debug
from helpers.other_device import accelerator_syncs
from helpers.proof import model_dtype, model_shape

from fastrlhf import distributed as D
from fastrlhf.config import (
    DataConfig,
    DeepSpeedConfig,
    ModelConfig,
    RewardConfig,
    RolloutConfig,
    TrainConfig,
    TrainerConfig,
)
from fastrlhf.engine.deepspeed import build_train_engine
from fastrlhf.engine.device import watch_host_reads
from fastrlhf.engine.guards import INPUTS_READ, StepGuard
from fastrlhf.modeling import use_attention
from fastrlhf.modeling.tiny import make_qwen2_on
from fastrlhf.rl.rewards import RewardScorer
from fastrlhf.rl.step import RLStep
from fastrlhf.rl.step_metrics import METRICS_READ
from fastrlhf.rollout import Completion
from fastrlhf.rollout.hf_engine import HFEngine

DECISION = "the optimizer step's skip decision and metrics"


class CheckedStep(RLStep):
    """The RL step run under the sync check but for its generation (HF ``generate`` reads the device each token;
    vLLM's engine is not the trainer's stream), its named reads and device syncs recorded: the update's, and the
    whole step's."""

    update_reads: list[str] = []
    step_reads: list[str] = []

    def __call__(self, *args, **kwargs):
        with watch_host_reads() as names, sync_debug(self.device):
            metrics = super().__call__(*args, **kwargs)
        self.step_reads = list(names)
        return metrics

    def generate(self, *args, **kwargs):
        if self.device.type != "cuda":
            return super().generate(*args, **kwargs)
        torch.cuda.set_sync_debug_mode(0)
        try:
            return super().generate(*args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode("error")

    def update(self, exp, step):
        with watch_host_reads() as names, accelerator_syncs() as syncs:
            metrics = super().update(exp, step)
        self.update_reads = list(names) + syncs
        return metrics


@pytest.mark.slow
# unpadded: prompts of one length, completions all at the token limit (fastrlhf.sequences.masks); entropy-mask:
# padded, with TRL's top_entropy_quantile (its threshold over the step's tokens, fastrlhf.rl.entropy_mask) and
# verl's straight-through k3+ in the fused loss; opsm: trainer.off_policy_mask_threshold (TRL's get_off_policy_mask,
# fastrlhf.algorithms.off_policy_mask) on the fused logprob kernel's path, padded; opsm-unfused: on materialised
# logits, packed (the mask's logprobs put back in rows)
@pytest.mark.parametrize("layout", ["padded", "packed", "shared", "unpadded", "entropy-mask", "opsm", "opsm-unfused"])
def test_rl_update_reads_the_device_once_per_optimizer_step(where, layout):
    D.init_distributed(timeout_s=120)
    device = torch.device(where, torch.cuda.current_device()) if where == "cuda" else torch.device("cpu")
    shape, dtype = model_shape(where), model_dtype(where)
    n, prompts_per_step = 4, 4
    packing, shared = layout in ("packed", "shared", "opsm-unfused"), layout == "shared"
    # A threshold that masks by the engine's (HF generate's) numerics against the trainer's alone
    opsm = dict(off_policy_mask_threshold=1e-6, fused_loss=layout == "opsm")
    trainer = TrainerConfig(max_steps=1, prompts_per_step=prompts_per_step, minibatch_size=8, grad_accum=2,
                            ppo_epochs=1, kl_coef=0.01, packing=packing, share_prompts=shared, lr=1e-6,  # 2 steps
                            **(dict(top_entropy_quantile=0.2, kl_kind="k3+") if layout == "entropy-mask" else {}),
                            **(opsm if layout.startswith("opsm") else {}))
    config = TrainConfig(output_dir="unused", model=ModelConfig(path="unused", gradient_checkpointing=True),
                         data=DataConfig(prompts="unused"), trainer=trainer, algorithm="grpo",
                         rollout=RolloutConfig(n=n, max_new_tokens=32 if where == "cuda" else 8,
                                               max_logprob_mismatch=None),
                         reward=RewardConfig(function="target_token"))
    actor = make_qwen2_on(device, dtype, **shape).train()
    actor.gradient_checkpointing_enable()
    reference = make_qwen2_on(device, dtype, **shape).requires_grad_(False)
    for model in (actor, reference):  # the attention model.attention: auto picks here (flex or flash-attn on CUDA)
        use_attention(model, packing, shared)
    guard = StepGuard()
    engine = build_train_engine(actor, DeepSpeedConfig(zero_stage=2, bf16=dtype == torch.bfloat16), lr=1e-6,
                                  micro_batch_size=2, grad_accum=2, max_grad_norm=1.0, guard=guard)
    scorer = RewardScorer(lambda prompt, completion, meta: sum(completion) % 7 / 7)  # rewards that differ
    step = CheckedStep(config, engine, HFEngine(engine.module), scorer, reference=reference,
                       pad_token_id=0, rollout_shares_actor=True, device=engine.device, guard=guard)
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(8, 48, (prompts_per_step,), generator=g)
    lengths = [24] * prompts_per_step if layout == "unpadded" else lengths
    prompts = [torch.randint(3, shape["vocab_size"], (int(length),), generator=g).tolist() for length in lengths]
    completions = None
    if layout == "unpadded":
        new = config.rollout.max_new_tokens
        completions = [[Completion(torch.randint(3, shape["vocab_size"], (new,), generator=g).tolist(), [0.0] * new,
                                   "length") for _ in range(n)] for _ in prompts]
    for n_step in (1, 2):  # DeepSpeed's engines change behaviour from their third optimizer step (timers)
        metrics = step(prompts, None, step=n_step, completions=completions)
        assert metrics["skipped"] == 0 and metrics["optimizer_steps"] == 2, metrics
        assert step.update_reads == [DECISION] * 2, (n_step, step.update_reads)
        # Outside it, one read before the update (its inputs' check) and one of the step's metrics.
        assert step.step_reads == [INPUTS_READ, DECISION, DECISION, METRICS_READ], (n_step, step.step_reads)
        assert metrics["grad_norm"] > 0 and metrics["policy_loss"] == metrics["policy_loss"], metrics
        if layout == "entropy-mask":
            assert 0.15 <= metrics["entropy_kept_fraction"] <= 0.3, metrics
        if layout.startswith("opsm"):  # logged, a fraction (what it masks depends on the device's numerics)
            print(f"\n{layout} on {where}, step {n_step}: masked {metrics['off_policy_masked_fraction']:.3f}")
            assert 0.0 <= metrics["off_policy_masked_fraction"] <= 1.0, metrics
