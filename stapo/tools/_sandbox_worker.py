"""The sandbox's worker: runs the policy's code cells (forked by ``_sandbox_child.py``).

Its set-up order matters, each step needing the one before. The cell runs in this very process and could
write anything on the answer pipe: the launcher checks it.
"""

import ast
import builtins
import io
import linecache
import os
import resource
import signal
import sys
import traceback

import _sandbox_confine as confine
import _sandbox_isolation as isolate
from _sandbox_protocol import read_frame, write_frame

_SELF = os.path.abspath(__file__)
SESSION_CPU_CELLS = 10  # a session's hard CPU limit: this many cells' worth (RLIMIT_CPU cannot be raised again)


def cpu_hard_limit(cfg: dict) -> int:
    """RLIMIT_CPU's hard limit: one second past the cell's for a one-call process; for a session,
    ``SESSION_CPU_CELLS`` cells' worth in all (its soft limit is renewed per cell)."""
    cpu = max(1, round(cfg["cpu_time_s"]))  # RLIMIT_CPU counts whole seconds
    return SESSION_CPU_CELLS * cpu if cfg["stateful"] else cpu + 1


def main(cfg: dict, isolation: dict, root: bool, requests: int, answers: int) -> None:
    os.setsid()  # a session of its own: the cell's kill(0, ...) or killpg cannot reach the launcher
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # the launcher's handler and ignores are not the cell's
    signal.signal(signal.SIGINT, signal.default_int_handler)
    uid = cfg["uid"] if root else 0
    rules = confine.seccomp_filter(isolation) if cfg["isolate"] else None
    interpreter = None
    if isolation.get("pid"):
        try:
            isolate.read_only_mounts(isolation)
            interpreter = isolate.reach_interpreter()  # after the remount: its descriptors are read-only too
            isolate.hide_and_mount(cfg, isolation, uid, interpreter)
        except OSError as exc:  # e.g. a seccomp or AppArmor profile that forbids mount: no read-only view
            isolation["read_only"], isolation["mount_error"] = False, f"mounts: {exc}"
    interpreter = interpreter or isolate.reach_interpreter()
    os.chdir(cfg["workdir"])
    if root and uid:  # the output pipe (for /dev/stdout) and, without its tmpfs, the working directory
        for target in [1] if isolation.get("workdir_tmpfs") else [1, cfg["workdir"]]:
            try:
                os.chown(target, uid, uid)
            except OSError:
                pass
    isolate.drop_privileges(uid, root, isolation)
    isolation["uid"] = os.geteuid()
    _limit(cfg)
    if cfg["isolate"]:
        confine.landlock(cfg["workdir"], interpreter, isolation)
    if rules is not None:
        try:
            rules.load()
            isolation["seccomp"] = True
        except OSError as exc:
            isolation["seccomp_error"] = f"seccomp_load: {exc}"
    write_frame(answers, {"ready": True, "isolation": isolation})
    _serve(requests, answers, cfg["cpu_time_s"])


def _limit(cfg: dict) -> None:
    mb = 1024 * 1024
    cpu = max(1, round(cfg["cpu_time_s"]))
    limits = [(resource.RLIMIT_CPU, cpu, cpu_hard_limit(cfg)), (resource.RLIMIT_CORE, 0, 0),
              (resource.RLIMIT_FSIZE, cfg["file_size_mb"] * mb, cfg["file_size_mb"] * mb),
              (resource.RLIMIT_NPROC, cfg["max_processes"], cfg["max_processes"]),
              (resource.RLIMIT_NOFILE, 256, 256), (resource.RLIMIT_AS, cfg["memory_mb"] * mb, cfg["memory_mb"] * mb)]
    for which, soft, hard in limits:
        _, old_hard = resource.getrlimit(which)
        if old_hard != resource.RLIM_INFINITY:
            soft, hard = min(soft, old_hard), min(hard, old_hard)
        resource.setrlimit(which, (soft, hard))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # over the file-size limit: an OSError, not a kill
    seconds = cfg["cpu_time_s"]

    def over_cpu(signum, frame):  # the soft limit: the cell fails, the session lives; the hard limit kills
        raise CPUTimeLimitExceeded(f"the cell used more than its CPU time limit of {seconds:g} s")

    signal.signal(signal.SIGXCPU, over_cpu)  # PID 1 of a namespace ignores signals it has no handler for


class CPUTimeLimitExceeded(BaseException):
    """Raised in a cell at its CPU time limit (RLIMIT_CPU's SIGXCPU); a second later it is killed."""

    __module__ = "builtins"  # the traceback says "CPUTimeLimitExceeded: ...", not this file's name


# ---- code cells ---------------------------------------------------------------------------------

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


def _renew_cpu(seconds: float) -> None:
    """Soft RLIMIT_CPU at what this process used so far plus one cell's ``seconds`` (at most the hard limit)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    _, hard = resource.getrlimit(resource.RLIMIT_CPU)
    soft = max(1, round(usage.ru_utime + usage.ru_stime + seconds))
    resource.setrlimit(resource.RLIMIT_CPU, (min(soft, hard), hard))


def _serve(requests: int, answers: int, cpu_time_s: float) -> None:
    me, budget = os.getpid(), [_Budget()]
    sys.stdout, sys.stderr = _Capped(1, budget), _Capped(2, budget)
    scope = {"__name__": "__main__", "__builtins__": builtins}
    while True:
        request = read_frame(requests)
        if request is None:
            return
        budget[0] = _Budget(request["max_output_chars"])
        _renew_cpu(cpu_time_s)
        failed = _run_cell(request["code"], scope, f"<cell {request['k'] - 1}>", me)
        write_frame(answers, {"k": request["k"], "error": failed, "cut": budget[0].dropped, "tail": budget[0].tail})
