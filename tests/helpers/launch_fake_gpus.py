"""A rank that sees ``N`` GPUs (emulated: this machine may have none) joins the process group.

``python tests/helpers/launch_fake_gpus.py N``, with the launcher's variables (RANK, LOCAL_RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT) in the environment. ``torch.cuda`` answers as CUDA would with ``N`` visible devices:
``set_device`` of a number past them fails with CUDA's "invalid device ordinal". Prints one line,
``joined`` or ``<exception type> exit=<code>: <message>``, and leaves with that code.
"""

import os
import sys


def fake_gpus(count: int) -> None:
    import torch

    def set_device(index):
        if int(index) >= count:
            raise RuntimeError("CUDA error: invalid device ordinal")

    torch.cuda.is_available = lambda: count > 0
    torch.cuda.device_count = lambda: count
    torch.cuda.set_device = set_device


def main() -> int:
    fake_gpus(int(sys.argv[1]))
    from fastrlhf.distributed import init_distributed

    try:
        init_distributed()
    except Exception as exc:  # noqa: BLE001 -- the test reads what each rank raised
        code = getattr(exc, "exit_code", 1)
        print(f"{type(exc).__name__} exit={code}: {exc}", flush=True)
        return code
    print("joined", flush=True)
    return 0


if __name__ == "__main__":
    sys.stdout.flush()
    os._exit(main())
