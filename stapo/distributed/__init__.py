"""Ranks and DeepSpeed: everything that knows the model is sharded (docs/distributed.md).

May import: ``stapo.losses`` and the folders below it (docs/index.md, "Layout").
"""
