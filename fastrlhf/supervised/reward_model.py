"""``fastrlhf rm``: reward models on ``AutoModelForSequenceClassification``.

pairwise:   Bradley-Terry, loss = -logsigmoid(r_chosen - r_rejected - margin) (the data's margin, else 0),
            plus ``center_rewards_coefficient`` x mean((r_chosen + r_rejected)^2) where set (TRL's
            ``RewardTrainer.compute_loss``), accuracy = P(r_chosen > r_rejected); the export's config.json holds
            the ``mean`` and ``std`` of the final model's scores over the training pairs (:func:`reward_moments`)
classifier: cross-entropy over ``num_labels`` classes, accuracy of the argmax
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fastrlhf import distributed as D
from fastrlhf.algorithms import bradley_terry_loss
from fastrlhf.config import RMConfig
from fastrlhf.data import check_same_data, load_classification_examples, load_pairwise_examples
from fastrlhf.distributed import comm
from fastrlhf.engine.device import host_read, model_device, to_device
from fastrlhf.modeling import base_model, load_sequence_classifier, unwrap, use_attention, vocab_size
from fastrlhf.supervised import SupervisedJob, engine_config, micro_batch_size, run_supervised, seed_everything
from fastrlhf.supervised.evaluation import even_passes

__all__ = ["build_job", "pad_batch", "pairwise_loss", "classifier_loss", "load_eval_examples", "reward_moments",
           "rm_token_parts", "scores", "run"]


def pad_batch(sequences: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ``input_ids`` and ``attention_mask``, on the host."""
    length = max(len(s) for s in sequences)
    input_ids = torch.full((len(sequences), length), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(sequences), length), dtype=torch.long)
    for row, s in enumerate(sequences):
        input_ids[row, :len(s)] = torch.tensor(s)
        attention_mask[row, :len(s)] = 1
    return input_ids, attention_mask


def scores(engine, sequences: list[list[int]], pad_id: int, packed: bool = False) -> torch.Tensor:
    """``[S, num_labels]`` fp32 logits of each sequence at its last token, a closing eos included: a decoder's body
    runs and its score head is applied to each sequence's last hidden state. ``build_job`` marks the export
    (``fastrlhf.rl.forward.SCORE_POSITION``) so that the RL step (``reward_model_scores``) reads it there too.
    ``packed``: all sequences in one row (``fastrlhf.sequences.packing.PackedLayout``); otherwise right-padded.
    Not the model's own forward: transformers pools at the last id that is not the pad id, which skips a closing eos
    where the pad id is the eos (a config without a pad id), so the head would never see whether a reply ended
    (a cut one has no eos). transformers and TRL read such an export one token early. An encoder's head pools the
    first token: its own forward."""
    from fastrlhf.rl.forward import attention_mask_for, check_segments, classifier_body_and_head, pools_its_own
    from fastrlhf.sequences.packing import PackedLayout

    device = model_device(engine)
    model = base_model(unwrap(engine))
    if pools_its_own(model):  # as the RL step reads it (reward_model_scores)
        input_ids, attention_mask = to_device(pad_batch(sequences, pad_id), device)
        return model(input_ids=input_ids, attention_mask=attention_mask).logits.float()
    body, head = classifier_body_and_head(model)
    if not packed:
        input_ids, attention_mask = to_device(pad_batch(sequences, pad_id), device)
        # The mask comes built, not found by a device read (fastrlhf.sequences.masks).
        hidden = body(input_ids=input_ids, attention_mask=attention_mask_for(model, attention_mask),
                      use_cache=False).last_hidden_state
        last = attention_mask.sum(-1) - 1  # right-padded: each row's last attended position, on the device
        return head(hidden[torch.arange(len(sequences), device=device), last]).float()

    layout = PackedLayout.build([len(s) for s in sequences], [0] * len(sequences), device=device)
    input_ids = to_device(torch.tensor([t for s in sequences for t in s], dtype=torch.long)[None], device)
    check_segments(body, inputs := layout.model_kwargs())
    hidden = body(input_ids=input_ids, use_cache=False, **inputs).last_hidden_state
    return head(hidden[0, layout.last_index]).float()


def pairwise_loss(engine, pairs, pad_id: int, scale: float | None = None, packed: bool = False,
                  center: float | None = None):
    """Bradley-Terry loss: the mean over ``pairs`` (``scale``: ``scale`` x the sum, a micro-batch's share of
    a larger batch's mean), plus ``center`` x the mean of (r_chosen + r_rejected)^2 (``center_rewards_coefficient``);
    metrics ``accuracy`` and ``margin``, means (with ``scale``: sums)."""
    # Chosen and rejected go through one forward pass (one micro-batch): one batch of 2B sequences.
    sequences = [p.prompt_ids + p.chosen_ids for p in pairs] + [p.prompt_ids + p.rejected_ids for p in pairs]
    rewards = scores(engine, sequences, pad_id, packed)[:, 0]
    chosen, rejected = rewards[: len(pairs)], rewards[len(pairs):]
    # TRL's term, on the scores themselves (the margins below only shift the logistic term)
    centred = center * (chosen + rejected).square() if center else torch.zeros_like(chosen)
    # Metrics stay on the device (0-dim tensors): the step reads them once, with its guard decision.
    margin = (chosen - rejected).detach()
    if any(p.margin for p in pairs):  # the data's margins: chosen must score that much above rejected (as TRL)
        rejected = rejected + to_device(torch.tensor([p.margin for p in pairs], dtype=rewards.dtype), rewards.device)
    if scale is None:
        loss = bradley_terry_loss(chosen, rejected) + centred.mean()
        return loss, {"accuracy": (margin > 0).float().mean(), "margin": margin.mean()}
    loss = (bradley_terry_loss(chosen, rejected) + centred.mean()) * (len(pairs) * scale)
    return loss, {"accuracy": (margin > 0).float().sum(), "margin": margin.sum()}


REWARD_MOMENTS_READ = "the exported reward model's score moments"


def reward_moments(engine, pairs, pad_id: int, micro: int, packed: bool = False,
                   max_tokens: int | None = None) -> tuple[float, float]:
    """``(mean, std)`` of the scores of every pair's chosen and rejected sequence, over every rank's share of
    ``pairs`` (each rank scores ``pairs[rank::world]``, ``micro`` pairs a forward pass, or as many as
    ``max_tokens`` holds (``trainer.max_tokens_per_microbatch``, as training's micro-batches), as many passes on every
    rank: ZeRO-3 gathers in each). As OpenRLHF's ``rm_trainer.py`` measures them over its eval set for its config.json:
    ``torch.mean`` and ``torch.std`` (Bessel-corrected) of the chosen and rejected rewards, the std clamped at 1e-8.
    A collective: call it on every rank."""
    from fastrlhf.sequences.packing import fixed_count_groups, token_budget_groups

    world = D.world_size()

    def plan(share: list) -> list[list[int]]:
        if max_tokens is None:
            return fixed_count_groups(len(share), micro)
        return token_budget_groups([rm_token_parts(p, packed) for p in share], max_tokens, packed, 2)

    device = model_device(engine)
    totals = torch.zeros(3, dtype=torch.float64, device=device)  # count, sum, sum of squares
    model = unwrap(engine)
    training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for batch in even_passes([pairs[r::world] for r in range(world)], plan, D.rank()):
                counted = batch is not None  # else a stand-in pair's pass, not counted
                batch = batch if counted else pairs[:1]
                sequences = ([p.prompt_ids + p.chosen_ids for p in batch]
                             + [p.prompt_ids + p.rejected_ids for p in batch])
                rewards = scores(engine, sequences, pad_id, packed)[:, 0].double()
                if not counted:
                    rewards = torch.zeros_like(rewards[:0])
                totals += torch.stack([torch.tensor(float(rewards.numel()), dtype=torch.float64, device=device),
                                       rewards.sum(), rewards.square().sum()])
    finally:
        model.train(training)
    with host_read(REWARD_MOMENTS_READ):
        n, total, squares = comm.all_reduce_(totals).tolist()
    mean = total / n
    variance = max(squares - n * mean * mean, 0.0) / max(n - 1, 1)
    return mean, max(variance ** 0.5, 1e-8)


def classifier_loss(engine, examples, pad_id: int, scale: float | None = None, packed: bool = False):
    """Cross-entropy, mean over ``examples`` (``scale``: ``scale`` x the sum); ``accuracy`` (with ``scale``: a sum)."""
    logits = scores(engine, [e.input_ids for e in examples], pad_id, packed)
    labels = to_device(torch.tensor([e.label for e in examples]), logits.device)
    hits = (logits.detach().argmax(-1) == labels).float()
    if scale is None:
        return F.cross_entropy(logits, labels), {"accuracy": hits.mean()}
    loss = F.cross_entropy(logits, labels, reduction="sum") * scale
    return loss, {"accuracy": hits.sum()}


def rm_token_parts(example, packed: bool) -> tuple[int, ...]:
    """Tokens an example costs a micro-batch: a pair's two sequences (padded, each row as wide as the
    longer: two rows per pair), or one sequence."""
    if hasattr(example, "chosen_ids"):
        chosen, rejected = (len(example.prompt_ids) + len(ids) for ids in (example.chosen_ids, example.rejected_ids))
        return (chosen, rejected) if packed else (max(chosen, rejected),)
    return (len(example.input_ids),)


def build_job(config: RMConfig, model, examples: list, eval_examples: list | None = None) -> SupervisedJob:
    """The reward model's loss (``config.kind``) over ``examples`` for :func:`run_supervised` (``eval_examples``:
    the held-out ones of ``data.eval_path``)."""
    from fastrlhf.rl.forward import SCORE_POSITION

    pad_id = base_model(model).config.pad_token_id
    packed, pairwise = config.trainer.packing, config.kind == "pairwise"
    # Every export says where `scores` trains the head, so that the RL step reads it there and not where
    # transformers pools (a step back over a closing pad id)
    setattr(base_model(model).config, SCORE_POSITION, "last_token")
    for stale in ("mean", "std"):  # a starting folder's moments (an earlier export's) are not this model's
        if hasattr(base_model(model).config, stale):
            delattr(base_model(model).config, stale)

    def loss_fn(engine, micro_batch, scale):
        if pairwise:
            return pairwise_loss(engine, micro_batch, pad_id, scale, packed, config.center_rewards_coefficient)
        return classifier_loss(engine, micro_batch, pad_id, scale, packed)

    def store_moments(engine):
        # In the exported config.json, where reward.normalize: stored (and OpenRLHF's RewardModel) reads them
        config_of = base_model(unwrap(engine)).config
        config_of.mean, config_of.std = reward_moments(engine, examples, pad_id, micro_batch_size(config), packed,
                                                    config.trainer.max_tokens_per_microbatch)

    # The loss is the mean over the rank's step batch of pairs (examples); a pair stays in one micro-batch.
    return SupervisedJob(examples, model, loss_fn, bar_keys=("loss", "accuracy"), token_parts=rm_token_parts,
                         rows_per_item=2 if pairwise else 1, eval_examples=eval_examples,
                         mean_metrics=("accuracy", "margin") if pairwise else ("accuracy",),
                         before_export=store_moments if pairwise else None)


def load_examples(config: RMConfig, path: str | None = None) -> list:
    """The pairs or rows of ``data.path`` (or of ``path``, in its format), read and checked before any model loads."""
    d, vocab = config.data, vocab_size(config.model.path)
    kwargs = dict(chat_template_kwargs=d.chat_template_kwargs, overlong=d.overlong)
    if config.kind == "pairwise":
        return load_pairwise_examples(path or d.path, d.max_len, vocab, config.model.path, **kwargs)
    return load_classification_examples(path or d.path, d.max_len, config.resolved_num_labels, vocab,
                                        config.model.path, **kwargs)


def load_eval_examples(config: RMConfig) -> list | None:
    """``data.eval_path``'s pairs or rows, read and checked as ``data.path``'s (None without one)."""
    return load_examples(config, config.data.eval_path) if config.data.eval_path else None


def run(config: RMConfig, resume: bool = False) -> dict:
    seed_everything(config.seed)
    examples, eval_examples = load_examples(config), load_eval_examples(config)
    # After the data checks: bad data fails without starting a process group.
    D.init_distributed(shared_dir=config.output_dir)
    check_same_data()  # every node read the same copy: before any model loads
    model = load_sequence_classifier(config.model, config.resolved_num_labels, zero3_config=engine_config(config))
    use_attention(model, config.trainer.packing, backend=config.model.attention)
    return run_supervised(config, build_job(config, model, examples, eval_examples), resume=resume)
