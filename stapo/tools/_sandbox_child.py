"""The sandboxed interpreter of the ``python`` tool: ``python -I -u _sandbox_child.py CONFIG_JSON``.

Run as a file with the standard library only (``-I``: no PYTHONPATH, no user site, no script
directory on the path), by ``sandbox.py`` in a clean environment and its own process group.
Two processes (docs/tools.md, "Threat model"):

* the launcher enters new PID and network namespaces (``unshare``; as root, or through a user
  namespace where the kernel allows one), forks the worker and waits for it, watching its own
  parent. On SIGTERM (``Sandbox.close``), or when the trainer disappears, it kills the worker
  — PID 1 of its namespace, whose death takes every process it started with it — reaps it and
  exits, so no zombie is left to count against the sandbox uid's process limit (orphaned, it also
  removes the working directory).
* the worker enters a mount namespace of its own, makes every mount read-only, mounts an empty
  size-capped tmpfs on the working directory and a fresh /proc, gives up root (a uid of its own,
  or no capabilities), sets its resource limits (address space, processes, file size, CPU time,
  open files) and then runs code cells: each request on the request pipe is one cell, run in one
  persistent namespace (a stateful session's variables), its printed output capped; after each
  cell every other process in the namespace is killed, and a reply goes to the reply pipe.

The isolation itself is ``_sandbox_isolation.py``. Protocol (JSON lines): the worker first writes
``{"ready": true, "isolation": {...}}``; each request ``{"code": str, "max_output_chars": m}`` is
answered by ``{"error": bool, "cut": n, "tail": str}`` once the cell has finished: its output's
first m characters went to fd 1 / 2 (one pipe the parent reads), n more were dropped, and the
last m of those are ``tail``.
"""

import ast
import builtins
import io
import json
import linecache
import os
import resource
import select
import shutil
import signal
import sys
import time
import traceback

_SELF = os.path.abspath(__file__)
sys.path.insert(0, os.path.dirname(_SELF))
import _sandbox_isolation as isolate  # noqa: E402 - a sibling file, found through the line above
sys.path.pop(0)


# ---- the launcher -------------------------------------------------------------------------------

def _pidfd(pid: int):
    """A pidfd of the worker (Linux >= 5.3): signals through it can never reach a reused pid."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


def _kill_worker(pid: int, pidfd) -> None:
    try:
        if pidfd is not None:
            signal.pidfd_send_signal(pidfd, signal.SIGKILL)
        else:
            os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, OSError):
        pass


def _wait_worker(pid: int, pidfd, parent: int) -> int:
    """The worker's wait status; kill it if the trainer disappears first. (No threads here: a
    process that has unshared its PID namespace cannot start any.)"""
    while True:
        if pidfd is not None:
            select.select([pidfd], [], [], 0.25)
        else:
            time.sleep(0.05)
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status
        if os.getppid() != parent:  # the trainer is gone: so is the sandbox
            _kill_worker(pid, pidfd)


def main() -> None:
    cfg = json.loads(sys.argv[1])
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # until the worker exists (then: kill it, reap it, exit)
    root = os.geteuid() == 0
    isolation = isolate.unshare(root) if cfg["isolate"] else {}
    parent = os.getppid()
    pid = os.fork()
    if pid == 0:
        try:
            _worker(cfg, isolation, root)
        finally:
            os._exit(70)
    pidfd = _pidfd(pid)
    signal.signal(signal.SIGTERM, lambda signum, frame: _kill_worker(pid, pidfd))
    os.close(cfg["req_fd"])
    os.close(cfg["rep_fd"])
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    status = _wait_worker(pid, pidfd, parent)
    if os.getppid() != parent:  # orphaned: nobody else will remove the working directory
        shutil.rmtree(cfg["workdir"], ignore_errors=True)
    os._exit(128 + os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status))


# ---- the worker -----------------------------------------------------------------------------------

def _limit(cfg: dict) -> None:
    mb = 1024 * 1024
    cpu = max(1, round(cfg["cpu_time_s"]))  # RLIMIT_CPU counts whole seconds
    # a one-call process is killed one second past its limit; a session's hard limit cannot be
    # raised again without CAP_SYS_RESOURCE, so only its soft limit is renewed per cell (_serve)
    limits = [(resource.RLIMIT_CPU, cpu, resource.RLIM_INFINITY if cfg["stateful"] else cpu + 1),
              (resource.RLIMIT_CORE, 0, 0),
              (resource.RLIMIT_FSIZE, cfg["file_size_mb"] * mb, cfg["file_size_mb"] * mb),
              (resource.RLIMIT_NPROC, cfg["max_processes"], cfg["max_processes"]),
              (resource.RLIMIT_NOFILE, 256, 256), (resource.RLIMIT_AS, cfg["memory_mb"] * mb, cfg["memory_mb"] * mb)]
    for which, soft, hard in limits:
        _, old_hard = resource.getrlimit(which)
        if old_hard != resource.RLIM_INFINITY:
            soft, hard = min(soft, old_hard), min(old_hard if hard == resource.RLIM_INFINITY else hard, old_hard)
        resource.setrlimit(which, (soft, hard))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # over the file-size limit: an OSError, not a kill
    seconds = cfg["cpu_time_s"]

    def over_cpu(signum, frame):  # the soft limit: the cell fails, the session lives; the hard limit kills
        raise CPUTimeLimitExceeded(f"the cell used more than its CPU time limit of {seconds:g} s")

    signal.signal(signal.SIGXCPU, over_cpu)  # PID 1 of a namespace ignores signals it has no handler for


class CPUTimeLimitExceeded(BaseException):
    """Raised in a cell at its CPU time limit (RLIMIT_CPU's SIGXCPU); a second later it is killed."""


def _worker(cfg: dict, isolation: dict, root: bool) -> None:
    os.setsid()  # a session of its own: the cell's kill(0, ...) or killpg cannot reach the launcher
    uid = cfg["uid"] if root else 0
    if isolation.get("pid"):
        try:
            isolate.isolate_files(cfg, isolation, uid)
        except OSError as exc:  # e.g. a seccomp profile that forbids mount: network and PID isolation only
            isolation["read_only"], isolation["mount_error"] = False, str(exc)
    os.chdir(cfg["workdir"])
    if root and uid:  # the output pipe (for /dev/stdout) and, without its tmpfs, the working directory
        for target in [1] if isolation.get("workdir_tmpfs") else [1, cfg["workdir"]]:
            try:
                os.chown(target, uid, uid)
            except OSError:
                pass
    isolate.drop_privileges(uid, root)
    isolation["uid"] = os.geteuid()
    _limit(cfg)
    reply = os.fdopen(cfg["rep_fd"], "w")
    reply.write(json.dumps({"ready": True, "isolation": isolation}) + "\n")
    reply.flush()
    _serve(os.fdopen(cfg["req_fd"], "r"), reply, cfg["cpu_time_s"], namespaced=bool(isolation.get("pid")))


# ---- the worker: code cells ---------------------------------------------------------------------

class _Budget:
    """One cell's output: the first ``size`` characters go to the fd, the rest is counted and its
    last ``size`` characters kept (the end of a traceback matters most)."""

    def __init__(self, size: int = 0):
        self.left, self.size, self.dropped, self.tail = size, size, 0, ""


class _Capped(io.TextIOBase):
    """sys.stdout / sys.stderr, sharing one ``_Budget``: writes straight to the fd until it is spent."""

    def __init__(self, fd: int, budget: list):
        self.fd, self.budget = fd, budget  # budget[0]: this cell's _Budget

    def write(self, s: str) -> int:
        if not isinstance(s, str):
            raise TypeError(f"write() argument must be str, not {type(s).__name__}")
        budget = self.budget[0]
        keep = s[:max(budget.left, 0)]
        budget.left -= len(keep)
        if len(s) > len(keep):
            budget.dropped += len(s) - len(keep)
            budget.tail = (budget.tail + s[len(keep):])[-budget.size:]
        data = keep.encode("utf-8", "backslashreplace")
        while data:
            data = data[os.write(self.fd, data):]
        return len(s)

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self.fd

    @property
    def encoding(self) -> str:
        return "utf-8"


def _run_cell(code: str, scope: dict, name: str, me: int) -> bool:
    """Execute one cell in ``scope``; print the value of a final expression (as a REPL does) and
    the traceback of an exception. True when the cell failed. A process the cell forked that
    comes back here exits at once: only the worker itself may answer."""
    linecache.cache[name] = (len(code), None, code.splitlines(True), name)
    try:
        tree = ast.parse(code, name, "exec")
        last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
        exec(compile(tree, name, "exec"), scope)
        if last is not None:
            value = eval(compile(ast.Expression(last.value), name, "eval"), scope)
            if value is not None:
                print(repr(value))
        return False
    except SystemExit as exc:
        return exc.code not in (None, 0)
    except BaseException:  # noqa: BLE001 - the user's error is the cell's output
        if os.getpid() != me:
            os._exit(1)
        report = traceback.TracebackException(*sys.exc_info())
        report.stack = traceback.StackSummary.from_list([f for f in report.stack if f.filename != _SELF])
        sys.stderr.write("".join(report.format()))  # the cell's and libraries' frames, not the sandbox's
        return True
    finally:
        if os.getpid() != me:
            os._exit(0)


def _reap_others() -> None:
    """Kill every other process of the namespace (background work does not outlive its cell)."""
    try:
        os.kill(-1, signal.SIGKILL)
    except OSError:
        pass
    while True:
        try:
            if os.waitpid(-1, os.WNOHANG)[0] == 0:
                break
        except ChildProcessError:
            break


def _renew_cpu(seconds: float) -> None:
    """Soft RLIMIT_CPU at what this process used so far plus one cell's ``seconds``."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    _, hard = resource.getrlimit(resource.RLIMIT_CPU)
    soft = max(1, round(usage.ru_utime + usage.ru_stime + seconds))
    resource.setrlimit(resource.RLIMIT_CPU, (soft if hard == resource.RLIM_INFINITY else min(soft, hard), hard))


def _serve(requests, reply, cpu_time_s: float, namespaced: bool) -> None:
    me, budget = os.getpid(), [_Budget()]
    sys.stdout, sys.stderr = _Capped(1, budget), _Capped(2, budget)
    scope = {"__name__": "__main__", "__builtins__": builtins}
    for number, line in enumerate(requests):
        request = json.loads(line)
        budget[0] = _Budget(request["max_output_chars"])
        _renew_cpu(cpu_time_s)
        failed = _run_cell(request["code"], scope, f"<cell {number}>", me)
        if namespaced and me == 1:
            _reap_others()
        reply.write(json.dumps({"error": failed, "cut": budget[0].dropped, "tail": budget[0].tail}) + "\n")
        reply.flush()


if __name__ == "__main__":
    main()
