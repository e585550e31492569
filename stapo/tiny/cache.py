"""Content-keyed, atomically written artifact directories for the tiny-model toolkit.

A build writes into a temporary sibling and renames it into place, so a directory under its final name is
complete by construction (the same rule as checkpoints, docs/distributed.md). The sibling's name carries the
host and pid of its builder: a build killed before its cleanup ran (SIGKILL, or SIGTERM with Python's default
handler) leaves it behind, and the next build of that entry on that host removes it once its builder is gone.

Two processes wanting the same cache entry (two study runs, two test sessions) build it once: the second waits on
the entry's lock file (``flock``, dropped by the kernel when its holder dies, however it dies; removed by a holder
that finishes) and reuses the first one's result. The lock saves work only: where a file system refuses ``flock``,
each process builds its own copy, the rename keeps whichever is first, and a warning says so.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import socket
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

#: Bump when the on-disk format or the build recipe changes, so old caches are not reused.
FORMAT_VERSION = 1


def cache_root() -> Path:
    """``$STAPO_CACHE/tiny`` if set, else ``~/.cache/stapo/tiny`` (read at call time)."""
    base = os.environ.get("STAPO_CACHE")
    return (Path(base) if base else Path.home() / ".cache" / "stapo") / "tiny"


def cache_key(kind: str, payload: dict) -> str:
    """Stable short key for ``payload`` (JSON-serializable) of artifact ``kind``."""
    blob = json.dumps({"kind": kind, "format": FORMAT_VERSION, **payload}, sort_keys=True, default=str)
    return f"{kind}-{hashlib.sha256(blob.encode()).hexdigest()[:16]}"


def _host_prefix(final: Path) -> str:
    """Prefix of ``final``'s temporary siblings built on this host; the builder's pid follows it."""
    return f".{final.name}.tmp-{socket.gethostname()}-"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def remove_orphaned_builds(final: Path) -> None:
    """Delete ``final``'s temporary siblings whose builder (this host, by pid) has exited. Siblings from
    other hosts sharing the cache, or from live builders, are left alone."""
    prefix = _host_prefix(final)
    for sibling in final.parent.iterdir():
        pid = sibling.name[len(prefix):].split("-", 1)[0] if sibling.name.startswith(prefix) else ""
        if pid.isdigit() and sibling.is_dir() and not _alive(int(pid)):
            shutil.rmtree(sibling, ignore_errors=True)


@contextmanager
def one_builder(final: Path) -> Iterator[None]:
    """Hold ``final``'s build lock, a ``.NAME.lock`` file beside it that its holder removes when done."""
    path = final.parent / f".{final.name}.lock"
    lock = _take(path, final.name)
    try:
        yield
    finally:
        if lock is not None:
            path.unlink(missing_ok=True)  # while still locked: a waiter then finds its file gone and retries
            lock.close()  # drops the lock


def _take(path: Path, name: str):
    """The locked, open lock file, saying who holds it while waiting; None (and a warning) where the file system
    refuses locks."""
    said = False
    while True:
        lock = open(path, "a+")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if not said:
                lock.seek(0)
                holder = lock.read().strip() or "pid unknown"
                sys.stderr.write(f"{name}: another process ({holder}) is building it; waiting to reuse its result\n")
                said = True
            fcntl.flock(lock, fcntl.LOCK_EX)
        except OSError as e:  # correct without the lock, only slower
            lock.close()
            sys.stderr.write(f"warning: {name}: cannot lock {path} ({e}); a concurrent build of the same entry "
                             "will be done twice\n")
            return None
        try:
            current = os.stat(path).st_ino == os.fstat(lock.fileno()).st_ino
        except FileNotFoundError:
            current = False
        if current:
            lock.truncate(0)
            lock.write(f"pid {os.getpid()} on {socket.gethostname()}")
            lock.flush()
            return lock
        lock.close()  # the holder removed this file as it finished: lock the one there now


def build_atomically(final: Path, build: Callable[[Path], None], *, reuse: bool) -> Path:
    """Run ``build(tmp_dir)`` and rename ``tmp_dir`` to ``final``, replacing it (or with ``reuse``, returning an
    existing ``final`` as is, waiting for a concurrent build of it rather than repeating it). If another process
    wins the race for ``final`` all the same, its copy is kept."""
    final = Path(final)
    if reuse and final.is_dir():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    if not reuse:
        return _build_and_rename(final, build, reuse)
    with one_builder(final):
        if final.is_dir():  # built while this process waited
            return final
        return _build_and_rename(final, build, reuse)


def _build_and_rename(final: Path, build: Callable[[Path], None], reuse: bool) -> Path:
    remove_orphaned_builds(final)
    tmp = Path(tempfile.mkdtemp(prefix=f"{_host_prefix(final)}{os.getpid()}-", dir=final.parent))
    try:
        build(tmp)
        if final.exists() and not reuse:
            shutil.rmtree(final)
        try:
            os.rename(tmp, final)
        except OSError:
            if not final.is_dir():
                raise
            # Lost a race with a concurrent build of the same key: theirs is equally valid.
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def build_cached(out_dir: Path | None, kind: str, payload: dict, build: Callable[[Path], None]) -> Path:
    """``build`` into ``out_dir`` (replaced), or with ``out_dir=None`` into the cache entry keyed by ``kind``
    and ``payload`` (reused when present)."""
    if out_dir is None:
        return build_atomically(cache_root() / cache_key(kind, payload), build, reuse=True)
    return build_atomically(Path(out_dir), build, reuse=False)


def hash_files(directory: Path, names: list[str]) -> str:
    """sha256 over the named files of ``directory`` (used to key derived artifacts)."""
    h = hashlib.sha256()
    for name in names:
        h.update(name.encode())
        h.update((Path(directory) / name).read_bytes())
    return h.hexdigest()


def entry_files(directory: Path) -> dict[str, bytes]:
    """The files of a (flat) cache entry by name: what another machine needs to hold the same entry."""
    directory = Path(directory)
    nested = [p.name for p in directory.iterdir() if not p.is_file()]
    if nested:
        raise ValueError(f"{directory} is not a flat cache entry: {nested} are not files")
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def install_entry(name: str, files: dict[str, bytes]) -> Path:
    """``cache_root()/name`` holding ``files`` (from :func:`entry_files` elsewhere); an existing entry of
    that name is complete by construction and reused. Atomic like every build here."""
    def write(tmp: Path) -> None:
        for file_name, data in files.items():
            (tmp / file_name).write_bytes(data)

    return build_atomically(cache_root() / name, write, reuse=True)

