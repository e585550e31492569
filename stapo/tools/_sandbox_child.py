"""The sandboxed interpreter of the ``python`` tool: ``python -I -u _sandbox_child.py CONFIG_JSON``.

Run as a file with the standard library only (``-I``: no PYTHONPATH, no user site, no script
directory on the path), by ``sandbox.py`` in a clean environment and its own process group.
Two processes (docs/tools.md, "Threat model"):

* the launcher enters new mount, PID and network namespaces (``unshare``; as root, or through a
  user namespace where the kernel allows one), forks the worker and waits for it, watching its
  own parent. On SIGTERM (``Sandbox.close``), or when the trainer disappears, it kills the worker
  — PID 1 of its namespace, whose death takes every process it started with it — reaps it and
  exits, so no zombie is left to count against the sandbox uid's process limit.
* the worker makes every mount read-only, mounts an empty size-capped tmpfs on the working
  directory and a fresh /proc, gives up root (a uid of its own, or no capabilities), sets its
  resource limits (address space, processes, file size, CPU time, open files) and then runs code
  cells: each request on the request pipe is one cell, run in one persistent namespace (a
  stateful session's variables), its printed output capped; after each cell every other
  process in the namespace is killed, and a reply goes to the reply pipe.

Protocol (JSON lines): the worker first writes ``{"ready": true, "isolation": {...}}``; each request ``{"code": str, "max_output_chars": n}`` is
answered by ``{"error": bool, "cut": n, "tail": str}`` once the cell has finished: its output's first
``max_output_chars`` characters went to fd 1 / 2 (one pipe the parent reads), ``n`` more were
dropped, the last ``max_output_chars`` of them are ``tail``.
"""

import ast
import builtins
import ctypes
import io
import json
import linecache
import os
import resource
import select
import signal
import stat
import sys
import time
import traceback

CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x00020000, 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 0x1, 0x2, 0x4, 0x8
MS_REMOUNT, MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC, MS_PRIVATE, MS_RELATIME = (
    0x20, 0x400, 0x800, 0x1000, 0x4000, 0x40000, 0x200000)
_KEEP_FLAGS = {"nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC, "noatime": MS_NOATIME,
               "nodiratime": MS_NODIRATIME, "relatime": MS_RELATIME}  # locked in a user namespace
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS = 1, 38

_libc = ctypes.CDLL(None, use_errno=True)
_SELF = os.path.abspath(__file__)


def _call(name, *args):
    """A libc call; OSError on failure (None when this libc has no such function)."""
    fn = getattr(_libc, name, None)
    if fn is None:
        return None
    if fn(*args) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{name}: {os.strerror(err)}")
    return True


# ---- the launcher -------------------------------------------------------------------------------

def _unshare(root: bool) -> dict:
    """Enter new mount, PID and network namespaces; the namespaces entered ({} where not allowed)."""
    flags = CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | (0 if root else CLONE_NEWUSER)
    uid, gid = os.getuid(), os.getgid()
    try:
        if not _call("unshare", flags):
            return {}
        if not root:  # become root of the new user namespace, mapped to ourselves outside
            for path, text in (("setgroups", "deny"), ("uid_map", f"0 {uid} 1"), ("gid_map", f"0 {gid} 1")):
                with open(f"/proc/self/{path}", "w") as f:
                    f.write(text)
    except OSError as exc:
        return {"error": str(exc)}
    return {"user_namespace": not root, "network": True, "pid": True}


def _wait_worker(worker: int, parent: int) -> int:
    """The worker's wait status; kill it if the trainer disappears first. (No threads here: a
    process that has unshared its PID namespace cannot start any.)"""
    try:
        ended = os.pidfd_open(worker)
    except (AttributeError, OSError):  # kernels before 5.3: poll
        ended = None
    while True:
        if ended is not None:
            select.select([ended], [], [], 0.25)
        else:
            time.sleep(0.05)
        pid, status = os.waitpid(worker, os.WNOHANG)
        if pid:
            return status
        if os.getppid() != parent:  # the trainer is gone: so is the sandbox
            os.kill(worker, signal.SIGKILL)


def main() -> None:
    cfg = json.loads(sys.argv[1])
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # until the worker exists (then: kill it, reap it, exit)
    root = os.geteuid() == 0
    isolation = _unshare(root) if cfg["isolate"] else {}
    parent = os.getppid()
    pid = os.fork()
    if pid == 0:
        try:
            _worker(cfg, isolation, root)
        finally:
            os._exit(70)
    signal.signal(signal.SIGTERM, lambda signum, frame: os.kill(pid, signal.SIGKILL))
    os.close(cfg["req_fd"])
    os.close(cfg["rep_fd"])
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    status = _wait_worker(pid, parent)
    os._exit(128 + os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status))


# ---- the worker: isolation ----------------------------------------------------------------------

def _mounts() -> list:
    """(mount point, per-mount options) of every mount, from /proc/self/mountinfo."""
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            point = fields[4].encode().decode("unicode_escape").encode("latin-1")  # \040 -> space
            out.append((point, fields[5].split(",")))
    return out


def _closed_ancestor(path: str):
    """The first directory on ``path`` that other users cannot enter, or None."""
    current = "/"
    for part in [p for p in path.split("/") if p]:
        current = os.path.join(current, part)
        if os.path.isdir(current) and not os.stat(current).st_mode & stat.S_IXOTH:
            return current
    return None


def _hide_homes(isolation: dict) -> None:
    """Empty read-only tmpfs over /root and /home (keys, tokens, caches stay out of reach) and over
    any closed directory the interpreter lives under; then the interpreter's own directories
    (prefixes and import path) bound back at their paths, so the sandbox's uid can import them."""
    own = {os.path.realpath(p) for p in [sys.prefix, sys.base_prefix, *sys.path] if p and os.path.exists(p)}
    own = sorted(p for p in own if not any(p != q and p.startswith(q + "/") for q in own))
    tops = {t for t in ("/root", "/home") if os.path.isdir(t)}
    tops |= {c for c in map(_closed_ancestor, own) if c}
    tops = {t for t in tops if not any(t != u and t.startswith(u + "/") for u in tops)}
    keep = {p: os.open(p, os.O_PATH) for p in own if any(p.startswith(t + "/") for t in tops)}
    for top in sorted(tops):
        _call("mount", b"tmpfs", top.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, b"size=1m,mode=0755")
    for path, fd in keep.items():
        os.makedirs(path if os.path.isdir(f"/proc/self/fd/{fd}") else os.path.dirname(path), 0o755, exist_ok=True)
        if not os.path.isdir(f"/proc/self/fd/{fd}"):
            open(path, "a").close()  # a zip on the import path: a file to bind onto
        _call("mount", f"/proc/self/fd/{fd}".encode(), path.encode(), None, MS_BIND | MS_REC, None)
        os.close(fd)
    isolation["hidden"] = sorted(tops)


def _minimal_dev() -> None:
    """A /dev with null, zero, full, random and urandom only: no GPUs, disks or terminals."""
    keep = {n: os.open(f"/dev/{n}", os.O_PATH) for n in ("null", "zero", "full", "random", "urandom")
            if os.path.exists(f"/dev/{n}")}
    _call("mount", b"tmpfs", b"/dev", b"tmpfs", MS_NOSUID | MS_NOEXEC, b"size=64k,mode=0755")
    for name, fd in keep.items():
        open(f"/dev/{name}", "w").close()
        _call("mount", f"/proc/self/fd/{fd}".encode(), f"/dev/{name}".encode(), None, MS_BIND, None)
        os.close(fd)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                         ("stderr", "/proc/self/fd/2")):
        os.symlink(target, f"/dev/{name}")


def _isolate_files(cfg: dict, isolation: dict, uid: int) -> None:
    """Home directories hidden; a minimal /dev; everything read-only; an empty tmpfs of
    file_size_mb on the working directory; a fresh /proc that shows the namespace's processes only."""
    _call("mount", None, b"/", None, MS_REC | MS_PRIVATE, None)
    _hide_homes(isolation)
    try:
        _minimal_dev()
        isolation["devices"] = True
    except OSError:
        isolation["devices"] = False
    failed = []
    for point, options in _mounts():
        flags = MS_REMOUNT | MS_BIND | MS_RDONLY
        flags |= sum(bit for name, bit in _KEEP_FLAGS.items() if name in options)
        try:
            _call("mount", None, point, None, flags, None)
        except OSError:
            failed.append(point.decode(errors="replace"))
    workdir = cfg["workdir"].encode()
    data = f"size={cfg['file_size_mb']}m,mode=0700,uid={uid},gid={uid}".encode()
    _call("mount", b"tmpfs", workdir, b"tmpfs", MS_NOSUID | MS_NODEV, data)
    isolation["workdir_tmpfs"] = True
    try:
        _call("mount", b"proc", b"/proc", b"proc", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, None)
        isolation["proc"] = True
    except OSError:
        isolation["proc"] = False
    writable = [p for p in dict.fromkeys(failed) if _writable(p)]  # not shadowed by a mount made above
    isolation["read_only"] = not _writable("/") and "/" not in writable
    if writable:
        isolation["writable_mounts"] = writable


def _writable(path: str) -> bool:
    """True when the mount ``path`` resolves to is writable (False for a path that is gone)."""
    try:
        return not os.statvfs(path).f_flag & os.ST_RDONLY
    except OSError:
        return False


def _drop_privileges(uid: int, root: bool) -> None:
    """A uid of our own as root (so RLIMIT_NPROC applies and root's files are out of reach), no
    capabilities in any case, and no way back (no_new_privs: setuid binaries gain nothing)."""
    if root and uid:
        try:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
        except OSError:
            pass
    if os.geteuid() == 0:  # user namespace root, or a root that could not change uid: drop capabilities

        class Header(ctypes.Structure):
            _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

        class Data(ctypes.Structure):
            _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                        ("inheritable", ctypes.c_uint32)]

        _call("capset", ctypes.byref(Header(0x20080522, 0)), (Data * 2)())
    _call("prctl", PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    _call("prctl", PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # after setuid, which clears it


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
            _isolate_files(cfg, isolation, uid)
        except OSError as exc:  # e.g. a seccomp profile that forbids mount: network and PID isolation only
            isolation["read_only"], isolation["mount_error"] = False, str(exc)
    os.chdir(cfg["workdir"])
    if root and uid:  # the output pipe (for /dev/stdout) and, without its tmpfs, the working directory
        for target in [1] if isolation.get("workdir_tmpfs") else [1, cfg["workdir"]]:
            try:
                os.chown(target, uid, uid)
            except OSError:
                pass
    _drop_privileges(uid, root)
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
