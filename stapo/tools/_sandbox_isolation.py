"""Isolation of the python tool's sandbox (run inside ``_sandbox_child.py``; standard library only).

``unshare`` puts the launcher in new PID and network namespaces (through a user namespace when it
is not root); ``isolate_files`` gives the worker a mount namespace of its own with a read-only
view of every mount, home directories hidden, a /dev of five harmless devices, an empty
size-capped tmpfs as its working directory and a /proc of its own; ``drop_privileges`` leaves it
a uid of its own (or root of its user namespace) without capabilities. docs/tools.md, "Threat
model", says what each one stops.
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
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS = 1, 38

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
    not allowed). The mount namespace is the worker's alone (``isolate_files``): the launcher keeps
    the trainer's view of the file system, to remove the working directory if it is orphaned."""
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
        return {"error": str(exc)}
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


def hide_homes(isolation: dict) -> None:
    """Empty read-only tmpfs over /root and /home (keys, tokens, caches stay out of reach) and over
    any closed directory the interpreter lives under; then the interpreter's own directories
    (prefixes and import path) bound back at their paths, so the sandbox's uid can import them."""
    own = {os.path.realpath(p) for p in [sys.prefix, sys.base_prefix, *sys.path] if p and os.path.exists(p)}
    own = sorted(p for p in own if not any(p != q and p.startswith(q + "/") for q in own))
    tops = {t for t in ("/root", "/home") if os.path.isdir(t)}
    tops |= {c for c in map(closed_ancestor, own) if c}
    tops = {t for t in tops if not any(t != u and t.startswith(u + "/") for u in tops)}
    keep = {p: os.open(p, os.O_PATH) for p in own if any(p.startswith(t + "/") for t in tops)}
    for top in sorted(tops):
        call("mount", b"tmpfs", top.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, b"size=1m,mode=0755")
    for path, fd in keep.items():
        os.makedirs(path if os.path.isdir(f"/proc/self/fd/{fd}") else os.path.dirname(path), 0o755, exist_ok=True)
        if not os.path.isdir(f"/proc/self/fd/{fd}"):
            open(path, "a").close()  # a zip on the import path: a file to bind onto
        call("mount", f"/proc/self/fd/{fd}".encode(), path.encode(), None, MS_BIND | MS_REC, None)
        os.close(fd)
    isolation["hidden"] = sorted(tops)


def minimal_dev() -> None:
    """A /dev with null, zero, full, random and urandom only: no GPUs, disks or terminals."""
    keep = {n: os.open(f"/dev/{n}", os.O_PATH) for n in ("null", "zero", "full", "random", "urandom")
            if os.path.exists(f"/dev/{n}")}
    call("mount", b"tmpfs", b"/dev", b"tmpfs", MS_NOSUID | MS_NOEXEC, b"size=64k,mode=0755")
    for name, fd in keep.items():
        open(f"/dev/{name}", "w").close()
        call("mount", f"/proc/self/fd/{fd}".encode(), f"/dev/{name}".encode(), None, MS_BIND, None)
        os.close(fd)
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                         ("stderr", "/proc/self/fd/2")):
        os.symlink(target, f"/dev/{name}")


def isolate_files(cfg: dict, isolation: dict, uid: int) -> None:
    """Home directories hidden; a minimal /dev; everything read-only; an empty tmpfs of
    file_size_mb on the working directory; a fresh /proc that shows the namespace's processes only."""
    call("unshare", CLONE_NEWNS)
    call("mount", None, b"/", None, MS_REC | MS_PRIVATE, None)
    hide_homes(isolation)
    try:
        minimal_dev()
        isolation["devices"] = True
    except OSError:
        isolation["devices"] = False
    failed = []
    for point, options in _mounts():
        flags = MS_REMOUNT | MS_BIND | MS_RDONLY
        flags |= sum(bit for name, bit in _KEEP_FLAGS.items() if name in options)
        try:
            call("mount", None, point, None, flags, None)
        except OSError:
            failed.append(point.decode(errors="replace"))
    workdir = cfg["workdir"].encode()
    data = f"size={cfg['file_size_mb']}m,mode=0700,uid={uid},gid={uid}".encode()
    call("mount", b"tmpfs", workdir, b"tmpfs", MS_NOSUID | MS_NODEV, data)
    isolation["workdir_tmpfs"] = True
    try:
        call("mount", b"proc", b"/proc", b"proc", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, None)
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


def drop_privileges(uid: int, root: bool) -> None:
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

        call("capset", ctypes.byref(Header(0x20080522, 0)), (Data * 2)())
    call("prctl", PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    call("prctl", PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # after setuid, which clears it
