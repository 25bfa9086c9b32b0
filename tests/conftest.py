import os

# The Triton interpreter must be switched on before anything imports triton (transformers and
# vLLM do), so that kernel tests with backend="triton" run on CPU tensors.
os.environ.setdefault("TRITON_INTERPRET", "1")
