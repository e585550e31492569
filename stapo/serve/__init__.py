"""What runs inside ``stapo serve`` and inside vLLM's worker (docs/rollout.md, "Rollout servers", "Security").

The launcher (``launcher``), the guard in front of vLLM's routes (``guard``), the shared secret (``secret``),
the worker extension vLLM mixes into its worker (``worker_extension``: the colocated engine's weight session)
and a server's side of a weight sync (``staging``), the fingerprint both sides compare (``fingerprint``) and
the CPU-build settings the launcher shares with the colocated engine.

May import: ``stapo.sync`` and the folders below it (docs/index.md, "Layout"); never the trainer's side
(``stapo.servers``, ``stapo.rollout``). vLLM imports the worker modules by qualified name inside its worker,
where they need torch (and transformers for the fingerprint) only.
"""
