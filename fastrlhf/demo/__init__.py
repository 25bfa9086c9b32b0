"""``make demo``: the embedded default job (pretrain -> evaluate -> RL -> evaluate -> report).

See :mod:`fastrlhf.demo.pipeline` for the stages and ``examples/demo/*.yaml`` for the configs it runs.
"""
