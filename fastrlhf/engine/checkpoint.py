"""Atomic, resumable checkpoints: engines + optimizer/scheduler + RNG states + step + data position.

Layout under ``output_dir/checkpoints``::

    step-40/            one finished checkpoint (renamed into place only when complete)
      actor/            DeepSpeed ``save_checkpoint`` of the engine named "actor" (weights, optimizer, scheduler)
      rank-0.pt         per-rank state: step, RNG states, state of non-engine objects
    latest              text file "step-40", replaced atomically after the rename
    .tmp-step-50/       a checkpoint being written (a crash leaves it; the next save removes it)
    .old-step-30/       a checkpoint being deleted (the same)

A run killed at any moment therefore resumes from the last complete checkpoint.
"""

from __future__ import annotations

import os
import random
import re
import shutil
from typing import Any

import torch

from fastrlhf import distributed as D
from fastrlhf.distributed import comm
from fastrlhf.engine.durable import fsync_path, fsync_tree, write_text_atomic

__all__ = ["CheckpointError", "save_checkpoint", "load_latest", "latest_checkpoint", "capture_rng", "restore_rng",
           "checkpoint_root", "run_identity", "trained_when_saved"]



class CheckpointError(RuntimeError):
    """A checkpoint that cannot be resumed from (other world size, missing state); one-line message."""


_STEP_DIR = re.compile(r"^step-(\d+)$")
_DS_TAG = "state"
# Settings a checkpoint's state depends on: resumed with another value, the load fails deep inside (the weights'
# shapes, the engines' ZeRO layout, a critic that is not there) or mixes two runs (the prompt order goes on with
# the saved seed, the samples with the new one).
# reward.normalize: its running moments are in the checkpoint, or not
RUN_IDENTITY = ("algorithm", "seed", "model.lora_r", "model.lora_targets", "deepspeed.zero_stage", "reward.normalize")


def run_identity(config) -> dict:
    """The :data:`RUN_IDENTITY` settings of ``config`` that it has (``model.lora_targets`` only with LoRA on)."""
    found = {}
    for key in RUN_IDENTITY:
        value = config
        for part in key.split("."):
            value = getattr(value, part, None)
        if value is not None and not (key == "model.lora_targets" and not config.model.lora_r):
            found[key] = list(value) if isinstance(value, (list, tuple)) else value
    return found


def _same(key: str, saved, mine) -> bool:
    if key == "deepspeed.zero_stage":  # ZeRO-1 and -2 save the same partitioned optimizer state: either loads it
        return {1: 2}.get(saved, saved) == {1: 2}.get(mine, mine)
    return saved == mine


def _check_identity(path: str, saved: dict | None, mine: dict | None) -> None:
    for key, value in (mine or {}).items():
        if saved is not None and key in saved and not _same(key, saved[key], value):
            raise CheckpointError(f"{path} was saved with {key} = {saved[key]!r}, this run has {value!r}: resume "
                                  f"with the config it was saved with, or start again with --overwrite")


def checkpoint_root(output_dir: str) -> str:
    return os.path.join(output_dir, "checkpoints")


def _own_cuda_device() -> torch.device:
    # This rank's GPU only: get_rng_state_all() would open a CUDA context (hundreds of MiB) on
    # every visible GPU from every rank.
    return torch.device("cuda", D.local_rank())


def capture_rng() -> dict:
    import numpy as np

    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state(_own_cuda_device())
    return state


def restore_rng(state: dict) -> None:
    import numpy as np

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        cuda_state = state["cuda"]
        if isinstance(cuda_state, (list, tuple)):  # saved by get_rng_state_all (every device's state)
            cuda_state = cuda_state[D.local_rank()]
        torch.cuda.set_rng_state(cuda_state, _own_cuda_device())


def _is_engine(obj) -> bool:
    return hasattr(obj, "save_checkpoint") and hasattr(obj, "load_checkpoint")


def _step_dirs(root: str) -> list[tuple[int, str]]:
    if not os.path.isdir(root):
        return []
    found = [(int(m.group(1)), name) for name in os.listdir(root) if (m := _STEP_DIR.match(name))]
    return sorted(found)


def _discard(root: str, name: str) -> None:
    """Remove a step folder: renamed out of the ``step-N`` names first, so that a kill during the (slow) delete
    leaves no partial folder that :func:`latest_checkpoint` could take for a checkpoint."""
    doomed = os.path.join(root, f".old-{name}")
    shutil.rmtree(doomed, ignore_errors=True)
    os.rename(os.path.join(root, name), doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def _prune(root: str, step: int, keep_last: int) -> None:
    """Keep the checkpoint just written and the ``keep_last - 1`` newest before it; newer-numbered folders are left
    by a run this one resumed behind (the pointer lagged its rename): superseded, and never this one's."""
    newer = [name for other, name in _step_dirs(root) if other > step]
    older = [name for other, name in _step_dirs(root) if other < step]
    for name in newer + older[:max(0, len(older) - (keep_last - 1))]:
        _discard(root, name)


def _sweep(root: str) -> None:
    """What kills left behind: a save's ``.tmp-step-N``, a delete's ``.old-step-N`` (a checkpoint's size each). Only
    a later save of that same step removed them; the step just saved is in place, so none of them is needed."""
    for name in os.listdir(root):
        if name.startswith((".tmp-step-", ".old-step-")):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def save_checkpoint(output_dir: str, step: int, engines: dict[str, Any], keep_last: int = 0,
                    identity: dict | None = None) -> str:
    """Write checkpoint ``step`` atomically; collective (call on every rank). Returns its folder.

    ``engines`` maps names to DeepSpeed engines (saved with their optimizer and scheduler) or to
    any object with ``state_dict``/``load_state_dict`` (optimizers, schedulers, samplers, guards).
    ``identity``: the run's :func:`run_identity`, which a resume must match.
    """
    root = checkpoint_root(output_dir)
    final = os.path.join(root, f"step-{step}")
    tmp = os.path.join(root, f".tmp-step-{step}")
    if D.is_main():
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    comm.barrier()

    objects = {}
    for name, obj in engines.items():
        if _is_engine(obj):
            obj.save_checkpoint(os.path.join(tmp, name), tag=_DS_TAG, save_latest=False)
        else:
            objects[name] = obj.state_dict()
    rank_state = {"step": step, "world_size": D.world_size(), "rng": capture_rng(), "objects": objects,
                  "identity": identity}
    torch.save(rank_state, os.path.join(tmp, f"rank-{D.rank()}.pt"))
    comm.barrier()

    if D.is_main():
        fsync_tree(tmp)
        stale = os.path.join(root, f".old-step-{step}")
        shutil.rmtree(stale, ignore_errors=True)
        if os.path.exists(final):  # re-saving a step (e.g. after a resume): the old copy goes only once replaced
            os.rename(final, stale)
        os.rename(tmp, final)
        write_text_atomic(os.path.join(root, "latest"), f"step-{step}\n")
        fsync_path(root, directory=True)
        shutil.rmtree(stale, ignore_errors=True)
        if keep_last > 0:
            _prune(root, step, keep_last)
        _sweep(root)
    comm.barrier()
    return final


def latest_checkpoint(output_dir: str) -> str | None:
    """Folder of the newest complete checkpoint, or None."""
    root = checkpoint_root(output_dir)
    pointer = os.path.join(root, "latest")
    if os.path.exists(pointer):
        with open(pointer) as f:
            name = f.read().strip()
        if _STEP_DIR.match(name) and os.path.isdir(os.path.join(root, name)):
            return os.path.join(root, name)
    # The pointer is written after the rename: a crash in between leaves a complete, unpointed step dir.
    steps = _step_dirs(root)
    return os.path.join(root, steps[-1][1]) if steps else None


def _rank_state(path: str, identity: dict | None) -> dict:
    """This rank's saved state, once every rank has read and checked its own; collective. A rank whose file is
    missing, unreadable or of another run raised alone before: its error printed nowhere (the command line
    speaks on rank 0), while the others waited in the engines' collective loads until the timeout. Now every
    rank raises the first problem found, which rank 0 prints."""
    rank_file = os.path.join(path, f"rank-{D.rank()}.pt")
    state, problem = None, ""
    if not os.path.exists(rank_file):
        problem = f"{path} has no state for rank {D.rank()}: resume with the world size it was saved with"
    else:
        try:  # weights_only=False: the RNG states hold numpy arrays and Python tuples; these files are our own.
            state = torch.load(rank_file, map_location="cpu", weights_only=False)
            if state["world_size"] != D.world_size():
                problem = f"{path} was saved by {state['world_size']} ranks, this run has {D.world_size()}"
            else:
                _check_identity(path, state.get("identity"), identity)
        except CheckpointError as exc:
            problem = str(exc)
        except Exception as exc:  # a torn or foreign file: named, not a traceback on one rank
            problem = f"{rank_file} cannot be read ({type(exc).__name__}: {exc}); resume from another checkpoint"
    problems = [p.decode() for p in comm.gather_bytes(problem.encode()) if p]
    if problems:
        raise comm.agreed(CheckpointError(problems[0]))  # every rank saw every rank's problem: said once
    return state


def _trained_names(engine) -> set[str]:
    # ds_numel: a ZeRO-3 partition reports numel() 0 (DeepSpeed leaves only empty parameters out of its groups)
    return {n for n, p in engine.module.named_parameters() if p.requires_grad and getattr(p, "ds_numel", p.numel())}


def _some(names: list[str]) -> str:
    return ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def trained_when_saved(path: str, name: str) -> set[str] | int | None:
    """What engine ``name`` of checkpoint ``path`` trained when saved: its parameters' names (ZeRO 1-3), or their
    count (stage 0: torch's optimizer state counts them, it does not name them); None where the folder says
    neither (no such engine, an unreadable file)."""
    import glob

    files = sorted(glob.glob(os.path.join(path, name, _DS_TAG, "*model_states.pt")))
    if not files:
        return None
    try:  # mmap: only the small records are read, not the module's weights beside them
        saved = torch.load(files[0], map_location="cpu", mmap=True, weights_only=False)
    except Exception:  # noqa: BLE001 -- unreadable: the load's own error says so
        return None
    if saved.get("param_shapes"):
        return {n for group in saved["param_shapes"] for n in group}
    counts = [len(g["params"]) for g in (saved.get("optimizer") or {}).get("param_groups", ())]
    return sum(counts) if counts else None


def _trained_set_change(engine, path: str, name: str) -> str:
    """Why ``engine`` cannot take the optimizer state saved for engine ``name`` in ``path``: the parameters it trained
    when saved are not the ones it trains now (DeepSpeed fails on that with a bare ``KeyError`` of one name deep in
    its load, or torch with a group size mismatch); empty where they are the same, or the folder says nothing of
    them."""
    if not isinstance(getattr(engine, "module", None), torch.nn.Module):
        return ""
    trained = trained_when_saved(path, name)
    if isinstance(trained, set):
        mine = _trained_names(engine)
        frozen, thawed = sorted(trained - mine), sorted(mine - trained)
        if not frozen and not thawed:
            return ""
        said = [f"trained {_some(frozen)}, which this run freezes" if frozen else "",
                f"froze {_some(thawed)}, which this run trains" if thawed else ""]
        what = "was saved when it " + " and ".join(s for s in said if s)
    else:
        now = sum(len(g["params"]) for g in getattr(engine.optimizer, "param_groups", ()))
        if trained is None or trained == now:
            return ""
        what = f"was saved training {trained} parameters, this run trains {now}"
    return (f"{what}: its optimizer state is that of the parameters it trained. A PPO critic saved before its untied "
            f"lm_head was frozen (no gradient ever reaches it) is such a checkpoint: fastrlhf train --resume trains "
            f"that head again for it; otherwise start again with --overwrite")


def load_latest(output_dir: str, engines: dict[str, Any], load_optimizer_states: bool = True,
                identity: dict | None = None) -> dict | None:
    """Restore the newest checkpoint into ``engines`` and this rank's RNG; collective. ``identity``: this run's
    :func:`run_identity`; a checkpoint saved with other values is refused before anything loads.

    Returns ``{"step": int, "path": str}`` or None when there is none.
    """
    path = latest_checkpoint(output_dir)
    if path is None:
        return None
    state = _rank_state(path, identity)
    for name, obj in engines.items():
        if _is_engine(obj):
            try:
                load_path, _ = obj.load_checkpoint(os.path.join(path, name), tag=_DS_TAG,
                                                   load_optimizer_states=load_optimizer_states,
                                                   load_lr_scheduler_states=load_optimizer_states)
            except (KeyError, ValueError, RuntimeError):
                changed = _trained_set_change(obj, path, name)
                if changed:
                    raise CheckpointError(f"{path}: engine {name!r} {changed}") from None
                raise
            if load_path is None:
                raise CheckpointError(f"{path}: engine {name!r} could not be loaded")
            scheduler = getattr(obj, "lr_scheduler", None)
            if load_optimizer_states and hasattr(scheduler, "apply_lr"):
                scheduler.apply_lr()  # the ZeRO optimizer's state loads after the scheduler's, with the old rates
        elif name in state["objects"]:
            try:
                obj.load_state_dict(state["objects"][name])
            except ValueError as exc:  # e.g. the sampler's "resume with the same data": one line, not a traceback
                raise CheckpointError(f"{path}: {name}: {exc}") from None
        else:
            raise CheckpointError(f"{path} holds no state for {name!r}")
    restore_rng(state["rng"])
    return {"step": state["step"], "path": path}
