"""The ``auto`` settings of ``fastrlhf train`` that the memory plan decides, before any model loads:

- ``model.gradient_checkpointing: auto``: off where the run fits without it (no forward repeated in the update's
  backward: about a quarter less update time), else on for the fewest decoder layers that fit
  (``model.checkpoint_layers``: the first ones; the others keep their activations), all where none do.
- ``trainer.max_tokens_per_microbatch: auto``: the update's micro-batches as large as fit, in whole longest
  sequences (``max_prompt_len + max_new_tokens``) up to the rank's whole minibatch share: fewer, larger GEMMs.

With both ``auto``, checkpointing is off only where a micro-batch of at least :data:`EFFICIENT_MICRO_TOKENS` (or
the whole share, if smaller) fits without it: a run that would fit only in tiny micro-batches loses to slow GEMMs
more than checkpointing's recompute costs. Each decision's reason goes first in the plan's notes, and
:func:`resolve_auto_settings` writes the decided values into the config (its saved ``config.yaml`` says what ran).

Nothing here reads a model or imports torch: ``plan_of`` (one config -> its :class:`~fastrlhf.memory.plan.MemoryPlan`)
is ``plan_memory`` itself, passed in by it.
"""

from __future__ import annotations

import math
from dataclasses import replace

from fastrlhf.memory import components as C

__all__ = ["EFFICIENT_MICRO_TOKENS", "agree_over_ranks", "decides", "plan_deciding", "resolve_auto_settings"]

# A bf16 GEMM of this many rows runs near a GPU's peak at the hidden sizes RL trains (1.5B: H=1,536). An
# estimate from the GEMM arithmetic (rows x H x H per weight read), not yet a measurement of this trainer.
EFFICIENT_MICRO_TOKENS = 4096
CHECKPOINTING, MICRO_TOKENS = "model.gradient_checkpointing", "trainer.max_tokens_per_microbatch"


def decides(config) -> bool:
    """Whether ``config`` holds a setting this module decides."""
    return config.model.gradient_checkpointing == "auto" or config.trainer.max_tokens_per_microbatch == "auto"


def _with(config, checkpointing=None, tokens=None, layers=None):
    if checkpointing is not None:  # ``layers``: model.checkpoint_layers (None: all)
        config = replace(config, model=replace(config.model, gradient_checkpointing=checkpointing,
                                               checkpoint_layers=layers if checkpointing else None))
    if tokens is not None:
        config = replace(config, trainer=replace(config.trainer, max_tokens_per_microbatch=tokens))
    return config


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.2f}"


def plan_deciding(config, gpus: int, plan_of):
    """The plan with every ``auto`` setting decided (see the module docstring); its ``notes`` start with the
    reasons, and ``gradient_checkpointing`` / ``max_tokens_per_microbatch`` hold what it counted."""
    length = C.seq_len(config)
    share = max(1, config.trainer.minibatch_size // gpus)  # sequences a micro-batch may hold (grad_accum is 1)
    tokens_auto = config.trainer.max_tokens_per_microbatch == "auto"
    reasons = []
    if config.model.gradient_checkpointing == "auto":
        # Without tokens auto: at the configured micro-batch; with it: at the smallest efficient one.
        sequences = min(share, -(-EFFICIENT_MICRO_TOKENS // length))
        tokens = sequences * length if tokens_auto else None
        without = plan_of(_with(config, False, tokens))
        at = f" in micro-batches of {tokens:,} tokens" if tokens_auto else ""
        if without.fits:
            reasons.append(f"{CHECKPOINTING} auto: off: the run fits without it ({_gib(without.total)} of "
                           f"{_gib(without.budget)} GiB{at})")
            config, plan = _with(config, checkpointing=False), without
        else:
            layers, plan = _fewest_checkpointed(_with(config, True, tokens), without.layers, plan_of)
            some = f" for the first {layers} of {without.layers} layers ({_gib(plan.total)} GiB)" if layers else ""
            reasons.append(f"{CHECKPOINTING} auto: on{some}: without it the run needs {_gib(without.total)} of "
                           f"{_gib(without.budget)} GiB{at}")
            config = _with(config, checkpointing=True, layers=layers)
    if tokens_auto:
        plan, reason = _largest_micro_batch(config, length, share, plan_of)
        reasons.append(reason)
    plan.notes[:0] = reasons
    return plan


def _fewest_checkpointed(config, layers: int, plan_of):
    """``(checkpoint_layers, plan)``: the fewest checkpointed layers that fit (binary search: memory falls with each
    one), None (all) where none do. At most all but the last layer: the backward recomputes that one at once, so
    checkpointing it saves little (the plan counts its kept input as a cost; 3-26% of another layer's saving
    measured on a CPU)."""
    def plan_at(k: int):
        return plan_of(_with(config, checkpointing=True, layers=k))

    high = max(1, layers - 1)
    best = plan_at(high)
    if not best.fits or high == layers:
        return None, plan_of(_with(config, checkpointing=True))
    return _bisect(high, 0, plan_at, best)  # 0 layers (off) does not fit: the caller asked


def _bisect(fits: int, fails: int, plan_at, best):
    """``(value, plan)``: the value next to the boundary between ``fits`` (whose plan ``best`` fits) and ``fails``
    (whose does not), on the fitting side; either may be the larger."""
    while abs(fails - fits) > 1:
        mid = (fits + fails) // 2
        candidate = plan_at(mid)
        if candidate.fits:
            fits, best = mid, candidate
        else:
            fails = mid
    return fits, best


def _largest_micro_batch(config, length: int, share: int, plan_of):
    """The plan with the most whole sequences per micro-batch that fit (binary search: memory grows with them),
    one sequence where none fits, and the reason."""
    def plan_at(sequences: int):
        return plan_of(_with(config, tokens=sequences * length))

    low, best = 1, plan_at(1)
    if best.fits and share > 1:
        top = plan_at(share)
        low, best = (share, top) if top.fits else _bisect(1, share, plan_at, best)
    if not best.fits:
        why = f"{length:,} (one sequence; even that needs {_gib(best.total)} of {_gib(best.budget)} GiB)"
    elif low == share:
        why = f"{low * length:,}: the whole minibatch share ({share} sequences of {length:,} tokens) fits"
    else:
        why = (f"{low * length:,}: {low} of the share's {share} sequences of {length:,} tokens fit "
               f"({_gib(best.total)} of {_gib(best.budget)} GiB); {low + 1} would not")
    return best, f"{MICRO_TOKENS} auto: {why}"


def resolve_auto_settings(config, plan):
    """``(config, notes)``: the config with its ``auto`` settings as ``plan`` decided them, and each decision's
    reason (none: nothing was ``auto``). Without a plan (an architecture it cannot count): checkpointing on and one
    longest sequence per micro-batch, the safe side, said so."""
    notes = []
    if config.model.gradient_checkpointing == "auto":
        on = True if plan is None else plan.gradient_checkpointing
        notes.append(f"{CHECKPOINTING} auto: on: no plan" if plan is None else
                     next(n for n in plan.notes if n.startswith(CHECKPOINTING)))
        config = _with(config, checkpointing=on, layers=None if plan is None else plan.checkpoint_layers)
    if config.trainer.max_tokens_per_microbatch == "auto":
        tokens = C.seq_len(config) if plan is None else plan.max_tokens_per_microbatch
        notes.append(f"{MICRO_TOKENS} auto: {tokens:,} (one sequence): no plan" if plan is None else
                     next(n for n in plan.notes if n.startswith(MICRO_TOKENS)))
        config = _with(config, tokens=tokens)
    return config, notes


def agree_over_ranks(config, decided, max_over_ranks):
    """``(decided, note)``: the ``auto`` settings of ``config`` as every rank runs them. Each rank's plan reads its
    own budget (on a CPU, the host's free memory when it looked), so ranks may decide differently, and under ZeRO-3 a
    rank that recomputes its forward gathers parameters the others do not: a hang. Every rank takes the most cautious
    decision of any: checkpointing on where one rank needs it, the fewest micro-batch tokens. ``max_over_ranks``:
    a list of floats -> their element-wise maximum over the ranks (one collective); the note says what changed
    where this rank's own decision did."""
    m, tokens = decided.model, decided.trainer.max_tokens_per_microbatch
    checkpointed = 0.0 if m.gradient_checkpointing is not True else (
        math.inf if m.checkpoint_layers is None else float(m.checkpoint_layers))
    most, fewest = max_over_ranks([checkpointed, -float(tokens or 0)])
    auto_checkpointing = config.model.gradient_checkpointing == "auto"
    agreed = _with(decided, checkpointing=most > 0 if auto_checkpointing else None,
                   layers=None if math.isinf(most) else int(most),
                   tokens=int(-fewest) if config.trainer.max_tokens_per_microbatch == "auto" else None)
    if agreed == decided:
        return decided, None
    layers = agreed.model.checkpoint_layers
    said = [f"{CHECKPOINTING} " + ("off" if not agreed.model.gradient_checkpointing else
                                    "on" if layers is None else f"on for the first {layers} layers")] \
        if auto_checkpointing else []
    said += [f"{MICRO_TOKENS} {agreed.trainer.max_tokens_per_microbatch:,}"] \
        if config.trainer.max_tokens_per_microbatch == "auto" else []
    return agreed, f"the ranks' plans decided differently; every rank runs the most cautious: {', '.join(said)}"
