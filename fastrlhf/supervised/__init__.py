"""The two stages before RL: ``fastrlhf sft`` (``sft``) and ``fastrlhf rm`` (``reward_model``, pairwise and
classifier), each a job (data, model, loss) run by the loop they share (``loop``: micro-batches, the
guarded optimizer step, checkpoints, export; ``evaluation``: the held-out data of ``data.eval_path``).
"""

from fastrlhf.supervised.loop import (
    SupervisedJob,
    build_evaluator,
    engine_config,
    micro_batch_size,
    micro_batches,
    rank_examples,
    rank_weight,
    run_supervised,
    seed_everything,
    train_on_batch,
)

__all__ = ["SupervisedJob", "build_evaluator", "engine_config", "micro_batch_size", "micro_batches", "rank_examples",
           "rank_weight", "run_supervised", "seed_everything", "train_on_batch"]
