"""One sandboxed Python interpreter, from the trainer's side (docs/tools.md, "Threat model").

It starts ``_sandbox_child.py`` by fork+exec, never a fork of the trainer, and trusts nothing the launcher answers.
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

from stapo.tools import _sandbox_protocol as protocol

__all__ = ["SandboxLimits", "CellResult", "Sandbox", "SandboxStartError"]

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
    isolate: bool = True  # every isolation layer the OS allows (False: limits, process clean-up and the protocol only)

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


def _kill_group(proc: subprocess.Popen, owner: int, uid: int) -> None:
    """End a sandbox: SIGTERM asks the launcher to kill and reap everything it started; if it has
    not exited within a second, SIGKILL its process group (the worker follows by PDEATHSIG) and,
    as root, every process of the sandbox's own uid."""
    if os.getpid() != owner or proc.poll() is not None:  # a forked copy of the trainer leaves its parent's alone
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=1.0)
        return
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        proc.kill()
    proc.wait()
    for _ in range(50 if uid else 0):  # what the launcher left: by uid (processes can fork meanwhile)
        found = [pid for pid in filter(str.isdigit, os.listdir("/proc")) if _real_uid(pid) == uid]
        for pid in found:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except OSError:
                pass
        if not found:
            return


def _real_uid(pid: str) -> Optional[int]:
    try:
        with open(f"/proc/{pid}/status") as f:
            return int(next(line for line in f if line.startswith("Uid:")).split()[1])
    except (OSError, StopIteration, ValueError):
        return None


def _finalize(proc: subprocess.Popen, owner: int, uid: int, fds: list, workdir: str) -> None:
    _kill_group(proc, owner, uid)
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
        self._owner, self._rep_buf = os.getpid(), bytearray()
        self._finalizer = weakref.finalize(self, _finalize, proc, self._owner, self._uid, [req_w, rep_r, out_r],
                                           workdir)
        os.set_blocking(out_r, False)
        os.set_blocking(req_w, False)
        ready, out, ended = self._wait(time.monotonic() + lim.startup_timeout_s, protocol.READY_CAP)
        if ready is None or ready.get("ready") is not True or not isinstance(ready.get("isolation"), dict):
            self.close()
            text = out.decode("utf-8", "replace").strip()
            ended = ended or _ended(ready) or "its first answer was not valid"
            raise SandboxStartError(f"the python sandbox did not start ({ended}){': ' + text[-2000:] if text else ''}")
        self.isolation = ready["isolation"]

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
        chars = self.limits.max_output_chars
        request = json.dumps({"code": code, "max_output_chars": chars}).encode()
        deadline = time.monotonic() + self.limits.timeout_s
        if not self._send(len(request).to_bytes(4, "big") + request, deadline):
            self.close()
            return CellResult("", True, 0, "the python interpreter did not take the code (it had stopped)")
        reply, out, ended = self._wait(deadline, protocol.cell_cap(chars))
        text = out.decode("utf-8", "replace")
        result = protocol.cell_result(reply, chars) if reply is not None else None
        if result is None:
            self.close()
            why = ended or _ended(reply) or "its answer was not valid; it was stopped"
            return CellResult(text, True, len(text), why)
        error, dropped, tail = result
        total = len(text) + dropped
        if dropped:  # the head came through the pipe; the end of what was dropped comes in the reply
            text += tail[-dropped:]
        return CellResult(text, error, total)

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

    def _wait(self, deadline: float, cap: int) -> tuple[Optional[dict], bytes, Optional[str]]:
        """Read output and the next answer (at most ``cap`` bytes) until the answer, the deadline or
        the launcher's end: ``(answer or None, output bytes kept, why it ended)``."""
        out, total, room = bytearray(), 0, 4 * self.limits.max_output_chars + 4096
        with selectors.DefaultSelector() as sel:
            sel.register(self._out, selectors.EVENT_READ)
            sel.register(self._rep, selectors.EVENT_READ)
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    limit = self.limits.timeout_s if cap != protocol.READY_CAP else self.limits.startup_timeout_s
                    self._kill()
                    return None, bytes(out), f"timed out after {limit:g} s (the wall-clock limit); it was stopped"
                for key, _ in sel.select(left):
                    chunk = self._read(key.fd)
                    if chunk is None:
                        continue
                    if key.fd == self._out:
                        total += len(chunk)
                        out += chunk[:max(0, room - len(out))]
                        if not chunk:
                            sel.unregister(self._out)
                        elif total > self.limits.max_output_bytes:
                            self._kill()
                            return None, bytes(out), (f"printed more than {self.limits.max_output_bytes} bytes; "
                                                      "it was stopped")
                        continue
                    if not chunk:  # the launcher is gone without an answer
                        out += self._drain(room - len(out))
                        return None, bytes(out), f"the python sandbox exited (code {self._proc.wait()})"
                    self._rep_buf += chunk
                    reply = protocol.take_frame(self._rep_buf, cap)
                    if reply is not None:
                        out += self._drain(room - len(out))
                        return reply, bytes(out), None

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
        """What is already in the output pipe (the cell wrote it before its answer)."""
        data = bytearray()
        for _ in range(64):
            chunk = self._read(self._out)
            if not chunk:  # None: nothing more now
                break
            data += chunk
        return bytes(data[:max(0, room)])

    def _kill(self) -> None:
        if self._proc is not None:
            _kill_group(self._proc, self._owner, self._uid)


def _ended(reply: Optional[dict]) -> Optional[str]:
    """The launcher's ``{"ended": why}`` (a string of sane length), else None."""
    why = reply.get("ended") if isinstance(reply, dict) else None
    return why[:500] if isinstance(why, str) else None
