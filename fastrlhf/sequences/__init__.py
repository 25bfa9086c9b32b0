"""How a micro-batch lays out its sequences: token-budget grouping and packed rows (``packing``), the
attention that reads a packed row (``packed_attention``) and its backend, chosen once per run
(``attention``, torch-free: the config checks call it).
"""
