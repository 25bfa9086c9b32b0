"""The generic weight reload on a worker (``vllm_adapter._reload_on_worker``, the path a GPU takes) runs with the
worker's config as vLLM's current one, whichever vLLM of setup.py's range the worker comes from: vLLM 0.32's
worker sets it around ``reload_weights`` itself, 0.26's does not (its layers then fail with "Current vLLM
config is not set"). Stand-in workers against the installed vLLM's own ``vllm.config``; no engine starts."""

from types import SimpleNamespace

import pytest

from fastrlhf.rollout import vllm_adapter

vllm_config = pytest.importorskip("vllm.config")


class StandInWorker:
    """What ``_reload_on_worker`` reads of a vLLM worker; ``reload_weights`` records the config that is current
    while it runs, as a layer built during the reload asks for it (``get_current_vllm_config``)."""

    def __init__(self, sets_config_itself: bool):
        self.vllm_config = SimpleNamespace(name="the worker's config")
        self.model_runner = SimpleNamespace(model=SimpleNamespace())  # no lm_head: nothing to refresh
        self.sets_config_itself = sets_config_itself
        self.seen = None
        self.loaded = []

    def reload_weights(self, weights_iterator, is_checkpoint_format):
        assert is_checkpoint_format
        if self.sets_config_itself:  # vLLM 0.32's Worker.reload_weights
            with vllm_config.set_current_vllm_config(self.vllm_config):
                self._load(weights_iterator)
        else:  # vLLM 0.26's
            self._load(weights_iterator)

    def _load(self, weights_iterator):
        self.seen = vllm_config.get_current_vllm_config()  # raises where no config is current
        self.loaded = [name for name, _ in weights_iterator]


@pytest.fixture
def generic_path(monkeypatch):
    """The path a GPU takes: no in-place updater, no CPU tools."""
    monkeypatch.setattr(vllm_adapter, "IN_PLACE_UPDATERS", ())
    monkeypatch.setattr(vllm_adapter, "_cpu_sync", lambda: None)


@pytest.mark.parametrize("sets_config_itself", [False, True], ids=["vllm-0.26-worker", "vllm-0.32-worker"])
def test_the_generic_reload_runs_with_the_workers_config_current(generic_path, sets_config_itself):
    worker = StandInWorker(sets_config_itself)
    before = vllm_config.get_current_vllm_config_or_none()
    vllm_adapter._reload_on_worker(worker, iter([("model.embed_tokens.weight", None), ("lm_head.weight", None)]))
    assert worker.seen is worker.vllm_config
    assert worker.loaded == ["model.embed_tokens.weight", "lm_head.weight"]
    assert vllm_config.get_current_vllm_config_or_none() is before  # put back as it was


def test_a_vllm_without_set_current_vllm_config_reloads_unwrapped(generic_path, monkeypatch):
    monkeypatch.delattr(vllm_config, "set_current_vllm_config")
    worker = StandInWorker(sets_config_itself=False)
    monkeypatch.setattr(worker, "_load", lambda weights: worker.loaded.extend(name for name, _ in weights))
    vllm_adapter._reload_on_worker(worker, iter([("lm_head.weight", None)]))
    assert worker.loaded == ["lm_head.weight"]
