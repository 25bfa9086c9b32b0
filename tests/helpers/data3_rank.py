"""One rank of a gloo run that loads its own prompt file, checks it against the other rank's as the commands
do, and builds the sampler (``python -m tests.helpers.data3_rank FILE``, with RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT set): prints ``ok`` and the first indices, or ``data error: ...`` and exits 2."""

import sys


def main(path: str) -> int:
    import torch.distributed as dist

    from fastrlhf.data import DataError, EpochSampler, check_same_data, load_prompts

    examples = load_prompts(path)  # before the process group, as the commands load their data
    dist.init_process_group("gloo", init_method="env://")
    try:
        check_same_data()  # as the commands do once the group is up
        sampler = EpochSampler(len(examples), seed=1)
    except DataError as exc:
        print(f"data error: {exc}", flush=True)
        return 2
    finally:
        dist.destroy_process_group()
    print("ok", sampler.next_indices(4), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
