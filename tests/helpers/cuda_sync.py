"""The CUDA half of the GPU proof's host-read checks (tests/gpu): ``torch.cuda.set_sync_debug_mode("error")``, under
which every read of a device value outside the caller's allowance raises. The CPU halves check the same code with
the recorders of :mod:`helpers.other_device`."""

import contextlib

import torch


@contextlib.contextmanager
def sync_debug(device: torch.device):
    """``torch.cuda.set_sync_debug_mode("error")`` on CUDA (every unnamed host read raises); nothing elsewhere."""
    if device.type != "cuda":
        yield
        return
    torch.cuda.synchronize(device)
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(0)
