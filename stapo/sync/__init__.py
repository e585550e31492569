"""Weights from the trainer into rollout engines (paper Algorithm 1, line 1: ``θ_old ← θ``; docs/rollout.md).

Bucketed ZeRO-3 gathers (``buckets``), the bucket format, the weight group of a sync into servers, delta syncs
and the trainer's broadcast session, which reaches the servers through the `broadcast.ServerCalls` it is given.

May import: ``stapo.distributed`` and the folders below it (docs/index.md, "Layout").
"""
