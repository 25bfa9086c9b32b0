"""Target for ``helpers.launch.spawn_ranks`` (two gloo ranks) of tests/modeling/test_lora_adapter_export.py: a LoRA
actor trained under ZeRO-3 (partitioned over both ranks) exported with its adapter."""


def zero3_lora_export(source: str, final: str, rank: int, port: int, out) -> None:
    """Loads ``source`` with LoRA into a ZeRO-3 engine, sets each adapter factor B to a seeded value, exports to
    ``final`` and puts the B values in ``out["lora_B"]``. Bind the paths with ``functools.partial``."""
    import os

    import deepspeed
    import torch
    import torch.distributed as dist

    from fastrlhf.config import DeepSpeedConfig, ModelConfig
    from fastrlhf.engine.deepspeed import build_train_engine, deepspeed_config
    from fastrlhf.modeling import export_hf, load_causal_lm

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank)
    )
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        ds = DeepSpeedConfig(zero_stage=3)
        model_cfg = ModelConfig(path=source, dtype="float32", lora_r=4, lora_targets=["q_proj", "down_proj"])
        model = load_causal_lm(model_cfg, zero3_config=deepspeed_config(ds, micro_batch_size=1))
        engine = build_train_engine(model, ds, lr=1e-2)
        factors = {n: p for n, p in engine.module.named_parameters() if "lora_B" in n}
        values = {}
        with deepspeed.zero.GatheredParameters(list(factors.values()), modifier_rank=0):
            for i, (name, param) in enumerate(sorted(factors.items())):
                torch.manual_seed(i)
                values[name] = torch.randn(param.shape) * 0.2
                if rank == 0:
                    param.data.copy_(values[name])
        export_hf(engine, final, zero_stage=3)
        if rank == 0:
            out["lora_B"] = values
    finally:
        dist.destroy_process_group()
