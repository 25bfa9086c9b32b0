import os
import signal

import pytest

# The Triton interpreter must be switched on before anything imports triton (transformers and
# vLLM do), so that kernel tests with backend="triton" run on CPU tensors. `make test-gpu` sets
# TRITON_INTERPRET=0: there the kernels run compiled.
os.environ.setdefault("TRITON_INTERPRET", "1")

# A suite started in the background by a non-interactive shell (as CI may start it) inherits SIGINT
# ignored, and so would every command a test starts: the Ctrl-C tests' children would never see their
# SIGINT. A handler (unlike SIG_IGN) is reset to the default on exec, so the children get Ctrl-C back.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_configure(config):
    # Registered here rather than in pyproject.toml, whose every change rebuilds the venv (see Makefile).
    config.addinivalue_line("markers", "multinode: two nodes in network namespaces (root); not in `make test`, "
                                       "run by `make test-multinode`")
    config.addinivalue_line("markers", "gpu: the CUDA half of tests/gpu (`make test-gpu`); skipped without a GPU")


@pytest.fixture
def cpu_flex(monkeypatch):
    """FlexAttention's eager path with gradients on a CPU, which torch refuses (its compiled kernels are
    GPU-only): the exact reference that the GPU kernels compute, for tests of the flex backend."""
    import torch.nn.attention.flex_attention as flex

    monkeypatch.setattr(flex, "_validate_device", lambda *args: None)


@pytest.fixture(autouse=True)
def _unpatched_linear():
    """A ZeRO-3 engine replaces ``torch.nn.functional.linear`` for the whole process ("memory efficient
    linear", on by default), and it stays replaced after the test; the next test gets torch's own back."""
    import torch

    linear = torch.nn.functional.linear
    yield
    torch.nn.functional.linear = linear


@pytest.fixture(params=["real", "forced-off"])
def cpu_probe_answer(request):
    """The CPU probe's real answer for this machine, then the probe forced to "unavailable": a test of
    machine-dependent code runs on both paths on every machine (tests/helpers/cpu_probe.py)."""
    from helpers.cpu_probe import probe_answer

    with probe_answer(request.param) as probe:
        yield probe
