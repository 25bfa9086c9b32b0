"""The held-out evaluation of ``fastrlhf sft`` and ``fastrlhf rm`` (fastrlhf.supervised.evaluation) on tiny fp32
models, the hand computations its metrics are compared to, and the target of its two-rank (gloo) test."""

import torch
import torch.nn.functional as F

from fastrlhf.config import ModelConfig, RMConfig, RMDataConfig, SFTConfig, SFTDataConfig, SFTTrainerConfig
from fastrlhf.data import ClassificationExample, PairExample, SFTExample
from fastrlhf.modeling import use_attention
from fastrlhf.modeling.tiny import make_tiny_llama, tiny_llama_config
from fastrlhf.supervised import build_evaluator, reward_model, sft

VOCAB = 64


def _ids(g, n, lo=3, hi=VOCAB):
    return torch.randint(lo, hi, (n,), generator=g).tolist()


def sft_examples(n=7):
    """Lengths that differ, a chat whose second assistant turn only trains (a response mask), and a ``text`` row
    (no prompt: its first token is predicted by nothing)."""
    g = torch.Generator().manual_seed(1)
    out = [SFTExample(_ids(g, 1 + i % 4), _ids(g, 2 + (3 * i) % 5)) for i in range(n - 2)]
    out.append(SFTExample(_ids(g, 3), _ids(g, 5), [1, 1, 0, 0, 1]))
    out.append(SFTExample([], _ids(g, 6)))
    return out


def pair_examples(n=7):
    g = torch.Generator().manual_seed(2)
    return [PairExample(_ids(g, 2 + i % 2), _ids(g, 1 + i % 3), _ids(g, 3 - i % 2), margin=0.5 * (i % 3 == 0))
            for i in range(n)]


def class_examples(n=7, num_labels=3):
    g = torch.Generator().manual_seed(3)
    return [ClassificationExample(_ids(g, 2 + i % 4), i % num_labels) for i in range(n)]


def tiny_lm(dropout=0.0):
    return make_tiny_llama(seed=0, vocab_size=VOCAB, hidden_size=32, num_layers=2, num_heads=2,
                           attention_dropout=dropout)


def tiny_classifier(num_labels, dropout=0.0):
    from transformers import LlamaForSequenceClassification

    torch.manual_seed(4)
    return LlamaForSequenceClassification(tiny_llama_config(vocab_size=VOCAB, hidden_size=32, num_heads=2,
                                                            num_labels=num_labels, pad_token_id=0,
                                                            attention_dropout=dropout))


def config(command, kind=None, **trainer):
    """A config of ``command`` (paths unused: the examples are built here), ``trainer`` its trainer settings."""
    t = SFTTrainerConfig(**{"max_steps": 1, "batch_size": 8, "fused_loss": False, **trainer})
    common = dict(output_dir="unused", model=ModelConfig(path="unused", attention="sdpa"), trainer=t)
    if command == "sft":
        return SFTConfig(**common, data=SFTDataConfig(path="unused"))
    return RMConfig(**common, data=RMDataConfig(path="unused"), kind=kind)


def evaluator(cfg, model, examples, micro, rank=0, world=1):
    """The evaluation the run builds (``fastrlhf.supervised.build_evaluator``) of ``examples`` held out."""
    use_attention(model, cfg.trainer.packing, backend=cfg.model.attention)
    build = sft.build_job if isinstance(cfg, SFTConfig) else reward_model.build_job
    job = build(cfg, model, examples[:1], examples)
    return build_evaluator(job, cfg.trainer, micro, rank, world)


@torch.no_grad()
def hand_sft(model, examples) -> float:
    """The token mean of the negative log-likelihood over every trained token of ``examples``: each sequence alone
    through the model's own forward, ``F.cross_entropy`` summed at the trained positions."""
    total, count = 0.0, 0
    for e in examples:
        ids = torch.tensor([e.prompt_ids + e.response_ids])
        logits = model(input_ids=ids).logits[0].double()
        mask = [1] * len(e.response_ids) if e.response_mask is None else e.response_mask
        for k, trained in enumerate(mask):
            position = len(e.prompt_ids) + k
            if trained and position > 0:  # nothing predicts a sequence's first token
                total += F.cross_entropy(logits[position - 1][None], ids[0, position][None], reduction="sum").item()
                count += 1
    return total / count


@torch.no_grad()
def _score(model, ids) -> torch.Tensor:
    """The model's own forward on one unpadded sequence (no pad id in it: it pools the last token)."""
    return model(input_ids=torch.tensor([ids])).logits[0].double()


def hand_pairwise(model, pairs) -> dict:
    """TRL's ``RewardTrainer.compute_loss`` (trl/trainer/reward_trainer.py): ``-logsigmoid(chosen - rejected -
    margin).mean()``; accuracy ``(chosen > rejected)`` and margin ``chosen - rejected`` averaged over every pair."""
    chosen = torch.stack([_score(model, p.prompt_ids + p.chosen_ids)[0] for p in pairs])
    rejected = torch.stack([_score(model, p.prompt_ids + p.rejected_ids)[0] for p in pairs])
    margins = torch.tensor([p.margin for p in pairs], dtype=torch.float64)
    return {"eval/loss": -F.logsigmoid(chosen - rejected - margins).mean().item(),
            "eval/accuracy": (chosen > rejected).double().mean().item(),
            "eval/margin": (chosen - rejected).mean().item()}


def hand_classifier(model, rows) -> dict:
    logits = torch.stack([_score(model, r.input_ids) for r in rows])
    labels = torch.tensor([r.label for r in rows])
    return {"eval/loss": F.cross_entropy(logits, labels).item(),
            "eval/accuracy": (logits.argmax(-1) == labels).double().mean().item()}


CASES = {  # name: (command, kind, model, examples)
    "sft": ("sft", None, tiny_lm, sft_examples),
    "pairwise": ("rm", "pairwise", lambda: tiny_classifier(1), pair_examples),
    "classifier": ("rm", "classifier", lambda: tiny_classifier(3), class_examples),
}


RANK_CASES = [("sft", False, 12), ("sft", True, None), ("pairwise", True, 12), ("classifier", False, None)]
RANK_MICRO = 3  # seven examples dealt 4 + 3: by count, two micro-batches on one rank, one on the other


def evaluate_rank(rank: int, port: int, out) -> None:
    """:data:`RANK_CASES` (case, packing, token budget) on two gloo ranks, dealt by tokens: the metrics, how many
    forwards this rank ran and how many of them were fillers."""
    import datetime

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                           timeout=datetime.timedelta(seconds=120))
    try:
        results = {}
        for name, packing, max_tokens in RANK_CASES:
            command, kind, make, examples = CASES[name]
            cfg = config(command, kind, packing=packing, max_tokens_per_microbatch=max_tokens, balance_ranks=True)
            model = make().train()
            evaluate = evaluator(cfg, model, examples(), micro=RANK_MICRO, rank=rank, world=2)
            forwards = []
            loss_fn = evaluate.job.loss_fn
            evaluate.job.loss_fn = lambda *a, _f=loss_fn, _n=forwards: (_n.append(1), _f(*a))[1]
            results[name, packing, max_tokens] = (evaluate(model), len(forwards), evaluate.fillers)
        out[rank] = results
    finally:
        dist.destroy_process_group()
