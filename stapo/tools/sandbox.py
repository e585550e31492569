"""One sandboxed Python interpreter, from the trainer's side (docs/tools.md, "Threat model").

``Sandbox(limits)`` starts ``_sandbox_child.py`` — a fresh interpreter (fork+exec, as the reward
workers of ``stapo/rewards/pool.py``: never a fork of the trainer), in a clean environment, its
own process group and, where the OS allows, its own mount, PID and network namespaces — and
``run(code)`` executes one cell in it. The wall-clock limit is enforced here: a cell that has not
answered within ``timeout_s`` is killed with everything it started (the launcher kills the
worker, PID 1 of its namespace; its process group is SIGKILLed if the launcher does not exit),
as is a cell that floods its output pipe. The interpreter's own limits (CPU time, memory,
processes, file size) are set inside it.

A ``Sandbox`` lives as long as its owner keeps it: one call (the stateless ``python`` tool) or
one episode (a stateful session). ``close()`` — or the finalizer at exit — kills it and removes
its working directory.
"""

from __future__ import annotations

import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Optional

__all__ = ["SandboxLimits", "CellResult", "Sandbox", "SandboxStartError", "isolation_summary"]

_CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_sandbox_child.py")
_UID_BASE, _UID_SLOTS = 1 << 20, 256  # as root, each live sandbox runs as a uid of its own
_uid_lock, _uid_users = threading.Lock(), [0] * _UID_SLOTS  # live sandboxes per slot


@dataclass(frozen=True)
class SandboxLimits:
    """What one sandbox may use; docs/tools.md lists the defaults and what each stops."""

    timeout_s: float = 10.0  # wall clock per cell
    cpu_time_s: float = 10.0  # CPU seconds per cell (RLIMIT_CPU)
    memory_mb: int = 1024  # address space per process (RLIMIT_AS)
    max_processes: int = 16  # processes and threads of the sandbox's uid (RLIMIT_NPROC)
    file_size_mb: int = 16  # largest file, and the working directory's size (RLIMIT_FSIZE, tmpfs)
    max_output_chars: int = 2000  # printed characters kept per cell
    startup_timeout_s: float = 30.0  # for the interpreter to start (not part of timeout_s)
    isolate: bool = True  # enter namespaces where the OS allows it

    @property
    def max_output_bytes(self) -> int:
        """Bytes read from the output pipe per cell before the cell is stopped: output written
        past the interpreter's own cap (os.write, subprocesses) cannot flood the trainer."""
        return max(1 << 20, 64 * self.max_output_chars)


@dataclass(frozen=True)
class CellResult:
    """One cell's outcome."""

    text: str  # what it printed (stdout and stderr interleaved; a traceback on error); when more than
    #            max_output_chars, its first and last max_output_chars characters
    error: bool  # it raised, exited non-zero or hit a limit
    total_chars: int  # characters it printed, including those dropped past the cap
    ended: Optional[str] = None  # why the interpreter is gone (timeout, a limit's signal), else None


class SandboxStartError(RuntimeError):
    """The sandboxed interpreter could not start (its output says why)."""


_ISOLATION = {"network": ("no network", "network"), "pid": ("own PID namespace", "other processes"),
              "read_only": ("read-only file system", "file system")}


def isolation_summary(isolation: dict) -> str:
    """One line: what a started sandbox's ``isolation`` holds, and what it does not."""
    have = [yes for key, (yes, _) in _ISOLATION.items() if isolation.get(key)]
    have.append(f"uid {isolation.get('uid')}")
    if isolation.get("hidden"):
        have.append(f"hidden: {', '.join(isolation['hidden'])}")
    if isolation.get("writable_mounts"):
        have.append(f"still writable: {', '.join(isolation['writable_mounts'])}")
    lacking = [no for key, (_, no) in _ISOLATION.items() if not isolation.get(key)]
    return ", ".join(have) + (f"; NOT isolated: {', '.join(lacking)} (resource limits only)" if lacking else "")


def _clean_env(workdir: str) -> dict:
    """The sandbox's whole environment: no secrets, tokens or paths of the trainer's."""
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8",
            "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "MALLOC_ARENA_MAX": "2"}


def _take_uid() -> int:
    """A uid no other live sandbox on this machine uses (from this process's pid and a free slot;
    past 256 live sandboxes in one process, slots are shared and so is their process count)."""
    with _uid_lock:
        slot = _uid_users.index(min(_uid_users))
        _uid_users[slot] += 1
    return _UID_BASE + (os.getpid() % (1 << 22)) * _UID_SLOTS + slot


def _release_uid(uid: int) -> None:
    with _uid_lock:
        slot = (uid - _UID_BASE) % _UID_SLOTS
        _uid_users[slot] = max(0, _uid_users[slot] - 1)


def _kill_group(proc: subprocess.Popen, owner: int) -> None:
    """End a sandbox: SIGTERM asks the launcher to kill and reap the worker (and with it its PID
    namespace); if the launcher does not exit within a second, SIGKILL its process group (the
    worker, in a session of its own, follows by PDEATHSIG)."""
    if os.getpid() != owner:  # a forked copy of the trainer must not kill its parent's sandboxes
        return
    for signo, wait_s in ((signal.SIGTERM, 1.0), (signal.SIGKILL, 10.0)):
        if proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, signo) if signo == signal.SIGKILL else proc.send_signal(signo)
        except (ProcessLookupError, PermissionError):
            proc.kill()
        try:
            proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            continue


def _finalize(proc: subprocess.Popen, owner: int, fds: list, workdir: str) -> None:
    _kill_group(proc, owner)
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass
    shutil.rmtree(workdir, ignore_errors=True)


class Sandbox:
    """One sandboxed interpreter; ``run(code)`` executes a cell, ``close()`` ends it."""

    def __init__(self, limits: SandboxLimits = SandboxLimits(), stateful: bool = False):
        self.limits, self.stateful = limits, stateful  # stateful: several cells share the interpreter
        self.isolation: dict = {}
        self._proc: Optional[subprocess.Popen] = None
        self._finalizer = None

    # ---- lifecycle ------------------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> None:
        """Start the interpreter and wait for its ``ready``; ``SandboxStartError`` if it cannot."""
        self.close()
        workdir = tempfile.mkdtemp(prefix="stapo-sandbox-")
        req_r, req_w = os.pipe()
        rep_r, rep_w = os.pipe()
        out_r, out_w = os.pipe()
        self._uid = _take_uid() if os.geteuid() == 0 else 0
        lim = self.limits
        cfg = {"workdir": workdir, "req_fd": req_r, "rep_fd": rep_w, "isolate": lim.isolate, "uid": self._uid,
               "memory_mb": lim.memory_mb, "max_processes": lim.max_processes, "file_size_mb": lim.file_size_mb,
               "cpu_time_s": lim.cpu_time_s, "stateful": self.stateful}
        try:
            proc = subprocess.Popen([sys.executable, "-I", "-u", _CHILD, json.dumps(cfg)], stdin=subprocess.DEVNULL,
                                    stdout=out_w, stderr=out_w, pass_fds=(req_r, rep_w), env=_clean_env(workdir),
                                    cwd=workdir, start_new_session=True, close_fds=True)
        except OSError as exc:
            for fd in (req_w, rep_r, out_r):
                os.close(fd)
            shutil.rmtree(workdir, ignore_errors=True)
            if self._uid:
                _release_uid(self._uid)
            raise SandboxStartError(f"the python sandbox could not be started: {exc}") from None
        finally:
            for fd in (req_r, rep_w, out_w):
                os.close(fd)
        self._proc, self._req, self._rep, self._out, self._workdir = proc, req_w, rep_r, out_r, workdir
        self._owner, self._rep_buf = os.getpid(), b""
        self._finalizer = weakref.finalize(self, _finalize, proc, self._owner, [req_w, rep_r, out_r], workdir)
        os.set_blocking(out_r, False)
        os.set_blocking(req_w, False)
        ready, out, ended = self._wait(time.monotonic() + lim.startup_timeout_s, "start")
        if ready is None or not ready.get("ready"):
            self.close()
            text = out.decode("utf-8", "replace").strip()
            raise SandboxStartError(f"the python sandbox did not start ({ended}){': ' + text[-2000:] if text else ''}")
        self.isolation = ready.get("isolation", {})

    def close(self) -> None:
        """Kill the interpreter and everything it started; remove its working directory."""
        if self._finalizer is not None:
            self._finalizer()
            self._finalizer = None
            if self._uid:
                _release_uid(self._uid)
        self._proc = None

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- one cell -------------------------------------------------------------------------------
    def run(self, code: str) -> CellResult:
        """Execute ``code`` in the interpreter (started first if it is not running)."""
        if not self.alive:
            self.start()
        request = json.dumps({"code": code, "max_output_chars": self.limits.max_output_chars}) + "\n"
        deadline = time.monotonic() + self.limits.timeout_s
        if not self._send(request.encode("utf-8", "backslashreplace"), deadline):
            self.close()
            return CellResult("", True, 0, "the python interpreter did not take the code (it had stopped)")
        reply, out, ended = self._wait(deadline, "run")
        text = out.decode("utf-8", "replace")
        if reply is None:
            self.close()
            return CellResult(text, True, len(text), ended)
        dropped = int(reply.get("cut", 0))
        total = len(text) + dropped
        if dropped:  # the head came through the pipe; the end of what was dropped comes in the reply
            text += str(reply.get("tail", ""))[-dropped:]
        return CellResult(text, bool(reply.get("error")), total)

    def _send(self, data: bytes, deadline: float) -> bool:
        """Write a request (code longer than the pipe's buffer goes in pieces) before ``deadline``."""
        with selectors.DefaultSelector() as sel:
            sel.register(self._req, selectors.EVENT_WRITE)
            while data:
                if not sel.select(max(0.0, deadline - time.monotonic())):
                    return False
                try:
                    data = data[os.write(self._req, data):]
                except BlockingIOError:
                    continue
                except OSError:  # the interpreter is gone
                    return False
        return True

    def _wait(self, deadline: float, what: str) -> tuple[Optional[dict], bytes, Optional[str]]:
        """Read output and the next reply until the reply, the deadline or the process's end:
        ``(reply or None, output bytes kept, why it ended)``."""
        out, total, cap = bytearray(), 0, 4 * self.limits.max_output_chars + 4096
        with selectors.DefaultSelector() as sel:
            sel.register(self._out, selectors.EVENT_READ)
            sel.register(self._rep, selectors.EVENT_READ)
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    limit = self.limits.timeout_s if what == "run" else self.limits.startup_timeout_s
                    self._kill()
                    return None, bytes(out), f"timed out after {limit:g} s (the wall-clock limit); it was stopped"
                for key, _ in sel.select(left):
                    chunk = self._read(key.fd)
                    if chunk is None:
                        continue
                    if key.fd == self._out:
                        total += len(chunk)
                        out += chunk[:max(0, cap - len(out))]
                        if not chunk:
                            sel.unregister(self._out)
                        elif total > self.limits.max_output_bytes:
                            self._kill()
                            return None, bytes(out), (f"printed more than {self.limits.max_output_bytes} bytes; "
                                                      "it was stopped")
                    elif not chunk:  # reply pipe closed: the interpreter is gone
                        out += self._drain(cap - len(out))
                        return None, bytes(out), self._death()
                    else:
                        self._rep_buf += chunk
                        if b"\n" in self._rep_buf:
                            line, self._rep_buf = self._rep_buf.split(b"\n", 1)
                            out += self._drain(cap - len(out))
                            reply = _json(line)
                            return reply, bytes(out), None if reply else "its reply was unreadable"

    @staticmethod
    def _read(fd: int) -> Optional[bytes]:
        """A chunk, b"" at end of file, None when nothing is there after all."""
        try:
            return os.read(fd, 1 << 16)
        except BlockingIOError:
            return None
        except OSError:
            return b""

    def _drain(self, room: int) -> bytes:
        """What is already in the output pipe (the cell wrote it before its reply)."""
        data = bytearray()
        for _ in range(64):
            try:
                chunk = os.read(self._out, 1 << 16)
            except OSError:  # BlockingIOError: nothing more now
                break
            if not chunk:
                break
            data += chunk
        return bytes(data[:max(0, room)])

    def _kill(self) -> None:
        if self._proc is not None:
            _kill_group(self._proc, self._owner)

    def _death(self) -> str:
        """Why the interpreter ended, from the launcher's exit status (128 + the worker's signal)."""
        try:
            code = self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self._kill()
            code = self._proc.returncode
        signo = code - 128 if code is not None and code > 128 else None
        if signo == signal.SIGXCPU:
            return f"the interpreter was killed by SIGXCPU: over its CPU time limit of {self.limits.cpu_time_s:g} s"
        if signo:
            return f"the interpreter was killed by {signal.Signals(signo).name}"
        return f"the interpreter exited (code {code})"


def _json(line: bytes) -> Optional[dict]:
    try:
        value = json.loads(line)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None
