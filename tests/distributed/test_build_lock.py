"""A torch-extension build lock left by a run killed mid-build (DeepSpeed's CPU shm op) would hang
every later init_distributed forever; init_distributed clears it once it is older than any build."""

import os
import time

from fastrlhf.distributed.launch import STALE_BUILD_LOCK_S, clear_stale_build_lock


def _lock(root, name, age_s):
    folder = root / name
    folder.mkdir(parents=True)
    lock = folder / "lock"
    lock.write_text("")
    then = time.time() - age_s
    os.utime(lock, (then, then))
    return lock


def test_stale_lock_is_removed_and_a_fresh_one_kept(tmp_path, monkeypatch, capsys):
    # torch resolves TORCH_EXTENSIONS_DIR at each call, so the real cache is never touched.
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    stale = _lock(tmp_path, "stale_op", STALE_BUILD_LOCK_S + 60)
    fresh = _lock(tmp_path, "busy_op", 5)  # another rank is building right now

    assert clear_stale_build_lock("stale_op") is True
    assert not stale.exists()
    assert "removed a stale build lock" in capsys.readouterr().err
    assert clear_stale_build_lock("busy_op") is False
    assert fresh.exists()
    assert clear_stale_build_lock("never_built") is False
