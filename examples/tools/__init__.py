"""The tool-use example (``make tools``): a small Qwen2-shaped model learns to call a calculator for products of two
4-digit numbers, against the same model and budget without the tool. See ``run.py``."""
