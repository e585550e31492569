"""Weights from the trainer into rollout engines (paper Algorithm 1, line 1: ``θ_old ← θ``).

One weight-update session per sync: gather the ZeRO-3 shards in buckets, name them as the
Hugging Face checkpoint does, merge LoRA adapters, and hand the buckets to the engine
(``buckets``); how a bucket travels (``bucket_format``), the process group of a sync into vLLM servers
(``weight_group``), delta syncs (``weight_delta``) and the trainer's broadcast session (``broadcast``),
which reaches the servers through the `broadcast.ServerCalls` it is given. See docs/rollout.md.

May import: ``stapo.distributed`` and the folders below it (docs/index.md, "Layout"); never the
engines, the servers' client or the trainer above it.
"""
