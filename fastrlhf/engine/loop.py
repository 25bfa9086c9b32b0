"""The loop around one training step that ``fastrlhf train``, ``sft`` and ``rm`` share.

Resume from the latest checkpoint, then per step: run it, log its metrics, report a skipped update,
checkpoint every ``trainer.save_every`` steps. When the guard gives up (too many skipped steps in a
row) the step in hand is still logged, a checkpoint of the last good weights is written and the
error propagates, as it does when a step fails outright (:class:`~fastrlhf.engine.guards.StepFailed`);
after the last step: a final checkpoint and the Hugging Face export (``final/``).
What a step is (RL step, supervised minibatch) is the caller's ``step_fn``.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from fastrlhf import distributed as D
from fastrlhf.engine.checkpoint import load_latest, run_identity, save_checkpoint, write_text_atomic
from fastrlhf.engine.guards import StepFailed, TooManySkippedSteps
from fastrlhf.engine.step_profile import profile_step

__all__ = ["resume_step", "run_steps", "write_run_config"]


def write_run_config(config) -> None:
    """The fully resolved config (defaults, --set and ``auto`` precision applied) beside the run's outputs."""
    import yaml

    from fastrlhf.config import config_to_dict

    os.makedirs(config.output_dir, exist_ok=True)
    # fsynced before the rename: a power cut must not leave the run's config.yaml empty
    write_text_atomic(os.path.join(config.output_dir, "config.yaml"), yaml.safe_dump(config_to_dict(config),
                                                                                     sort_keys=False))


def resume_step(output_dir: str, stateful: dict, resume: bool, config=None) -> int:
    """The step to continue after: the latest checkpoint's (its state loaded into ``stateful``), or 0.
    ``config``: the run's, whose :func:`~fastrlhf.engine.checkpoint.run_identity` the checkpoint must match."""
    if not resume:
        return 0
    _agree_on_checkpoint(output_dir)
    restored = load_latest(output_dir, stateful, identity=run_identity(config) if config is not None else None)
    if restored is None:
        if D.is_main():
            print(f"note: --resume given but {output_dir} has no checkpoint; starting at step 0")
        return 0
    return restored["step"]


def _agree_on_checkpoint(output_dir: str) -> None:
    """Every rank must resume from the same checkpoint (one that a node cannot see, or sees older, would
    load different weights, or hang in the engines' collective loads): compared before anything loads."""
    from fastrlhf.distributed import comm
    from fastrlhf.engine.checkpoint import CheckpointError, latest_checkpoint

    mine = latest_checkpoint(output_dir) or ""
    seen = [b.decode() for b in comm.gather_bytes(mine.encode())]
    if len(set(seen)) > 1:
        from fastrlhf.distributed.multinode import where

        raise comm.agreed(CheckpointError(f"the ranks see different latest checkpoints in {output_dir}: "
                                          + "; ".join(f"rank {r}: {p or 'none'}" for r, p in enumerate(seen))
                                          + f" (this is {where()}); output_dir must be one folder shared by every "
                                          "node"))


def run_steps(config, step_fn: Callable[[int], dict], *, start_step: int, stateful: dict, logger, guard,
              skip_reason: str, export_engine, after_loop: Callable[[], None] | None = None,
              more_exports: dict | None = None) -> dict:
    """Steps ``start_step + 1 .. trainer.max_steps``; returns the last step's metrics.

    ``step_fn(step)`` returns the step's metrics with ``skipped`` set (from ``guard.end_step()``), and
    ``stop`` true to end the run after that step (every rank alike: the RL trainer sets it from reduced
    validation metrics). Once the guard's budget of skipped steps in a row is spent, the step is
    logged, a checkpoint is written and :class:`TooManySkippedSteps` propagates. ``after_loop`` runs
    once the loop ends, however it ends, before the final checkpoint (the RL trainer frees its
    rollout engine there). ``more_exports``: engines exported beside ``export_engine``, each into
    ``final/<its name>`` (the PPO critic with ``critic.export``).
    """
    t = config.trainer
    if D.is_main():
        write_run_config(config)
    metrics: dict = {}
    step = saved = start_step  # saved: the step of the newest checkpoint (the one resumed from, or written here)

    def save(at: int) -> None:
        nonlocal saved
        save_checkpoint(config.output_dir, at, stateful, keep_last=t.keep_checkpoints, identity=run_identity(config))
        saved = at

    try:
        for step in range(start_step + 1, t.max_steps + 1):
            with profile_step(config, step, D.rank()):
                metrics = step_fn(step)
            stop = bool(metrics.pop("stop", False))
            stopped = getattr(guard, "stopped_part_way", False)
            if stopped:  # not a skipped step: weights moved (and reached the rollout engine)
                metrics["update_stopped"] = 1
            # A validation's (eval/*) figures are logged whatever trainer.log_every says: they are few and costly
            evaluated = any(k.startswith("eval/") for k in metrics)
            if step % t.log_every == 0 or step == t.max_steps or stop or metrics["skipped"] or stopped or evaluated:
                logger.log(step, metrics)
            if metrics["skipped"]:
                logger.message(f"step {step}: {skip_reason}, update skipped "
                               f"({guard.skipped_in_row} in a row, {guard.skipped_total} in all)")
            elif stopped:
                logger.message(f"step {step}: {skip_reason} after {guard.moved_steps} optimizer steps had moved the "
                               "weights: the update stopped there, its remaining optimizer steps skipped "
                               f"({guard.stopped_in_row} in a row, {guard.stopped_total} in all)")
            guard.check_budget(step, skip_reason)
            if stop:
                logger.message(f"step {step}: stopping early, the validation target is reached")
                break
            if t.save_every and step % t.save_every == 0 and step < t.max_steps:
                save(step)
    except TooManySkippedSteps:
        # The skipped updates left the weights of the last good step: keep them.
        save(step)
        logger.close()
        raise
    except StepFailed as exc:
        # Keep the last good step: this one if it completed before failing (in validation), else the one
        # before (the failed step changed nothing, and its caller rewound its data).
        # Not again when trainer.save_every just wrote it: that copy holds the RNG state the step began with, where
        # one written now would hold the failed step's draws (and cost another full write of the model's state).
        good = step if getattr(exc, "completed_step", False) else step - 1
        if good > saved:
            save(good)
        logger.close()
        raise
    except KeyboardInterrupt:  # Ctrl-C: the command line names the last checkpoint and the --resume command
        logger.close()
        raise
    finally:
        if after_loop is not None:
            after_loop()
    logger.close()
    if not t.save_final:
        return metrics
    if step > start_step:  # a resumed run with no step left (killed in the export): its checkpoint is this one
        save(step)
    from fastrlhf.modeling import export_hf

    final = os.path.join(config.output_dir, "final")
    export_hf(export_engine, final, zero_stage=config.deepspeed.zero_stage, tokenizer_from=config.model.path)
    for name, engine in (more_exports or {}).items():  # after final/, which the actor's export replaces whole
        export_hf(engine, os.path.join(final, name), zero_stage=config.deepspeed.zero_stage,
                  tokenizer_from=config.model.path)
    return metrics
