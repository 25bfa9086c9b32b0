"""Calling a reward function and reading what it returns, as TRL reads it; what is raised when it fails.

What a function returns is read as TRL reads it: a number per completion (Python or numpy, a bool, a 0-dim
tensor or array); for a batch, a list, a tuple or a 1-dim numpy array or tensor of them. ``None`` means "no
reward for this completion from this function". Each scoring path (:func:`sample_scores`,
:func:`batch_scores`, :func:`environment_scores`) gives ``(values, applicable)`` ``[B]`` host tensors.

A failure is a :class:`RewardFunctionError`: one line naming the function, the batch (and the completion,
for a per-sample function) and the rank, then the frames of the user's own code (:func:`user_frames`);
:func:`agree_on_reward_failure` makes every rank end alike (``fastrlhf.distributed.comm.agree_on_failure``,
which an episode's environment that fails to start shares: ``fastrlhf.rollout.episodes``).
"""

from __future__ import annotations

import copy
import inspect
import numbers
import os
import sysconfig
import traceback
from collections.abc import Callable, Iterable, Mapping

import numpy as np
import torch

from fastrlhf.engine.guards import AgreedStepFailure

__all__ = ["NUMBER", "RewardFunctionError", "agree_on_reward_failure", "batch_scores",
           "environment_scores", "sample_scores", "user_frames"]


class RewardFunctionError(AgreedStepFailure):
    """A reward function raised or returned something unusable.

    ``str(exc)``: one line naming it (``summary``), then, for one that raised, the frames of the user's
    own code (``user_traceback``, :func:`user_frames`). ``exit_code``: 1 for a function that raised on
    some input (``--resume`` retries the step), 2 for one wrong as written (a result of the wrong type or
    length). ``local``: it failed on this rank (else: on another rank, and this rank stops with it).
    """

    said_as = "reward error"


def _not_user_code() -> tuple[str, ...]:
    """Folders whose frames are not the user's: this package, installed packages, the standard library."""
    import fastrlhf

    folders = [os.path.dirname(os.path.abspath(fastrlhf.__file__))]  # first: see user_frames
    paths = sysconfig.get_paths()
    folders += [os.path.abspath(paths[k]) for k in ("stdlib", "platstdlib", "purelib", "platlib") if paths.get(k)]
    return tuple(os.path.join(f, "") for f in folders)


def user_frames(exc: BaseException) -> str:
    """The frames of ``exc``'s traceback in the user's own files (not fastrlhf's, nor an installed
    package's or the standard library's), formatted as Python prints them; where there are none (a reward
    function from an installed package), every frame outside fastrlhf."""
    frames = traceback.extract_tb(exc.__traceback__)
    not_user = _not_user_code()

    def outside(frame, folders):
        path = os.path.abspath(frame.filename)
        return not path.startswith(folders) and "site-packages" not in path and "dist-packages" not in path

    own = [f for f in frames if outside(f, not_user)]
    if not own:
        own = [f for f in frames if not os.path.abspath(f.filename).startswith(not_user[:1])]
    return "".join(traceback.format_list(own))


def _where(batch: str) -> str:
    """``batch`` ("on a batch of 8 completions"), with the rank when there are several."""
    from fastrlhf.distributed.ranks import rank, world_size

    return f"{batch} on rank {rank()}" if world_size() > 1 else batch


def _raised(name: str, exc: Exception, batch: str) -> RewardFunctionError:
    detail = " ".join(str(exc).split())
    return RewardFunctionError(f"reward function {name!r} raised {type(exc).__name__} {_where(batch)}: {detail}",
                               user_traceback=user_frames(exc))


def _defined_at(fn) -> str:
    """``" (it is at my_rewards.py:12)"``: where ``fn`` is defined, when that can be read."""
    try:
        path, line = inspect.getsourcefile(fn), inspect.getsourcelines(fn)[1]
    except (TypeError, OSError, ValueError):
        return ""
    relative = os.path.relpath(path)
    return f" (it is at {path if relative.startswith('..') else relative}:{line})"


def _wrong(name: str, fn, got: str, batch: str, expected: str) -> RewardFunctionError:
    """A result no input could make right: the function is wrong as written (exit code 2)."""
    return RewardFunctionError(f"reward function {name!r} returned {got} {_where(batch)}; expected {expected}"
                               f"{_defined_at(fn)}", exit_code=2)


def _shown(value) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 40 else text[:37] + '...'}"


NUMBER = "a number (or None: no reward for this completion)"


def _number(value) -> float | None:
    """A returned value as TRL reads it: None, or a float; raises TypeError for anything else."""
    if value is None:
        return None
    if isinstance(value, (torch.Tensor, np.ndarray)) and value.ndim == 0:
        value = value.item()
    elif isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, numbers.Real):  # bool and int included, as torch.tensor takes them
        return float(value)
    raise TypeError(type(value).__name__)


def _per_completion(values, n: int) -> list:
    """A batch function's result as a list, as TRL takes it: a list, a tuple, a 1-dim array or tensor
    (or another iterable of values). Raises TypeError for anything else, ValueError for a wrong length."""
    if isinstance(values, (torch.Tensor, np.ndarray)):
        if values.ndim != 1:
            raise TypeError(f"{type(values).__name__} of shape {tuple(values.shape)}")
        values = values.tolist()
    elif isinstance(values, (str, bytes, Mapping)) or not isinstance(values, Iterable):
        raise TypeError(type(values).__name__)
    values = list(values)
    if len(values) != n:
        raise ValueError(f"{len(values)} values")
    return values


def _tensors(values: list[float | None]) -> tuple[torch.Tensor, torch.Tensor]:
    applicable = torch.tensor([v is not None for v in values], dtype=torch.bool)
    return torch.tensor([0.0 if v is None else v for v in values], dtype=torch.float32), applicable


def sample_scores(name: str, fn: Callable, prompts: list, completions: list, metas: list
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values, applicable)`` ``[B]`` of a per-sample function ``fn(prompt_ids, completion_ids, meta)``."""
    n, values = len(completions), []
    for i, (p, c, m) in enumerate(zip(prompts, completions, metas, strict=True)):
        try:
            value = fn(p, c, m)
        except Exception as exc:  # noqa: BLE001 -- the user's code: reported as this function's, on every rank
            raise _raised(name, exc, f"on completion {i} of a batch of {n}") from exc
        try:
            values.append(_number(value))
        except TypeError:
            raise _wrong(name, fn, _shown(value), f"for completion {i} of a batch of {n}", NUMBER) from None
    return _tensors(values)


def batch_scores(reward, prompts: list, completions: list, completion_ids: list[list[int]],
                 columns: dict[str, list]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(values, applicable)`` ``[B]`` of one batch reward (TRL's signature)."""
    n = len(completions)
    batch = f"on a batch of {n} completions"
    # Each function its own copy of the batch: what one edits never reaches the next.
    prompts, completions, completion_ids, columns = copy.deepcopy((prompts, completions, completion_ids, columns))
    try:
        result = reward.fn(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns)
    except Exception as exc:  # noqa: BLE001 -- the user's code: reported as this function's, on every rank
        raise _raised(reward.name, exc, batch) from exc
    expected = f"a list with one value per completion, each {NUMBER}"
    try:
        values = _per_completion(result, n)
    except (TypeError, ValueError) as exc:
        raise _wrong(reward.name, reward.fn, str(exc), f"for a batch of {n} completions", expected) from None
    out = []
    for i, value in enumerate(values):
        try:
            out.append(_number(value))
        except TypeError:
            raise _wrong(reward.name, reward.fn, _shown(value), f"for completion {i} of a batch of {n}",
                         NUMBER) from None
    return _tensors(out)


def environment_scores(name: str, environments: list, timeout_s: float | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each episode's ``environment.get_reward()``, read as a per-sample reward is (None: not applicable). Each runs
    under ``timeout_s``, by default the ``rollout.tool_timeout_s`` its instance was made and reset under
    (:func:`fastrlhf.rollout.tools.environment_timeout`): one that hangs hung every rank, as a ``reset()`` did. One
    that runs past it is a RewardFunctionError (``--resume`` retries the step)."""
    from fastrlhf.rollout.tools import call_with_timeout, environment_timeout

    values = []
    for b, env in enumerate(environments):
        if env is None:
            values.append(None)
            continue
        where = f"for completion {b} of a batch of {len(environments)}"
        limit = timeout_s if timeout_s is not None else environment_timeout(env)
        if limit is None:
            value, exc, timed_out = _called(env.get_reward)
        else:
            value, exc, timed_out = call_with_timeout(env.get_reward, {}, limit, f"{name}.get_reward")
        if timed_out:
            raise RewardFunctionError(f"reward function '{name}.get_reward' did not return within {limit:g} s "
                                      f"(rollout.tool_timeout_s) {_where(where)}")
        if exc is not None:
            if not isinstance(exc, Exception):  # a KeyboardInterrupt or SystemExit the call caught: not its error
                raise exc
            raise _raised(f"{name}.get_reward", exc, where) from exc
        try:
            values.append(_number(value))
        except TypeError:
            raise _wrong(f"{name}.get_reward", env.get_reward, _shown(value), where, NUMBER) from None
    return _tensors(values)


def _called(fn: Callable):
    """``(result, exception, False)`` of ``fn()``, as :func:`fastrlhf.rollout.tools.call_with_timeout` gives them."""
    try:
        return fn(), None, False
    except Exception as exc:  # noqa: BLE001 -- reported like a reward function that raised
        return None, exc, False


def agree_on_reward_failure(score: Callable[[], torch.Tensor]) -> torch.Tensor:
    """``score()`` on every rank, a :class:`RewardFunctionError` on any rank raised on every rank
    (:func:`fastrlhf.distributed.comm.agree_on_failure`)."""
    from fastrlhf.distributed.comm import agree_on_failure

    return agree_on_failure(score, RewardFunctionError)
