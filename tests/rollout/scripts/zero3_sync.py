"""Started by tests/rollout/test_rollout_zero3.py under ``deepspeed --num_gpus 2``.

Each rank: a ZeRO-3 trainer (tied embeddings, one SGD step so the weights are live partitions, not
the checkpoint), one in-process VLLMEngine started from a *different* model, a bucketed sync, and a
check that the engine now generates exactly what an HF model holding the gathered weights generates.
Writes ``rank<R>.json`` into the output folder given as argv[1].
"""

import json
import os
import sys
import time

if __name__ == "__main__":
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    script_start = time.perf_counter()
    out_dir, work_dir = [a for a in sys.argv[1:] if not a.startswith("--local_rank")]
    import deepspeed
    import torch
    import torch.distributed as dist

    from fastrlhf import distributed as D
    from fastrlhf.modeling.tiny import make_tiny_llama
    from fastrlhf.rollout import HFEngine, SamplingConfig, VLLMEngine, sync_weights

    # Through fastrlhf's set-up (gloo on CPU), which keeps DeepSpeed from mapping /dev/shm buffers.
    D.init_distributed(timeout_s=60)
    rank = dist.get_rank()
    report = {"rank": rank, "world_size": dist.get_world_size()}
    cfg = dict(initializer_range=0.2, tie_word_embeddings=True)
    if rank == 0:
        make_tiny_llama(seed=11, **cfg).save_pretrained(os.path.join(work_dir, "engine_init"))
    dist.barrier()

    trainer_model = make_tiny_llama(seed=22, **cfg).train()
    ds_config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
        "zero_allow_untested_optimizer": True,
    }
    optimizer = torch.optim.SGD(trainer_model.parameters(), lr=0.5)
    engine, *_ = deepspeed.initialize(model=trainer_model, optimizer=optimizer, config=ds_config)
    ids = torch.randint(3, 256, (1, 16), generator=torch.Generator().manual_seed(rank))
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    engine.step()
    report["partitioned"] = all(p.numel() == 0 for p in engine.module.parameters())

    t0 = time.perf_counter()
    rollout = VLLMEngine(os.path.join(work_dir, "engine_init"), max_model_len=512, kv_cache_bytes=16 << 20)
    report["engine_start_seconds"] = time.perf_counter() - t0

    prompts = [torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(n)).tolist() for n in (7, 150)]
    greedy = SamplingConfig(temperature=0, max_new_tokens=16, ignore_eos=True)
    before = [c[0].token_ids for c in rollout.generate(prompts, greedy)]  # fills the prefix cache

    stats = sync_weights(engine, rollout, bucket_bytes=64 << 10)
    report["sync_seconds"] = stats.seconds
    report["num_buckets"] = stats.num_buckets
    report["bytes"] = stats.bytes
    report["max_bucket_bytes"] = max(stats.bucket_sizes)

    # The reference: the trainer's weights gathered into a plain HF model.
    reference = make_tiny_llama(seed=0, **cfg)
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters()), modifier_rank=None):
        state = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    missing, unexpected = reference.load_state_dict(state, strict=False)
    report["reference_missing"] = [m for m in missing if m != "lm_head.weight"]
    after = [c[0].token_ids for c in rollout.generate(prompts, greedy)]
    expected = [c[0].token_ids for c in HFEngine(reference).generate(prompts, greedy)]
    report["changed"] = after != before
    report["matches_trainer"] = after == expected

    # The trainer's process group must outlive the engine.
    rollout.close()
    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    report["all_reduce_after_close"] = t.item()
    report["script_seconds"] = time.perf_counter() - script_start
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)
    dist.barrier()
    from fastrlhf.cli import exit_with

    exit_with(0)  # as every command leaves: past torch's exit-time abort of a started group (SIGABRT, 1 exit in 3)
