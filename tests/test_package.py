"""The package's import surface: the top-level kernels/ folder, lazy heavy imports, the CLI.

transformers probes for Hugging Face's own ``kernels`` package by that top-level name
(``is_kernels_available``, called while loading models). Run from the repository root, as
``python -m pytest`` and ``deepspeed -m fastrlhf`` do, our kernels/ folder is on sys.path under
that name; these tests prove the probe still answers False without raising, and that
``fastrlhf.kernels`` is ours.
"""

import subprocess
import sys
from pathlib import Path

import pytest
from helpers.paths import ROOT as CHECKOUT

ROOT = Path(CHECKOUT)


def run_from_root(*args, timeout=120):
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def test_root_is_on_sys_path_here():
    # The premise of the tests below: this suite runs as `python -m pytest` from the root.
    assert str(ROOT) in [str(Path(p or ".").resolve()) for p in sys.path]


def test_transformers_kernels_probe_is_false_and_fastrlhf_kernels_is_ours():
    from transformers.utils.import_utils import is_kernels_available

    assert is_kernels_available() is False
    import fastrlhf.kernels

    assert Path(fastrlhf.kernels.__file__).resolve() == ROOT / "kernels" / "__init__.py"
    assert set(fastrlhf.kernels.__all__) >= {"logprob_entropy", "fused_policy_loss",
                                            "fused_linear_logprob_entropy", "fused_linear_policy_loss"}


MODEL_LOAD_FROM_ROOT = """
import sys, tempfile
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.utils.import_utils import is_kernels_available
assert sys.path[0] == '', sys.path[0]  # the checkout's root is importable, as under `python -m`
import kernels  # the trap's premise: our folder answers to the top-level name
with tempfile.TemporaryDirectory() as d:
    LlamaForCausalLM(LlamaConfig(vocab_size=16, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=1, num_key_value_heads=1)).save_pretrained(d)
    LlamaForCausalLM.from_pretrained(d)
import fastrlhf.kernels
print("kernels-available", is_kernels_available())
"""


def test_model_loading_from_root_with_python_m_layout():
    # `python -c` puts the working directory first on sys.path, as `python -m` does.
    proc = run_from_root("-c", MODEL_LOAD_FROM_ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "kernels-available False" in proc.stdout


def test_python_m_fastrlhf_help_from_root():
    proc = run_from_root("-m", "fastrlhf", "--help")
    assert proc.returncode == 0, proc.stderr
    assert "usage: fastrlhf" in proc.stdout


@pytest.mark.parametrize("module", ["fastrlhf.algorithms", "fastrlhf.kernels", "fastrlhf"])
def test_light_imports_need_only_torch(module):
    code = (f"import sys, {module}; heavy = [m for m in ('vllm', 'deepspeed', 'triton', 'transformers') "
            "if m in sys.modules]; print(heavy); sys.exit(1 if heavy else 0)")
    proc = run_from_root("-c", code)
    assert proc.returncode == 0, f"{module} imported {proc.stdout.strip()} {proc.stderr[-2000:]}"


def test_installed_package_has_every_subpackage_and_the_c_source(tmp_path):
    """What a non-editable install copies (setup.py's build_py): every package folder under
    fastrlhf/, the kernels/ folder as fastrlhf.kernels, and the C source compiled at run time."""
    proc = run_from_root("setup.py", "-q", "build_py", "-d", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-2000:]
    expected = {p.parent.relative_to(ROOT).as_posix() for p in (ROOT / "fastrlhf").rglob("__init__.py")}
    built = {p.parent.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("__init__.py")}
    assert built == expected | {"fastrlhf/kernels"}
    assert (tmp_path / "fastrlhf" / "cpu" / "cpu_pack.c").is_file()
