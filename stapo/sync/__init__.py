"""Weights from the trainer into rollout engines (paper Algorithm 1, line 1: ``θ_old ← θ``).

One weight-update session per sync: gather the ZeRO-3 shards in buckets, name them as the
Hugging Face checkpoint does, merge LoRA adapters, and hand the buckets to the engine
(``buckets``). See docs/rollout.md.

May import: ``stapo.distributed`` and the folders below it (docs/index.md, "Layout"); never the
trainer or telemetry.
"""
