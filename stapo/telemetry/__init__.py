"""What a run reports: per-step metrics, their sinks, MFU and the console line.

``step_metrics`` turns a step's tensors into one reduced dict (one ``.item()`` pass per step),
``metrics`` writes it (JSONL always; TensorBoard, W&B optional), ``mfu`` counts model FLOPs,
``console`` draws the progress line. See docs/distributed.md (MFU) and docs/index.md.

May import: ``stapo.distributed``, ``stapo.rollout`` and the folders below them (docs/index.md,
"Layout"); never the trainer or the weight sync.
"""
