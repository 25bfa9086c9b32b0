"""The races of ``make bench-gpu`` by name, and the command that runs one in a fresh child process
(``python -m benchmarks.gpu.races NAME JSON``, see :func:`benchmarks.gpu.children.run_child`): the peak-memory figures
then start from an empty device, and nothing a race leaves behind (an NCCL group, a DeepSpeed engine, the caching
allocator's blocks) reaches the next one. ``test_races_cpu.py`` runs every race at tiny shapes on a CPU,
``test_bench_gpu.py`` at full size. Each race is a plain function in the module named for it:

1. ``lm_head`` (:mod:`benchmarks.gpu.lm_head`): the LM head and GRPO loss of a 7B model (Qwen2.5-7B's H and V) on
   16,384 tokens, forward + backward: fastrlhf's fused kernel, the same math on materialised logits, Liger-Kernel's
   ``LigerFusedLinearGRPOLoss`` and the three bare GEMMs every exact method runs (the floor).
2. ``rl_update`` (:mod:`benchmarks.gpu.rl_update`): ``RLStep.update`` of the 1.5B Qwen2 on DeepSpeed ZeRO-2 with
   gradient checkpointing, in trained tokens/s and MFU against a bf16 GEMM rate measured in the same process.
3. ``grpo_vs_trl`` (:mod:`benchmarks.gpu.grpo`): whole GRPO steps (HF generate, reference, update) of ``fastrlhf
   train`` (:mod:`benchmarks.gpu.grpo_ours`) against TRL's ``GRPOTrainer`` (:mod:`benchmarks.gpu.grpo_trl`), each
   trainer in its own process on the same model folder, prompts and batch (:mod:`benchmarks.gpu.workload`).
4. ``layouts`` (:mod:`benchmarks.gpu.layouts`): the reference pass and update in the padded, packed and
   shared-prompt layouts.
5. ``grpo_engines`` (:mod:`benchmarks.gpu.grpo`): whole GRPO steps of ``fastrlhf train`` with vLLM in the trainer's
   process against the same steps with HF ``generate``, and against TRL's ``GRPOTrainer`` with its colocated vLLM.

How they measure is :mod:`benchmarks.gpu.timing`'s.
"""

from __future__ import annotations

import json
import sys

from benchmarks.gpu.children import RESULT_PREFIX
from benchmarks.gpu.grpo import grpo_engines, grpo_vs_trl
from benchmarks.gpu.grpo_trl import trl_grpo
from benchmarks.gpu.lm_head import lm_head_race
from benchmarks.gpu.rl_update import rl_update_race
from benchmarks.gpu.timing import measure  # noqa: F401  (scripts/gpu_probe.py imports it from here)
from benchmarks.gpu.workload import save_model


def layouts_race(**kwargs) -> dict:
    """Race 4, padded / packed / shared prompts: :func:`benchmarks.gpu.layouts.race`."""
    from benchmarks.gpu.layouts import race

    return race(**kwargs)


RACES = {"lm_head": lm_head_race, "rl_update": rl_update_race, "grpo_vs_trl": grpo_vs_trl, "save_model": save_model,
         "trl_grpo": trl_grpo, "layouts": layouts_race, "grpo_engines": grpo_engines}

if __name__ == "__main__":
    result = RACES[sys.argv[1]](**json.loads(sys.argv[2]))
    print(RESULT_PREFIX + json.dumps(result), flush=True)
