"""What runs inside ``stapo serve`` and inside vLLM's worker (docs/rollout.md, "Rollout servers", "Security").

May import: ``stapo.sync`` and the folders below it (docs/index.md, "Layout"); vLLM imports the worker modules
by qualified name inside its worker, where they need torch (and transformers for the fingerprint) only.
"""
