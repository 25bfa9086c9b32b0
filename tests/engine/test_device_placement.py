"""Every command's training step with its models on a second device: no host tensor reaches a model,
and the update reads the device once per optimizer step, each read named.

**What a CPU-only run cannot see.** On a GPU the weights live on the device and every batch is built
on the host; a batch tensor that never moved fails at the first op that mixes it with the weights
("index is on cpu, different from other tensors on cuda:0": ``fastrlhf sft`` and ``fastrlhf rm`` did,
at step 1 on an H200, while every CPU test passed). On a CPU host and model share one device, so that
tensor works. Here the models live on :class:`helpers.other_device.OtherDevice`, an emulated second
device whose tensors compute on the CPU but refuse host tensors exactly where CUDA does, and which
records every read of a device value (the stalls ``torch.cuda.set_sync_debug_mode`` reports).

**Why a new code path cannot skip it.** The emulator checks every op, whatever function built its
tensors, so nothing in the code under test has to opt in. What the test chooses is which steps run,
and it runs whole steps: the supervised commands through ``fastrlhf.supervised.train_on_batch`` with
the job each command builds (``sft.build_job``, ``reward_model.build_job``), the RL command through
``RLStep.__call__`` (generation, scoring with a reward model, reference, critic, update, validation),
in every layout (padded, packed, shared prompts) and model kind the configs choose between;
:func:`test_every_command_runs_here` fails when the CLI gains a command this file does not run.
"""

import copy
import dataclasses

import pytest
import torch
from helpers.other_device import MixedDevices, OtherDevice

from fastrlhf.cli import COMMANDS
from fastrlhf.config import (
    CriticConfig,
    DataConfig,
    ModelConfig,
    RewardConfig,
    RMConfig,
    RMDataConfig,
    RolloutConfig,
    SFTConfig,
    SFTDataConfig,
    SFTTrainerConfig,
    TrainConfig,
    TrainerConfig,
)
from fastrlhf.data import ClassificationExample, PairExample, SFTExample
from fastrlhf.engine.guards import INPUTS_READ, StepGuard
from fastrlhf.modeling import CausalLMWithValueHead, use_attention
from fastrlhf.modeling.tiny import make_tiny_llama, tiny_llama_config
from fastrlhf.rl.dynamic_sampling import FILTER_READ
from fastrlhf.rl.rewards import RewardScorer
from fastrlhf.rl.step import RLStep
from fastrlhf.rl.step_metrics import METRICS_READ
from fastrlhf.rl.update import TorchLearner
from fastrlhf.rollout.hf_engine import HFEngine
from fastrlhf.supervised import reward_model, sft, train_on_batch

VOCAB = 64
SUPERVISED = [("sft", None, False), ("sft", None, True), ("rm", "pairwise", False), ("rm", "pairwise", True),
              ("rm", "classifier", False), ("rm", "classifier", True)]
RL = ["grpo", "grpo-packed", "grpo-shared", "grpo-on-policy", "grpo-rloo", "grpo-reinforce-pp", "grpo-dapo",
      "grpo-batch-std", "grpo-synced", "ppo", "ppo-packed"]
COVERED = {"sft": SUPERVISED, "rm": SUPERVISED, "train": RL}
# Packed rows run model.attention: sdpa (one call per sequence), which a GPU runs too. What a packed row
# brings to the attention is the same for every backend (its block mask and bounds, built on the host:
# fastrlhf.sequences.packing.PackedLayout.model_kwargs), and is checked here; flex's and flash-attn's kernels take
# only those device tensors, and cannot run on the emulated device (FlexAttention traces its backward
# with fake tensors of its own).
GPU_ATTENTION = "sdpa"


def test_every_command_runs_here():
    assert set(COMMANDS) == set(COVERED), f"run the step of every CLI command on the other device: {set(COMMANDS)}"


def tiny_lm(seed=0, **kwargs):
    return make_tiny_llama(seed=seed, vocab_size=VOCAB, hidden_size=32, num_layers=2, num_heads=1, **kwargs)


def tiny_classifier(num_labels):
    from transformers import LlamaForSequenceClassification

    torch.manual_seed(4)
    return LlamaForSequenceClassification(tiny_llama_config(vocab_size=VOCAB, hidden_size=32, num_heads=1,
                                                            num_labels=num_labels, pad_token_id=0))


def supervised_examples(command, kind):
    g = torch.Generator().manual_seed(0)

    def ids(n, lo=3, hi=VOCAB):
        return torch.randint(lo, hi, (n,), generator=g).tolist()

    if command == "sft":
        # Odd rows: a chat's two assistant turns with a user turn between them (data.assistant_turns: all).
        return [SFTExample(ids(2 + i % 3), ids(4), [1, 0, 0, 1]) if i % 2
                else SFTExample(ids(2 + i % 3), ids(1 + i % 4)) for i in range(6)]
    if kind == "pairwise":
        return [PairExample(ids(3), ids(2 + i % 2, 3, 20), ids(3 - i % 2, 44)) for i in range(6)]
    return [ClassificationExample(ids(3 + i % 3), i % 2) for i in range(6)]


def supervised_config(command, kind, packing):
    trainer = dict(max_steps=1, batch_size=6, packing=packing, loss_chunk_size=4)
    common = dict(output_dir="unused", model=ModelConfig(path="unused", attention=GPU_ATTENTION))
    if command == "sft":
        return SFTConfig(**common, data=SFTDataConfig(path="unused"), trainer=SFTTrainerConfig(**trainer))
    return RMConfig(**common, data=RMDataConfig(path="unused"), trainer=SFTTrainerConfig(**trainer), kind=kind)


@pytest.mark.parametrize("command,kind,packing", SUPERVISED,
                         ids=[f"{c}-{k or 'lm'}-{'packed' if p else 'padded'}" for c, k, p in SUPERVISED])
def test_supervised_step_on_another_device(command, kind, packing):
    config = supervised_config(command, kind, packing)
    model = tiny_lm() if command == "sft" else tiny_classifier(2 if kind == "classifier" else 1)
    use_attention(model, packing, backend=config.model.attention)
    examples = supervised_examples(command, kind)
    build = sft.build_job if command == "sft" else reward_model.build_job
    with OtherDevice() as dev:
        model = dev.move(model.train())
        job = build(config, model, examples)
        learner = TorchLearner(model, torch.optim.AdamW(model.parameters(), lr=1e-3), max_grad_norm=1.0,
                               guard=StepGuard())
        before = len(dev.reads)
        sums = train_on_batch(job, learner, examples, micro=3, max_tokens=None, packed=packing)
        reads = dev.reads[before:]
    assert sums["loss"] > 0 and all(map(_finite, sums.values())), sums
    assert learner.grad_norm() is not None and learner.grad_norm() > 0
    # One optimizer step, one read: the guard's decision, which brings the loss and metrics along.
    assert [name for name, _, _ in reads] == ["the optimizer step's skip decision and metrics"], reads


def test_the_emulated_device_refuses_a_host_batch_as_cuda_does():
    """The check itself: the step of 685d1f7, which handed the model its collated host batch."""
    model = tiny_lm()
    batch = sft.collate_sft([SFTExample([3, 4, 5], [6, 7])], pad_id=0)
    with OtherDevice() as dev, pytest.raises(MixedDevices, match="host tensor"):
        sft.sft_loss(dev.move(model), batch)


def _finite(x) -> bool:
    return x == x and abs(x) != float("inf")


# ------------------------------------------------------------------------------------------ RL


def rl_config(case):
    algorithm = "ppo" if case.startswith("ppo") else "grpo"
    on_policy = case == "grpo-on-policy"
    trainer = TrainerConfig(max_steps=1, prompts_per_step=3, minibatch_size=6 if not on_policy else 12,
                            ppo_epochs=1 if on_policy else 2, grad_accum=2, kl_coef=0.05, loss_chunk_size=5,
                            packing=case.endswith(("packed", "shared")), share_prompts=case.endswith("shared"),
                            tis_cap=None if on_policy else 2.0,
                            # packed: the completions' own ratios (geometric means), masked beyond [0.5, 2]
                            **(dict(tis_level="geometric", tis_mode="mask", tis_floor=0.5)
                               if case.endswith("packed") else {}),
                            # the critic-free estimators beside GRPO's; REINFORCE++ with the KL in its token rewards
                            adv_estimator={"grpo-rloo": "rloo", "grpo-reinforce-pp": "reinforce_plus_plus"}.get(case,
                                                                                                               "auto"),
                            kl_in_reward=case == "grpo-reinforce-pp",
                            # DAPO: dynamic sampling (two rounds at most) and the overlong penalty below
                            filter_groups=case == "grpo-dapo", max_sampling_rounds=2,
                            scale_by_std="batch" if case == "grpo-batch-std" else True)
    rollout = RolloutConfig(n=4, max_new_tokens=5, temperature=1.0, max_logprob_mismatch=None)
    reward = RewardConfig(model_path="unused", overlong_buffer=3 if case == "grpo-dapo" else None)
    return TrainConfig(output_dir="unused", model=ModelConfig(path="unused"), data=DataConfig(prompts="unused"),
                       trainer=trainer, rollout=rollout, reward=reward,
                       critic=CriticConfig() if algorithm == "ppo" else None, algorithm=algorithm)


class RecordedStep(RLStep):
    """The RL step, with the reads of its update (all micro-batches and optimizer steps) and of its generation
    (the HF engine's, which vLLM does not make) kept apart from the rest of the step's (:attr:`other_reads`)."""

    def __init__(self, dev, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.dev, self.update_reads, self.other_reads, self._apart = dev, [], [], set()

    def __call__(self, *args, **kwargs):
        before, self._apart = len(self.dev.reads), set()
        metrics = super().__call__(*args, **kwargs)
        self.other_reads = [r for i, r in enumerate(self.dev.reads[before:], before) if i not in self._apart]
        return metrics

    def _recorded(self, run):
        before = len(self.dev.reads)
        out = run()
        self._apart.update(range(before, len(self.dev.reads)))
        return out, self.dev.reads[before:]

    def update(self, exp, step):
        metrics, self.update_reads = self._recorded(lambda: super(RecordedStep, self).update(exp, step))
        return metrics

    def generate(self, *args, **kwargs):
        return self._recorded(lambda: super(RecordedStep, self).generate(*args, **kwargs))[0]


@pytest.mark.parametrize("case", RL)
def test_rl_step_on_another_device(case):
    from fastrlhf.rl.validation import Validator

    # The engine's mismatch check is on: it is read with the update's inputs (the HF engine samples with the actor).
    config = dataclasses.replace(rl_config(case), rollout=dataclasses.replace(rl_config(case).rollout,
                                                                              max_logprob_mismatch=1.0))
    t = config.trainer
    actor, reference = tiny_lm(seed=0), tiny_lm(seed=0)
    critic = CausalLMWithValueHead(tiny_lm(seed=5)) if config.algorithm == "ppo" else None
    scorer_model = tiny_classifier(1)
    for model in (actor, reference, scorer_model, critic.lm if critic is not None else None):
        if model is not None:
            use_attention(model, t.packing, t.share_prompts, GPU_ATTENTION)
    prompts = [[5, 6, 7, 8], [9, 10], [11, 12, 13]]
    with OtherDevice() as dev:
        actor, reference, scorer_model = dev.move(actor.train()), dev.move(reference.eval()), dev.move(scorer_model)
        critic = dev.move(critic.train()) if critic is not None else None
        scorer = RewardScorer(reward_model=scorer_model.eval().requires_grad_(False), micro_batch=4, packed=t.packing)
        # grpo-synced: an engine with weights of its own (as vLLM's), so the step's bucketed sync runs here too
        synced = case == "grpo-synced"
        engine = HFEngine(dev.move(tiny_lm(seed=0).eval()) if synced else actor)
        step = RecordedStep(dev, config, actor, engine, scorer, reference=reference, critic=critic,
                            actor_optimizer=torch.optim.AdamW(actor.parameters(), lr=1e-3),
                            critic_optimizer=torch.optim.AdamW(critic.parameters(), lr=1e-3) if critic else None,
                            pad_token_id=0, rollout_shares_actor=not synced, device=dev.device, guard=StepGuard())
        more = (lambda: (prompts[::-1], [{}] * 3)) if t.filter_groups else None
        metrics = step(prompts, None, step=1, more_prompts=more)
        validation = Validator(prompts, [{}] * 3, step.score_rollout, step.rollout, step.sampling(1))(1)
        same = all(torch.equal(a, b) for a, b in zip(actor.parameters(), engine.model.parameters(), strict=True))
    assert metrics["skipped"] == 0 and metrics["optimizer_steps"] > 0, metrics
    assert same and (metrics["sync_bytes"] > 0) == synced, metrics  # the engine generates with the new weights
    assert all(map(_finite, [v for k, v in metrics.items() if not k.startswith("time/")])), metrics
    assert set(validation) >= {"eval/reward_mean", "eval/accuracy"}
    # The update reads the device once per optimizer step (the guard's decision), actor and critic alike.
    steps = int(metrics["optimizer_steps"]) * (2 if critic is not None else 1)
    names = [name for name, _, _ in step.update_reads]
    assert names == ["the optimizer step's skip decision and metrics"] * steps, step.update_reads
    # Outside generation and the update: one read before the update (its inputs' check, with the engine's
    # mismatch), one of the step's metrics; dynamic sampling also one per round (which groups differ).
    others = [name for name, _, _ in step.other_reads if name != FILTER_READ]
    assert others == [INPUTS_READ, METRICS_READ], step.other_reads
    assert len(step.other_reads) - 2 == (0 if case != "grpo-dapo" else metrics["sampling/rounds"]), step.other_reads


def test_a_reference_on_the_host_is_caught():
    """A model the trainer forgot to move (here the reference) fails the step as it would on a GPU."""
    config = rl_config("grpo")
    actor, reference = tiny_lm(), tiny_lm()
    scorer_model = tiny_classifier(1)
    with OtherDevice() as dev, pytest.raises(MixedDevices):
        actor = dev.move(actor.train())
        scorer = RewardScorer(reward_model=dev.move(scorer_model).eval(), micro_batch=4)
        RLStep(config, actor, HFEngine(actor), scorer, reference=copy.deepcopy(reference).eval(),
               actor_optimizer=torch.optim.AdamW(actor.parameters(), lr=1e-3), pad_token_id=0,
               rollout_shares_actor=True, device=dev.device)([[5, 6, 7]], None, step=1)


@pytest.mark.parametrize("groups", [None, [0, 0, 1]], ids=["packed", "shared"])
def test_a_packed_rows_attention_arguments_live_on_the_device_and_read_nothing(groups):
    """What every backend gets of a packed row (flex its block mask, flash-attn its cu_seqlens) is built on
    the host and moved: on the device, with no read of a device value on the way."""
    from helpers.other_device import DeviceTensor

    from fastrlhf.sequences.packing import PackedLayout

    with OtherDevice() as dev:
        kwargs = PackedLayout.build([3, 3, 5], [4, 2, 0], device=dev.device, prompt_groups=groups).model_kwargs()
        assert dev.reads == []
        mask = kwargs["attention_mask"]
        moved = (mask.kv_num_blocks, mask.kv_indices, mask.full_kv_num_blocks, mask.full_kv_indices,
                 mask.q_num_blocks, mask.q_indices, kwargs["fastrlhf_rows"].cu, kwargs["position_ids"])
        assert all(isinstance(t, DeviceTensor) for t in moved)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen2-critic"])
def test_micro_batches_without_padding_read_nothing(arch):
    """Prompts of one length and completions that all run to the token limit make micro-batches with no
    padding. Given neither a mask nor positions, transformers would read the device to look for packed
    sequences in the positions it makes up (``find_packed_sequence_indices``): a stall per forward on a GPU,
    and an error under ``torch.cuda.set_sync_debug_mode("error")``. The score stage and the update read only
    what they name, in every forward: the actor's, the reference's, the critic's, the reward model's."""
    from transformers import Qwen2ForSequenceClassification

    from fastrlhf.modeling.tiny import make_tiny_qwen2, tiny_qwen2_config
    from fastrlhf.rollout import Completion

    config = rl_config("ppo" if arch.endswith("critic") else "grpo")
    make = (lambda seed: tiny_lm(seed=seed)) if arch == "llama" else \
        (lambda seed: make_tiny_qwen2(seed=seed, vocab_size=VOCAB, hidden_size=32, num_heads=2))
    actor, reference = make(0), make(0)
    critic = CausalLMWithValueHead(make(5)) if arch.endswith("critic") else None
    torch.manual_seed(4)
    scorer_model = tiny_classifier(1) if arch == "llama" else Qwen2ForSequenceClassification(
        tiny_qwen2_config(vocab_size=VOCAB, hidden_size=32, num_heads=2, num_labels=1, pad_token_id=0))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, VOCAB, (4,), generator=g).tolist() for _ in range(3)]
    completions = [[Completion(torch.randint(3, VOCAB, (5,), generator=g).tolist(), [0.0] * 5, "length")
                    for _ in range(4)] for _ in prompts]
    with OtherDevice() as dev:
        actor, reference = dev.move(actor.train()), dev.move(reference.eval())
        critic = dev.move(critic.train()) if critic is not None else None
        scorer = RewardScorer(reward_model=dev.move(scorer_model).eval().requires_grad_(False), micro_batch=4)
        step = RecordedStep(dev, config, actor, HFEngine(actor), scorer, reference=reference,
                            critic=critic, actor_optimizer=torch.optim.AdamW(actor.parameters(), lr=1e-3),
                            critic_optimizer=torch.optim.AdamW(critic.parameters(), lr=1e-3) if critic else None,
                            pad_token_id=0, rollout_shares_actor=True, device=dev.device, guard=StepGuard())
        metrics = step(prompts, None, step=1, completions=completions)
    assert metrics["skipped"] == 0 and metrics["optimizer_steps"] > 0, metrics
    # Outside the update the step reads twice, each read named; a forward pass reads nothing.
    assert [name for name, _, _ in step.other_reads] == [INPUTS_READ, METRICS_READ], step.other_reads
    steps = int(metrics["optimizer_steps"]) * (2 if critic is not None else 1)
    assert [name for name, _, _ in step.update_reads] == ["the optimizer step's skip decision and metrics"] * steps
