"""One run directory that every rank sees, checked before anything is written (docs/distributed.md,
"Several nodes"): rank 0 writes a probe file under a fresh name (no cached NFS lookup answers it), every
rank looks for it, and if one cannot see it every rank stops with the same one-line error.
"""

from __future__ import annotations

import os
import socket
import time
import uuid
from pathlib import Path

from stapo.distributed.process_group import all_gather_object, broadcast_object, get_rank, get_world_size
from stapo.run_dir import SHARED_PROBE_PREFIX

__all__ = ["NotSharedError", "require_shared_dir"]

_SHOWN = 8  # ranks the error names; the rest are counted


class NotSharedError(ValueError):
    """The ranks do not all see one directory (a ValueError: the command line prints it as one line)."""


def _write_probe(root: Path) -> tuple[str | None, str | None]:
    """Rank 0: ``(token, None)`` once the probe is on disk, ``(None, problem)`` when it cannot be."""
    token = uuid.uuid4().hex
    try:
        root.mkdir(parents=True, exist_ok=True)
        with open(root / f"{SHARED_PROBE_PREFIX}{token}", "w", encoding="utf-8") as handle:
            handle.write(token)
            handle.flush()
            os.fsync(handle.fileno())
    except OSError as err:
        return None, f"rank 0 cannot write there ({err})"
    return token, None


def _sees_probe(root: Path, token: str, wait_s: float) -> str | None:
    """None when this rank reads rank 0's probe within ``wait_s`` seconds, else what it saw instead."""
    probe = root / f"{SHARED_PROBE_PREFIX}{token}"
    deadline = time.monotonic() + wait_s
    while True:
        try:
            if probe.read_text(encoding="utf-8") == token:
                return None
            problem = "a different file under the probe's name"
        except OSError as err:
            problem = f"no probe file ({type(err).__name__})"
        if time.monotonic() >= deadline:
            return problem
        time.sleep(0.1)


def require_shared_dir(path: str | os.PathLike, *, name: str, wait_s: float = 5.0) -> Path:
    """Create ``path`` and check that every rank sees it (collective); :class:`NotSharedError` on EVERY rank
    otherwise. ``wait_s``: how long a rank keeps looking (a slow shared filesystem shows a new file late)."""
    root = Path(path)
    if get_world_size() == 1:
        try:
            root.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise ValueError(f"{name} {root} cannot be created or written here ({err.strerror or err})") from None
        return root
    token, problem = _write_probe(root) if get_rank() == 0 else (None, None)
    token, problem = broadcast_object((token, problem))  # rank 0 wrote the probe before this returns
    if get_rank() != 0 and token is None:
        problem = None  # rank 0 could not write the probe: its own entry says why
    elif problem is None:
        try:
            root.mkdir(parents=True, exist_ok=True)
            problem = _sees_probe(root, token, wait_s)
        except OSError as err:
            problem = f"cannot create it ({err})"
    views = all_gather_object((problem, socket.gethostname()))  # [rank] -> (problem or None, host)
    if get_rank() == 0 and token is not None:
        (root / f"{SHARED_PROBE_PREFIX}{token}").unlink(missing_ok=True)
    failed = [f"rank {rank} on {host}: {seen}" for rank, (seen, host) in enumerate(views) if seen is not None]
    if failed:
        more = f"; {len(failed) - _SHOWN} more ranks" if len(failed) > _SHOWN else ""  # one line, even on 64 nodes
        raise NotSharedError(
            f"{name} {root} must be a directory on a filesystem all nodes share (checkpoints, latest and "
            f"metrics.jsonl are written there by rank 0 next to every rank's ZeRO shard), but rank 0's probe "
            f"file is not visible everywhere ({'; '.join(failed[:_SHOWN])}{more}); point {name} at a shared mount "
            f"(NFS, Lustre, GPFS; docs/distributed.md, \"Several nodes\")")
    return root
