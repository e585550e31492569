"""Weights from the trainer into rollout engines (paper Algorithm 1, line 1: ``θ_old ← θ``; docs/rollout.md).

May import: ``stapo.distributed`` and the folders below it (docs/index.md, "Layout").
"""
