"""The training engine every command shares: DeepSpeed engines built from a config (``deepspeed``), the
NaN/inf step guard and its optimizer (``guards``), where batches meet their model and the named host
reads (``device``), atomic checkpoints with exact resume (``checkpoint``), metrics (``metrics``), the
loop around a step (``loop``), and the switch to CPU-only machinery (``platform``).

Imports ``fastrlhf.distributed``, ``fastrlhf.config`` and ``fastrlhf.modeling``; not the commands.
"""
