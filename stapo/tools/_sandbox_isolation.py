"""Namespaces, mounts and privileges of the python tool's sandbox (run inside ``_sandbox_child.py``;
standard library only): layer 4 of docs/tools.md, "Threat model", and the uid given up.
"""

import ctypes
import os
import signal
import stat
import sys

CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x00020000, 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 0x1, 0x2, 0x4, 0x8
MS_REMOUNT, MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC, MS_PRIVATE, MS_RELATIME = (
    0x20, 0x400, 0x800, 0x1000, 0x4000, 0x40000, 0x200000)
_KEEP_FLAGS = {"nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC, "noatime": MS_NOATIME,
               "nodiratime": MS_NODIRATIME, "relatime": MS_RELATIME}  # locked in a user namespace
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS, PR_SET_CHILD_SUBREAPER = 1, 38, 36
DEVICES = ("null", "zero", "full", "random", "urandom")
HIDDEN = ("/root", "/home", "/tmp", "/run", "/var/run")  # empty in the mount namespace

_libc = ctypes.CDLL(None, use_errno=True)


def call(name, *args):
    """A libc call; OSError on failure (None when this libc has no such function)."""
    fn = getattr(_libc, name, None)
    if fn is None:
        return None
    if fn(*args) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{name}: {os.strerror(err)}")
    return True


def unshare(root: bool) -> dict:
    """Enter new PID (for the children) and network namespaces; the namespaces entered ({} where
    not allowed). The mount namespace is the worker's alone: the launcher keeps the trainer's view
    of the file system, to remove the working directory if it is orphaned."""
    flags = CLONE_NEWPID | CLONE_NEWNET | (0 if root else CLONE_NEWUSER)
    uid, gid = os.getuid(), os.getgid()
    try:
        if not call("unshare", flags):
            return {}
        if not root:  # become root of the new user namespace, mapped to ourselves outside
            for path, text in (("setgroups", "deny"), ("uid_map", f"0 {uid} 1"), ("gid_map", f"0 {gid} 1")):
                with open(f"/proc/self/{path}", "w") as f:
                    f.write(text)
    except OSError as exc:
        needs = "CAP_SYS_ADMIN" if root else "unprivileged user namespaces"
        return {"error": f"no namespaces: {exc.strerror} (they need {needs})"}
    return {"user_namespace": not root, "network": True, "pid": True}


def _mounts() -> list:
    """(mount point, per-mount options) of every mount, from /proc/self/mountinfo."""
    out = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            point = fields[4].encode().decode("unicode_escape").encode("latin-1")  # \040 -> space
            out.append((point, fields[5].split(",")))
    return out


def closed_ancestor(path: str):
    """The first directory on ``path`` that other users cannot enter, or None."""
    current = "/"
    for part in [p for p in path.split("/") if p]:
        current = os.path.join(current, part)
        if os.path.isdir(current) and not os.stat(current).st_mode & stat.S_IXOTH:
            return current
    return None


def read_only_mounts(isolation: dict) -> None:
    """A mount namespace of our own with every mount remounted read-only (before anything is opened
    or hidden, so that descriptors and covered mounts are read-only too)."""
    call("unshare", CLONE_NEWNS)
    call("mount", None, b"/", None, MS_REC | MS_PRIVATE, None)
    failed = []
    for point, options in _mounts():
        flags = MS_REMOUNT | MS_BIND | MS_RDONLY | sum(bit for name, bit in _KEEP_FLAGS.items() if name in options)
        try:
            call("mount", None, point, None, flags, None)
        except OSError:
            failed.append(point.decode(errors="replace"))
    isolation["failed_mounts"] = failed


def reach_interpreter() -> dict:
    """``{directory: O_PATH descriptor}`` of the interpreter's prefixes and import path. Entries of
    ``sys.path`` (and of the loaded packages' ``__path__``) under a closed directory or one of
    ``HIDDEN``, which are hidden next, become ``/proc/self/fd/N/...``: the sandbox's uid imports
    through the descriptor without entering what lies above it."""
    own = {os.path.realpath(p) for p in [sys.prefix, sys.base_prefix, *sys.path] if p and os.path.exists(p)}
    tops = sorted(p for p in own if not any(p != q and p.startswith(q + "/") for q in own))
    fds = {top: os.open(top, os.O_PATH) for top in tops}
    hidden = {t for t in tops if closed_ancestor(t) or t.startswith(tuple(h + "/" for h in HIDDEN))}

    def through(path: str) -> str:
        real = os.path.realpath(path) if path else ""
        top = next((t for t in hidden if real == t or real.startswith(t + "/")), None)
        return f"/proc/self/fd/{fds[top]}{real[len(top):]}" if top else path

    sys.path[:] = [through(p) for p in sys.path]
    for module in list(sys.modules.values()):
        if isinstance(getattr(module, "__path__", None), list):  # encodings.idna, json.tool, ... import later
            module.__path__[:] = [through(p) for p in module.__path__]
    return fds


def _tmpfs(path: str, options: str, inside: str = "") -> None:
    """An empty read-only tmpfs on ``path`` (with the directory ``inside`` made in it first)."""
    call("mount", b"tmpfs", path.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, options.encode())
    if inside:
        os.makedirs(inside, 0o755, exist_ok=True)
    call("mount", None, path.encode(), None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV, options.encode())


def hide_and_mount(cfg: dict, isolation: dict, uid: int, interpreter: dict) -> None:
    """Empty read-only tmpfs over /root, /home, /tmp, /run (/var/run) and closed directories above the
    interpreter; a /dev of ``DEVICES``; a fresh /proc; an empty tmpfs of file_size_mb on the working
    directory (made again inside a hidden /tmp)."""
    workdir = cfg["workdir"]
    tops = {t for t in HIDDEN if os.path.isdir(t) and not os.path.islink(t)}
    tops |= {c for c in map(closed_ancestor, interpreter) if c}
    tops = {t for t in tops if not any(t != u and t.startswith(u + "/") for u in tops)}
    for top in sorted(tops):
        _tmpfs(top, "size=1m,mode=0755", workdir if workdir.startswith(top + "/") else "")
    isolation["hidden"] = sorted(tops)
    try:
        keep = {n: os.open(f"/dev/{n}", os.O_PATH) for n in DEVICES if os.path.exists(f"/dev/{n}")}
        call("mount", b"tmpfs", b"/dev", b"tmpfs", MS_NOSUID | MS_NOEXEC, b"size=64k,mode=0755")
        for name, fd in keep.items():
            open(f"/dev/{name}", "w").close()
            call("mount", f"/proc/self/fd/{fd}".encode(), f"/dev/{name}".encode(), None, MS_BIND, None)
            os.close(fd)
        for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"),
                             ("stdout", "/proc/self/fd/1"), ("stderr", "/proc/self/fd/2")):
            os.symlink(target, f"/dev/{name}")
        call("mount", None, b"/dev", None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NOEXEC, b"size=64k,mode=0755")
        isolation["devices"] = True
    except OSError:
        isolation["devices"] = False
    data = f"size={cfg['file_size_mb']}m,mode=0700,uid={uid},gid={uid}".encode()
    call("mount", b"tmpfs", workdir.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, data)
    isolation["workdir_tmpfs"] = True
    try:
        call("mount", b"proc", b"/proc", b"proc", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, None)
        isolation["proc"] = True
    except OSError:
        isolation["proc"] = False
    writable = [p for p in dict.fromkeys(isolation.pop("failed_mounts", [])) if _writable(p)]  # not shadowed
    isolation["read_only"] = not _writable("/") and "/" not in writable
    if writable:
        isolation["writable_mounts"] = writable


def _writable(path: str) -> bool:
    """True when the mount ``path`` resolves to is writable (False for a path that is gone)."""
    try:
        return not os.statvfs(path).f_flag & os.ST_RDONLY
    except OSError:
        return False


def drop_privileges(uid: int, root: bool, isolation: dict) -> None:
    """A uid of our own as root (so RLIMIT_NPROC applies: the kernel never enforces it on root, and
    root's files are out of reach), no capabilities in any case, and no way back (no_new_privs:
    setuid binaries gain nothing)."""
    if root and uid:
        try:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
        except OSError as exc:  # e.g. a container without CAP_SETUID
            isolation["uid_error"] = f"still root: {exc.strerror}, so no process limit (it needs CAP_SETUID)"
    if os.geteuid() == 0:  # user namespace root, or a root that could not change uid: drop capabilities

        class Header(ctypes.Structure):
            _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

        class Data(ctypes.Structure):
            _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                        ("inheritable", ctypes.c_uint32)]

        call("capset", ctypes.byref(Header(0x20080522, 0)), (Data * 2)())
    call("prctl", PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    call("prctl", PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # after setuid, which clears it
