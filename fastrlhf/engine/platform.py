"""The one switch between a CPU run's memory machinery and a GPU run, which never loads it.

On a CPU, fastrlhf trims the glibc heap after each backward, releases the file pages of frozen
weights between passes, shares the fp32 master partition with the weights and updates vLLM-CPU's
packed GEMM weights in place (``fastrlhf.cpu``). None of it means anything on a GPU, so the code a
GPU run executes reaches that package only by asking here, and gets None.
"""

from __future__ import annotations

import torch

__all__ = ["cpu_tools"]


def cpu_tools(device: torch.device | str | None = None):
    """The ``fastrlhf.cpu`` package for a run that trains on a CPU, else None. ``device``: where the run's
    models live (None: this machine, as ``fastrlhf.config.precision.gpu_available`` decides a run's
    precision: a CPU run where there is no CUDA device)."""
    on_cpu = not torch.cuda.is_available() if device is None else torch.device(device).type == "cpu"
    if not on_cpu:
        return None
    import fastrlhf.cpu

    return fastrlhf.cpu
