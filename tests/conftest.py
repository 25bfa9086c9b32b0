import os

# The Triton interpreter must be switched on before anything imports triton (transformers and
# vLLM do), so that kernel tests with backend="triton" run on CPU tensors. `make test-gpu` sets
# TRITON_INTERPRET=0: there the kernels run compiled.
os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_configure(config):
    # Registered here rather than in pyproject.toml, whose every change rebuilds the venv (see Makefile).
    config.addinivalue_line("markers", "multinode: two nodes in network namespaces (root); not in `make test`, "
                                       "run by `make test-multinode`")
    config.addinivalue_line("markers", "gpu: the CUDA half of tests/gpu (`make test-gpu`); skipped without a GPU")
