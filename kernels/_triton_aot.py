"""Ahead-of-time compilation of the Triton kernels for real GPUs, without a GPU.

The interpreter (TRITON_INTERPRET=1) runs kernels as numpy code and never lowers them, so a kernel
that passes every CPU test can still fail to compile for a GPU (an op with no lowering, a dtype
mix the backend rejects). ``triton.compile`` with an explicit ``GPUTarget`` runs the whole
pipeline down to PTX and cubin with no device present; CI does that for every kernel here.

It must run in a process where TRITON_INTERPRET was off when the kernels were defined (the
interpreter turns ``triton.jit`` into a different object that ``ASTSource`` cannot lower); the
tests therefore run ``python -m fastrlhf.kernels._triton_aot`` in a subprocess. Other kernel
modules can reuse :func:`compile_for_target`.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys

__all__ = ["TARGET_CAPABILITIES", "compile_for_target", "grad_cast_specs", "kernel_specs", "row_loss_specs",
           "token_loss_specs", "compile_all"]

TARGET_CAPABILITIES = (80, 90)

# torch dtype name -> Triton signature type of a pointer to it.
_POINTER = {"float32": "*fp32", "bfloat16": "*bf16", "float16": "*fp16"}


def compile_for_target(fn, signature: dict, constexprs: dict, capability: int, num_warps: int = 4) -> dict:
    """Compile a ``@triton.jit`` function for ``sm_<capability>``; returns sizes of the artefacts."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.runtime.jit import JITFunction

    if not isinstance(fn, JITFunction):
        raise RuntimeError(
            f"{getattr(fn, '__name__', fn)!r} is not a compilable JITFunction (was TRITON_INTERPRET set "
            "when the kernels were defined?); run AOT compilation with TRITON_INTERPRET=0"
        )
    full_signature = {**signature, **{name: "constexpr" for name in constexprs}}
    src = triton.compiler.ASTSource(fn=fn, signature=full_signature, constexprs=constexprs)
    compiled = triton.compile(src, target=GPUTarget("cuda", capability, 32), options={"num_warps": num_warps})
    ptx = compiled.asm.get("ptx", "")
    target = next((line.split()[1] for line in ptx.splitlines() if line.startswith(".target")), None)
    return {
        "ptx_target": target,
        "ptx_chars": len(ptx),
        "cubin_bytes": len(compiled.asm.get("cubin", b"")),
        "shared_bytes": int(getattr(compiled.metadata, "shared", 0)),
    }


def kernel_specs(logits_dtype: str, block_v: int):
    """(label, kernel, signature, constexprs, num_warps) for every kernel variant the ops launch."""
    from .logprob_entropy_triton import _num_warps, triton_kernels

    k = triton_kernels()
    ptr = _POINTER[logits_dtype]
    warps = _num_warps(block_v)
    stats_sig = {
        "logits_ptr": ptr, "stride_row": "i64", "labels_ptr": "*i64", "logprobs_ptr": "*fp32",
        "entropy_ptr": "*fp32", "lse_ptr": "*fp32", "V": "i32", "inv_temperature": "fp32",
    }
    specs = [(f"stats[{logits_dtype}]", k.stats, stats_sig, {"BLOCK_V": block_v}, warps)]
    # The gradient goes to logits' dtype (the default and the in-place case) or to an fp32 buffer.
    for out_dtype in sorted({logits_dtype, "float32"}):
        for has_lp, has_ent in ((True, True), (True, False), (False, True)):
            grad_sig = {
                "logits_ptr": ptr, "stride_row": "i64", "labels_ptr": "*i64", "lse_ptr": "*fp32",
                "entropy_ptr": "*fp32", "grad_logprobs_ptr": "*fp32", "grad_entropy_ptr": "*fp32",
                "out_ptr": _POINTER[out_dtype], "stride_out_row": "i64", "V": "i32", "inv_temperature": "fp32",
            }
            constexprs = {"HAS_GRAD_LOGPROBS": has_lp, "HAS_GRAD_ENTROPY": has_ent, "BLOCK_V": block_v}
            label = f"grad[{logits_dtype}->{out_dtype}, lp={has_lp}, ent={has_ent}]"
            specs.append((label, k.grad, grad_sig, constexprs, warps))
    return specs


def token_loss_specs():
    """(label, kernel, signature, constexprs, num_warps) of every variant of the per-token loss kernel
    (``policy_loss_triton.py``), which reads fp32 token vectors whatever the logits' dtype."""
    from fastrlhf.algorithms.logprobs import K3_CLAMP, LOG_RATIO_CLAMP

    from .policy_loss_triton import (
        BLOCK,
        KL_KIND_CODES,
        KL_STRAIGHT_THROUGH_CODES,
        POLICY_LOSS_CODES,
        token_loss_kernels,
    )

    kernel = token_loss_kernels().loss
    sig = {name: "*fp32" for name in ("lp_ptr", "ent_ptr", "old_ptr", "adv_ptr", "w_ptr", "ref_ptr", "grad_lp_ptr",
                                      "grad_ent_ptr", "sums_ptr")}
    sig.update(n="i32", clip_low="fp32", clip_high="fp32", dual_clip="fp32", kl_coef="fp32", entropy_coef="fp32",
               tau_pos="fp32", tau_neg="fp32")
    specs = []
    vanilla = [(True, False), (True, True), (False, False), (False, True)]  # (old, dual): CISPO and SAPO no dual
    for loss, code in POLICY_LOSS_CODES.items():
        for has_old, has_dual in vanilla if loss == "vanilla" else vanilla[::2]:
            kinds = [*KL_KIND_CODES.values(), *KL_STRAIGHT_THROUGH_CODES.values()]
            for has_ref, kind in [(False, 0)] + [(True, code) for code in kinds]:
                constexprs = {"HAS_OLD": has_old, "HAS_REF": has_ref, "KL_KIND": kind, "HAS_DUAL": has_dual,
                              "LOSS_KIND": POLICY_LOSS_CODES[loss], "LOG_RATIO_MAX": LOG_RATIO_CLAMP,
                              "K3_MAX": K3_CLAMP, "BLOCK": BLOCK}
                label = f"token_loss[{loss}, old={has_old}, ref={has_ref}, kl={kind}, dual={has_dual}]"
                specs.append((label, kernel, sig, constexprs, 4))
    return specs


def row_loss_specs(logits_dtype: str, block_v: int, every_option: bool = False):
    """(label, kernel, signature, constexprs, num_warps) of the row kernel (``policy_loss_triton.py``: a chunk's
    statistics, loss and in-place gradient in one launch) for these logits: with and without its gradient pass,
    at the options a GRPO/PPO update takes (old and reference logprobs, k3, no dual clip), for each policy loss
    the kernels cover; ``every_option`` adds on-policy without a reference, dual clip, and each other KL kind (the
    loss math they switch is the token kernel's, compiled in every variant there)."""
    from fastrlhf.algorithms.logprobs import K3_CLAMP, LOG_RATIO_CLAMP

    from .logprob_entropy_triton import _num_warps
    from .policy_loss_triton import KL_KIND_CODES, KL_STRAIGHT_THROUGH_CODES, POLICY_LOSS_CODES, token_loss_kernels

    ptr = _POINTER[logits_dtype]
    sig = {"logits_ptr": ptr, "stride_row": "i64", "labels_ptr": "*i64", "old_ptr": "*fp32", "adv_ptr": "*fp32",
           "w_ptr": "*fp32", "ref_ptr": "*fp32", "out_ptr": ptr, "stride_out_row": "i64", "sums_ptr": "*fp32",
           "n_rows": "i32", "num_programs": "i32", "V": "i32", "inv_temperature": "fp32", "clip_low": "fp32",
           "clip_high": "fp32", "dual_clip": "fp32", "kl_coef": "fp32", "entropy_coef": "fp32", "tau_pos": "fp32",
           "tau_neg": "fp32"}
    k3, vanilla = KL_KIND_CODES["k3"], POLICY_LOSS_CODES["vanilla"]
    options = [(True, True, k3, False, True, vanilla), (True, True, k3, False, False, vanilla)]
    options += [(True, True, k3, False, True, code) for loss, code in POLICY_LOSS_CODES.items() if loss != "vanilla"]
    if every_option:
        options += [(False, False, 0, True, True, vanilla)] + [
            (True, True, code, False, True, vanilla) for kind, code in KL_KIND_CODES.items() if kind != "k3"] + [
            (True, True, code, False, True, vanilla) for code in KL_STRAIGHT_THROUGH_CODES.values()]
    specs = []
    for has_old, has_ref, kind, has_dual, need_grad, loss in options:
        constexprs = {"HAS_OLD": has_old, "HAS_REF": has_ref, "KL_KIND": kind, "HAS_DUAL": has_dual,
                      "LOSS_KIND": loss, "NEED_GRAD": need_grad, "LOG_RATIO_MAX": LOG_RATIO_CLAMP,
                      "K3_MAX": K3_CLAMP, "BLOCK_V": block_v}
        label = (f"rows[{logits_dtype}, loss={loss}, old={has_old}, ref={has_ref}, kl={kind}, dual={has_dual}, "
                 f"grad={need_grad}]")
        specs.append((label, token_loss_kernels().rows, sig, constexprs, _num_warps(block_v)))
    return specs


def grad_cast_specs():
    """(label, kernel, signature, constexprs, num_warps) of the fused head's last backward pass
    (``grad_cast_triton.py``): fp32 sums scaled and written in each low-precision weight dtype, and a gradient of
    that dtype scaled in place."""
    from .grad_cast_triton import BLOCK, NUM_WARPS, scale_cast_kernel

    return [(f"scale_cast[{src}->{dtype}]", scale_cast_kernel(),
             {"src_ptr": _POINTER[src], "scale_ptr": "*fp32", "dst_ptr": _POINTER[dtype], "n": "i64"},
             {"BLOCK": BLOCK}, NUM_WARPS)
            for dtype in ("bfloat16", "float16") for src in ("float32", dtype)]


def compile_all(
    capabilities=TARGET_CAPABILITIES,
    logits_dtypes=("float32", "bfloat16", "float16"),
    block_sizes=(4096, 1024),
) -> list[dict]:
    """Compile every kernel variant for every target; one result row each (raises on the first failure).

    Each row names the Triton version that compiled it: CI runs this with more than one Triton
    (the venv's, and the one the ``gpu`` extra installs) and checks which one actually ran.
    """
    import triton

    from .policy_loss_triton import LOOPING_BLOCK_V

    # (block_v, spec) of every variant, in the order the rows come out, for each target alike.
    specs = [(None, spec) for spec in token_loss_specs() + grad_cast_specs()]
    # The row kernel's every option once: in bf16 (what GPU runs take) at the first block size.
    every_option_at = ("bfloat16" if "bfloat16" in logits_dtypes else logits_dtypes[0], block_sizes[0])
    for dtype in logits_dtypes:
        for block_v in block_sizes:
            every_option = (dtype, block_v) == every_option_at
            specs += [(block_v, spec) for spec in kernel_specs(dtype, block_v)
                      + row_loss_specs(dtype, block_v, every_option)]
    if "bfloat16" in logits_dtypes:  # the row kernel looping on a few programs (PATHS.row_programs_per_sm)
        specs += [(LOOPING_BLOCK_V, spec) for spec in row_loss_specs("bfloat16", LOOPING_BLOCK_V)]
    results = []
    for capability in capabilities:
        for block_v, (label, fn, sig, constexprs, warps) in specs:
            results.append({"kernel": label, "sm": capability, "block_v": block_v, "triton": triton.__version__,
                            **compile_for_target(fn, sig, constexprs, capability, warps)})
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="AOT-compile the fastrlhf Triton kernels for GPU targets")
    parser.add_argument("--sm", type=int, nargs="+", default=list(TARGET_CAPABILITIES))
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16", "float16"], choices=sorted(_POINTER))
    parser.add_argument("--block", type=int, nargs="+", default=[4096, 1024])
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                        help="processes compiling at once, one target each (the compiler runs on one core)")
    args = parser.parse_args(argv)
    jobs = max(1, min(args.jobs, len(args.sm)))
    if jobs == 1:
        rows = compile_all(args.sm, args.dtype, args.block)
    else:  # forked before any kernel is imported or compiled, so each child lowers from a clean state
        with multiprocessing.get_context("fork").Pool(jobs) as pool:
            per_target = pool.starmap(compile_all, [([sm], args.dtype, args.block) for sm in args.sm])
        rows = [row for rows_of_one in per_target for row in rows_of_one]
    json.dump(rows, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
