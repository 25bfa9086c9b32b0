"""Run under ``deepspeed --num_gpus 2``: one RL step padded and one packed with a token budget, from the
same weights and the same fixed completions, at each ``algo:zero_stage`` case given.

argv: <model dir> <prompts.jsonl> <out dir> <case>... (``algo:stage``, or ``algo:stage:shared`` for the
packed step with ``trainer.share_prompts``). Each rank's completions differ in length (one
very long one on rank 0 only), so the ranks' token budgets give different micro-batch counts
before they agree on one. Rank 0 writes ``<out>/<case>.json``: the step's metrics and the actor's
(gathered) weights' checksum for each layout, and the largest weight difference between them.
"""

import contextlib
import json
import os
import sys

import torch
from two_rank_steps import gathered_actor_state  # this script's folder is on sys.path


def completions_of(rank, prompts):
    from fastrlhf.rollout import Completion

    g = torch.Generator().manual_seed(100 + rank)
    out = []
    for i, _ in enumerate(prompts):
        samples = []
        for j in range(4):
            length = 30 if (rank, i, j) == (0, 0, 1) else int(torch.randint(1, 8, (1,), generator=g))
            tokens = torch.randint(3, 9, (length,), generator=g).tolist()  # target_token 3: ragged rewards
            samples.append(Completion(tokens, [-1.0] * length, "length"))
        out.append(samples)
    return out


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
    model_dir, prompts_path, out_dir, *cases = args
    from fastrlhf import distributed as D
    from fastrlhf.config import parse_config
    from fastrlhf.data import load_prompts
    from fastrlhf.distributed import comm
    from fastrlhf.engine.guards import StepGuard
    from fastrlhf.rl.trainer import build_rl_step

    D.init_distributed()
    examples = load_prompts(prompts_path)
    mine = examples[2 * D.rank():2 * D.rank() + 2]
    prompts, metas = [e.prompt_ids for e in mine], [e.meta for e in mine]
    completions = completions_of(D.rank(), prompts)
    for case in cases:
        algo, stage, *shared = case.split(":")  # algo:stage[:shared] (packed with trainer.share_prompts)
        results = {}
        # "summed": padded again, with autograd summing the tied embedding's and LM head's gradients
        # (no fastrlhf.modeling.tied_gradient handoff), to check the handoff under DeepSpeed's gradient hooks.
        for layout in ("padded", "packed", "summed"):
            trainer = {"max_steps": 1, "prompts_per_step": 4, "minibatch_size": 8, "lr": 1e-3, "kl_coef": 0.05,
                       "old_logprobs": "recompute", "agg": "seq-mean-token-mean" if algo == "grpo" else "token-mean"}
            if layout == "packed":
                trainer.update(packing=True, max_tokens_per_microbatch=16, share_prompts=bool(shared))
            raw = {
                "algorithm": algo, "output_dir": os.path.join(out_dir, f"{case.replace(':', '-')}-{layout}"), "seed": 1,
                "model": {"path": model_dir}, "reward": {"function": "target_token"},
                "data": {"prompts": prompts_path, "max_prompt_len": 16},
                "rollout": {"engine": "hf", "n": 4, "max_new_tokens": 8, "max_logprob_mismatch": None},
                "trainer": trainer,
                "deepspeed": {"zero_stage": int(stage), "extra": {"zero_optimization": {
                    "stage3_param_persistence_threshold": 0}} if stage == "3" else {}},
            }
            if algo == "ppo":
                raw["critic"] = {"lr": 1e-3}
            config = parse_config(raw)
            torch.manual_seed(0)  # the critic's fresh value head: the same in both layouts
            rl_step, stateful = build_rl_step(config, StepGuard(3))
            with handoff_disabled() if layout == "summed" else contextlib.nullcontext():
                metrics = rl_step(prompts, metas, 1, completions=completions)
            module = stateful["actor"].module
            tied = module.get_input_embeddings().weight is module.get_output_embeddings().weight
            results[layout] = {"metrics": metrics, "state": gathered_actor_state(stateful["actor"], stage == "3"),
                               "tied": tied}
            rl_step.rollout.close()
            comm.barrier()
        if D.rank() == 0:
            a, b, c = (results[k]["state"] for k in ("padded", "packed", "summed"))
            with open(os.path.join(out_dir, f"{case.replace(':', '-')}.json"), "w") as f:
                json.dump({"padded": results["padded"]["metrics"], "packed": results["packed"]["metrics"],
                           "max_weight_diff": max(float((a[n] - b[n]).abs().max()) for n in a),
                           "max_weight_diff_summed": max(float((a[n] - c[n]).abs().max()) for n in a),
                           "tied": bool(results["padded"]["tied"]),
                           "max_weight_change": max(float((a[n] - s).abs().max()) for n, s in
                                                    gathered_initial(model_dir).items() if n in a)}, f)
        comm.barrier()


@contextlib.contextmanager
def handoff_disabled():
    import fastrlhf.rl.forward as forward

    original = forward.tied_gradient_handoff
    forward.tied_gradient_handoff = lambda embedding, head: contextlib.nullcontext(lambda: head.weight)
    try:
        yield
    finally:
        forward.tied_gradient_handoff = original


def gathered_initial(model_dir):
    from safetensors.torch import load_file

    return load_file(os.path.join(model_dir, "model.safetensors"))


if __name__ == "__main__":
    main()
    from fastrlhf.cli import exit_with

    exit_with(0)  # as a launched fastrlhf rank leaves: without the c10d stores' exit-time abort
