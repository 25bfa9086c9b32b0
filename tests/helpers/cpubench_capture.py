"""What the end-to-end benchmark's two child scripts would hand their trainers, captured in this process.

``benchmarks/e2e_ours.py`` and ``benchmarks/e2e_trl.py`` are run here with the trainer swapped for a recorder
that stops the script once it has the configuration: fastrlhf's parsed config (``fastrlhf.rl.trainer.run``
replaced) and the keyword arguments of TRL's ``GRPOConfig`` (a stand-in ``trl`` module, so TRL need not be
installed). Both scripts patch module globals and the torch thread count for their own process; everything they
touch is put back (``monkeypatch`` records the originals first)."""

from __future__ import annotations

import shutil
import sys
import types

import torch

# TRL 1.16's GRPOConfig default (checked against the wheel): what the TRL run gets unless e2e_trl.py says.
TRL_DEFAULTS = {"gradient_checkpointing": True}


class _Captured(Exception):
    pass


def _protect(monkeypatch) -> None:
    """Record the globals e2e_ours.main() replaces, so that monkeypatch restores them."""
    import fastrlhf.engine.loop
    import fastrlhf.modeling
    import fastrlhf.rl.step as step_module
    from fastrlhf.rl import rollout_setup

    for owner, name in (
        (fastrlhf.engine.loop, "save_checkpoint"),
        (fastrlhf.modeling, "export_hf"),
        (step_module, "sequence_logprobs"),
        (step_module.RLStep, "logprobs_and_values"),
        (rollout_setup, "build_rollout"),
    ):
        monkeypatch.setattr(owner, name, getattr(owner, name))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    monkeypatch.setattr(sys, "path", list(sys.path))


def _run(main, spec: dict) -> None:
    threads = torch.get_num_threads()
    try:
        with torch.random.fork_rng(devices=[]):
            main(spec)
    except _Captured:
        return
    finally:
        torch.set_num_threads(threads)
    raise AssertionError("the child script reached its trainer's run without handing over its configuration")


def ours_config(monkeypatch, spec: dict):
    """The ``fastrlhf.config`` object e2e_ours.py would train with."""
    from benchmarks import e2e_ours
    from fastrlhf.rl import trainer

    _protect(monkeypatch)
    got = {}

    def run(config):
        got["config"] = config
        raise _Captured

    monkeypatch.setattr(trainer, "run", run)
    _run(e2e_ours.main, spec)
    return got["config"]


def trl_args(monkeypatch, spec: dict) -> dict:
    """The ``GRPOConfig`` keyword arguments e2e_trl.py would pass, TRL's defaults filled in (``TRL_DEFAULTS``)."""
    from benchmarks import e2e_trl

    _protect(monkeypatch)
    got = {}

    def grpo_config(**kwargs):
        got["args"] = dict(TRL_DEFAULTS, **kwargs)
        shutil.rmtree(kwargs["output_dir"], ignore_errors=True)  # e2e_trl.py's mkdtemp, unused
        raise _Captured

    fake = types.ModuleType("trl")
    fake.__version__ = "stand-in"
    fake.GRPOConfig, fake.GRPOTrainer = grpo_config, None
    monkeypatch.setitem(sys.modules, "trl", fake)
    _run(e2e_trl.main, spec)
    return got["args"]
