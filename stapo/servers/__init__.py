"""The trainer's side of rollout servers (``rollout.mode: server``; docs/rollout.md, "Rollout servers").

The client of one server (``client``: one connection path for calls and streams), the pool that owns the
retry, backoff and failover policy of every request (``pool``), the request format (``completions``) and
`ServerEngine` (``engine``), which implements the engine contract on top of them, admits servers by their
fingerprints and drives the weight broadcast (`stapo.sync.broadcast`).

May import: ``stapo.rollout``, ``stapo.serve``, ``stapo.sync`` and the folders below them (docs/index.md,
"Layout"); never the trainer or the config.
"""
