"""What a run reports: per-step metrics, their sinks, MFU and the console line (docs/distributed.md has MFU).

May import: ``stapo.distributed``, ``stapo.rollout`` and the folders below them (docs/index.md,
"Layout"); never the trainer or the weight sync.
"""
