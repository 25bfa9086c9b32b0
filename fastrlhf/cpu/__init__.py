"""What exists only to make CPU runs fit and run fast; a GPU run never imports it.

- ``hostmem``: glibc heap settings and trims (after each backward), page release with ``madvise``;
- ``file_pages``: a frozen model's weights (pages of its checkpoint file) leave resident memory
  between its passes;
- ``zero_master``: at ZeRO 1-2 with fp32 weights, DeepSpeed's cloned master partition becomes a view
  of the weights themselves;
- ``vllm_inplace_sync`` and ``packed_linear`` (with ``cpu_pack.c``): a weight sync writes vLLM-CPU's
  packed GEMM weights in place instead of reloading the model;
- ``probe``: what this CPU allows those (packing kernel ISA, oneDNN layouts, vLLM's GEMM per layer),
  decided once per process; ``FASTRLHF_CPU_FAST_PATHS=off`` forces "unavailable".

Reached through one switch, :func:`fastrlhf.engine.platform.cpu_tools` (None on a GPU);
``tests/cpu/test_cpu_isolation.py`` checks that a GPU run's objects load none of this package.
"""

from fastrlhf.cpu import file_pages, hostmem, probe, vllm_inplace_sync, zero_master

__all__ = ["file_pages", "hostmem", "probe", "vllm_inplace_sync", "zero_master"]
