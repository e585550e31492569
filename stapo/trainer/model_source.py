"""Where ``model.path`` comes from (the tiny model, a local directory, the HF cache or the hub) and one clear
error when it is none of them, before any rank loads weights (not transformers' raw ``OSError`` after the
process group started). Only :func:`require_model` contacts the hub, for an uncached name when online.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from stapo.run_dir import first_line

BUILTIN_MODEL = "builtin:tiny"

BUILTIN, LOCAL, CACHED, HUB = "builtin", "local", "cached", "hub"


@dataclass(frozen=True)
class ModelSource:
    """``kind``: ``builtin``, ``local`` (a directory), ``cached`` (a hub name in the HF cache) or ``hub``."""

    path: str
    kind: str

    def describe(self) -> str:
        return {BUILTIN: "the built-in tiny model, built offline",
                LOCAL: "a local model directory",
                CACHED: "a Hugging Face hub model found in the local cache",
                HUB: "a Hugging Face hub model, downloaded at start",
                }[self.kind]


def offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def not_cached(what: str, local: str, fix: str) -> str:
    """Why hub name ``what`` (not a local ``local``, not in the HF cache) may not load here."""
    if offline():
        return f"{what} is not a local {local} and not in the Hugging Face cache, and HF_HUB_OFFLINE is set: {fix}"
    return (f"{what} is not in the local Hugging Face cache: the run downloads it at start, so the hub must be "
            f"reachable; offline: {fix}")


def _how_to_fix(path: str) -> str:
    return (f"set model.path to a local model directory, or download it once where the hub is reachable "
            f"(hf download {path}) and run with HF_HUB_OFFLINE=1 to use the cache")


def model_source(path: str) -> ModelSource:
    """Classify ``model.path`` from the disk and the HF cache alone; ValueError when it cannot be a model."""
    if path == BUILTIN_MODEL:
        return ModelSource(path, BUILTIN)
    local = Path(path).expanduser()
    if local.exists():
        if not (local / "config.json").is_file():
            raise ValueError(f"model.path {path!r} is not a Hugging Face model directory (no config.json)")
        return ModelSource(path, LOCAL)
    from huggingface_hub import try_to_load_from_cache
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(path)
    except HFValidationError:
        raise ValueError(f"model.path {path!r}: no such directory, and not a hub model name "
                         "(org/name)") from None
    cached = try_to_load_from_cache(path, "config.json")
    return ModelSource(path, CACHED if isinstance(cached, str) else HUB)


def unavailable_reason(source: ModelSource) -> str | None:
    """Why the weights of ``source`` may not load here (a hub name not in the cache), or None."""
    if source.kind != HUB:
        return None
    return not_cached(f"model.path {source.path!r}", "directory", _how_to_fix(source.path))


def require_model(path: str) -> ModelSource:
    """:func:`model_source`, and for an uncached hub name a reachable hub (else one ValueError naming the fix)."""
    source = model_source(path)
    if source.kind != HUB:
        return source
    if offline():
        raise ValueError(unavailable_reason(source))
    from huggingface_hub import hf_hub_download

    try:
        hf_hub_download(path, "config.json")
    except Exception as exc:  # connection, auth, unknown repo: all end the same way for the user
        raise ValueError(f"model.path {path!r} is not a local directory and could not be fetched from the "
                         f"Hugging Face hub ({first_line(exc)}): {_how_to_fix(path)}") from None
    return source
