"""Killable reward workers: a hard per-item wall-clock limit and a memory cap (docs/rewards.md, "Hang-proofing").

Some sympy hangs ignore signals, and SIGALRM works on the main thread only, so each item runs in a worker
process that is killed past ``timeout_s`` (the item scores -1) and replaced.
"""

from __future__ import annotations

import json
import math
import os
import selectors
import subprocess
import sys
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import Optional, Sequence

_PKG_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@dataclass
class _Worker:
    proc: subprocess.Popen
    started: float
    ready: bool = False
    task: Optional[int] = None  # index in the current batch
    deadline: float = math.inf
    buf: bytes = field(default=b"")


def _kill(worker: _Worker) -> None:
    proc = worker.proc
    if proc.poll() is None:
        proc.kill()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:  # pragma: no cover - kernel would have to refuse SIGKILL
        pass
    for stream in (proc.stdin, proc.stdout):
        try:
            stream.close()
        except OSError:
            pass


def _shutdown(workers: list[_Worker], owner_pid: int) -> None:
    if os.getpid() != owner_pid:  # a forked child must not kill its parent's workers
        return
    while workers:
        _kill(workers.pop())


class WorkerPool:
    """Persistent, lazily started workers: ``run`` scores answer pairs with sympy, ``run_tasks`` calls a user
    reward function; ``startup_error`` holds the message of a worker that could not load the function."""

    def __init__(self, num_workers: Optional[int] = None, timeout_s: float = 5.0, memory_mb: int = 1024,
                 startup_timeout_s: float = 120.0, function: Optional[str] = None, batched: bool = False):
        num_workers = num_workers if num_workers is not None else max(1, min(4, os.cpu_count() or 1))
        if num_workers < 1 or timeout_s <= 0:
            raise ValueError(f"need num_workers >= 1 and timeout_s > 0, got {num_workers}, {timeout_s}")
        self.num_workers, self.timeout_s, self.memory_mb = num_workers, timeout_s, memory_mb
        self.startup_timeout_s = startup_timeout_s
        self.function, self.batched = function, batched
        self.startup_error: Optional[str] = None
        self._workers: list[_Worker] = []
        self._lock = threading.Lock()
        self._closed = False
        self._owner_pid = os.getpid()
        self._finalizer = weakref.finalize(self, _shutdown, self._workers, self._owner_pid)

    # -- lifecycle ---------------------------------------------------------------------------
    def _spawn(self) -> _Worker:
        # a user's reward function needs no rollout server's secret (docs/rollout.md, "Security")
        env = {k: v for k, v in os.environ.items() if k != "STAPO_SERVER_TOKEN"}
        paths = [_PKG_ROOT, env.get("PYTHONPATH")]
        cmd = [sys.executable, "-m", "stapo.rewards._worker", "--memory-mb", str(self.memory_mb)]
        if self.function is not None:  # the user's module must import as it does in this process
            paths += [os.getcwd(), *(p for p in sys.path if p and os.path.isdir(p))]
            cmd += ["--function", self.function] + (["--batched"] if self.batched else [])
        env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
        env.update(MALLOC_ARENA_MAX="2", OMP_NUM_THREADS="1", PYTHONHASHSEED="0")
        proc = subprocess.Popen(  # user functions may print: their stderr stays visible
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=None if self.function is not None else subprocess.DEVNULL, env=env, close_fds=True)
        worker = _Worker(proc=proc, started=time.monotonic())
        self._workers.append(worker)
        return worker

    def _retire(self, worker: _Worker, sel: selectors.BaseSelector) -> None:
        try:
            sel.unregister(worker.proc.stdout)
        except (KeyError, ValueError):
            pass
        _kill(worker)
        self._workers.remove(worker)

    def pids(self) -> list[int]:
        """Process ids of the live workers (for tests and monitoring)."""
        return [w.proc.pid for w in self._workers]

    def close(self) -> None:
        """Kill all workers; the pool can no longer run."""
        with self._lock:
            self._closed = True
            _shutdown(self._workers, self._owner_pid)

    def warmup(self) -> None:
        """Start all workers now and wait until they are ready (first-use latency off the clock)."""
        with self._lock:
            self._adopt()
            while len(self._workers) < self.num_workers:
                self._spawn()
            deadline = time.monotonic() + self.startup_timeout_s
            with selectors.DefaultSelector() as sel:
                for w in self._workers:
                    sel.register(w.proc.stdout, selectors.EVENT_READ, w)
                while not all(w.ready for w in self._workers) and time.monotonic() < deadline:
                    for key, _ in sel.select(timeout=0.5):
                        self._read(key.data, [], {}, sel)

    def _adopt(self) -> None:
        """After a fork, the inherited workers belong to the parent: forget them, start afresh."""
        if os.getpid() != self._owner_pid:
            self._workers = []
            self._owner_pid = os.getpid()
            self._finalizer = weakref.finalize(self, _shutdown, self._workers, self._owner_pid)

    # -- batch execution ---------------------------------------------------------------------
    def run_tasks(self, payloads: Sequence[object], default: object) -> tuple[list, dict[int, str]]:
        """``(results, errors)``: each JSON ``payload`` run by a worker; a task that timed out, crashed
        or raised keeps ``default`` and gets its reason in ``errors`` (keyed by position)."""
        results, errors = [default] * len(payloads), {}
        if not payloads:
            return results, errors
        with self._lock:
            if self._closed:
                raise RuntimeError("WorkerPool is closed (close() was called); create a new scorer")
            self._adopt()
            with selectors.DefaultSelector() as sel:
                self._run_locked(payloads, results, errors, sel)
        return results, errors

    def _run_locked(self, items: Sequence[object], results: list, errors: dict[int, str], sel) -> None:
        pending = deque(range(len(items)))
        remaining, failures = len(items), 0
        want = min(self.num_workers, len(items))
        for w in self._workers:
            sel.register(w.proc.stdout, selectors.EVENT_READ, w)
        while remaining:
            while len(self._workers) < min(want, len(pending) + self._busy()) and failures <= 2 * want:
                sel.register(self._spawn().proc.stdout, selectors.EVENT_READ, self._workers[-1])
            if not self._workers:  # workers cannot even start: everything left is a mismatch
                why = f"reward worker could not start{': ' + self.startup_error if self.startup_error else ''}"
                errors.update((i, why) for i in pending)
                return
            for w in list(self._workers):
                if w.ready and w.task is None and pending:
                    if not self._send(w, pending[0], items[pending[0]]):
                        failures += 1
                        self._retire(w, sel)
                        continue
                    pending.popleft()
            now = time.monotonic()
            wake = min([w.deadline for w in self._workers if w.task is not None]
                       + [w.started + self.startup_timeout_s for w in self._workers if not w.ready]
                       + [now + 1.0])
            for key, _ in sel.select(max(0.0, wake - now)):
                remaining -= self._read(key.data, results, errors, sel)
            now = time.monotonic()
            for w in list(self._workers):
                if w.task is not None and now > w.deadline:  # over the item limit: kill it
                    errors[w.task] = f"timed out after {self.timeout_s:g} s"
                    remaining -= 1
                    self._retire(w, sel)
                elif not w.ready and now > w.started + self.startup_timeout_s:
                    failures += 1
                    self._retire(w, sel)
                elif w.proc.poll() is not None and w.task is None and not w.buf:
                    failures += 0 if w.ready else 1
                    self._retire(w, sel)

    def _busy(self) -> int:
        return sum(w.task is not None for w in self._workers)

    def _send(self, w: _Worker, idx: int, payload: object) -> bool:
        try:  # default=str: odd dataset values (dates, numpy scalars) reach user functions as text
            w.proc.stdin.write((json.dumps([idx, payload], default=str) + "\n").encode())
            w.proc.stdin.flush()
        except (BrokenPipeError, OSError, ValueError):
            return False
        w.task, w.deadline = idx, time.monotonic() + self.timeout_s
        return True

    def _read(self, w: _Worker, results: list, errors: dict[int, str], sel) -> int:
        """Consume a worker's output; returns how many items it finished (incl. by dying)."""
        try:
            chunk = os.read(w.proc.stdout.fileno(), 1 << 16)
        except OSError:
            chunk = b""
        if not chunk:  # EOF: the worker died (memory cap, crash); its item is a mismatch
            task = w.task
            self._retire(w, sel)
            if task is not None:
                errors[task] = f"reward worker died (exit code {w.proc.returncode})"
            return int(task is not None)
        w.buf += chunk
        finished = 0
        while b"\n" in w.buf:
            line, w.buf = w.buf.split(b"\n", 1)
            try:
                msg = json.loads(line)
            except ValueError:  # stray output (a library printing to stdout): not ours
                continue
            if msg == "ready":
                w.ready = True
            elif isinstance(msg, list) and len(msg) == 2 and msg[0] == "error" and not w.ready:
                self.startup_error = str(msg[1])  # the user function could not be loaded
            elif isinstance(msg, list) and len(msg) >= 2 and msg[0] == w.task and w.task is not None:
                if len(msg) > 2:  # [task, null, "error"]: the call raised
                    errors[w.task] = str(msg[2])
                else:
                    results[w.task] = msg[1]
                w.task, w.deadline = None, math.inf
                finished += 1
        return finished
