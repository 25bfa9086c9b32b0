"""The GPU proof (``make test-gpu``): each test runs twice, on CUDA at the real shapes (marker ``gpu``,
skipped with the reason where there is no CUDA device) and on the CPU at tiny shapes, so that
``make test`` keeps every line of it running on machines without a GPU."""

import os

import pytest
import torch

NO_CUDA = "needs a CUDA device: run `make test-gpu` on a GPU machine"


@pytest.fixture(scope="module", params=[pytest.param("cuda", marks=pytest.mark.gpu), "cpu"])
def where(request) -> str:
    """``cuda`` (the proof) or ``cpu`` (the same test at tiny shapes)."""
    if request.param == "cuda":
        if not torch.cuda.is_available():
            pytest.skip(NO_CUDA)
        if os.environ.get("TRITON_INTERPRET") == "1":
            pytest.fail("TRITON_INTERPRET=1 would run the kernels interpreted on the GPU: use `make test-gpu`")
    return request.param
