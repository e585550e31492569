"""What a run reports: per-step metrics (``step_metrics``), their sinks (``metrics``), MFU (``mfu``) and
the console line (``console``); docs/distributed.md has MFU.

May import: ``stapo.distributed``, ``stapo.rollout`` and the folders below them (docs/index.md,
"Layout"); never the trainer or the weight sync.
"""
