"""The sandbox layers that need no privilege (docs/tools.md, "Threat model", layers 2 and 3): Landlock,
through the kernel's UAPI with ctypes (PyPI's ``landlock`` covers file-system rules only), and seccomp.
"""

import ctypes
import errno
import os

_CREATE, _ADD_RULE, _RESTRICT = 444, 445, 446  # the landlock syscalls' numbers on every architecture
_PATH_BENEATH = 1
EXECUTE, WRITE_FILE, READ_FILE, READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
_FILE_RIGHTS = EXECUTE | WRITE_FILE | READ_FILE | 1 << 14 | 1 << 15  # + truncate, ioctl_dev
SYSTEM = ("/usr", "/lib", "/lib64", "/lib32", "/bin", "/sbin", "/etc/ld.so.cache", "/etc/localtime",
          "/sys/devices/system/cpu")
DENIED = ("socket", "unshare", "setns", "ptrace", "process_vm_readv", "process_vm_writev", "pidfd_getfd", "keyctl",
          "add_key", "request_key", "bpf", "perf_event_open", "userfaultfd", "io_uring_setup", "io_uring_enter",
          "io_uring_register", "mount", "umount2", "pivot_root", "chroot", "move_mount", "open_tree", "fsopen",
          "fsmount", "fsconfig", "fspick", "mount_setattr", "open_by_handle_at", "name_to_handle_at",
          "init_module", "finit_module", "delete_module", "kexec_load", "kexec_file_load", "reboot", "swapon",
          "swapoff", "acct", "quotactl", "syslog", "iopl", "ioperm", "fanotify_init", "lookup_dcookie")
NAMESPACE_FLAGS = (0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000)

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64),
                ("scoped", ctypes.c_uint64)]


class _PathBeneath(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def landlock_abi() -> int:
    """The kernel's Landlock ABI version (0: none, or disabled)."""
    return max(0, _libc.syscall(_CREATE, None, ctypes.c_size_t(0), ctypes.c_uint32(1)))


def landlock(workdir: str, interpreter: dict, isolation: dict) -> None:
    """Restrict this process and its future children (records ``landlock``: the ABI, 0 when none)."""
    abi = landlock_abi()
    isolation["landlock"] = 0
    if abi < 1:
        isolation["landlock_error"] = "this kernel has no Landlock (Linux >= 5.13 with it enabled)"
        return
    fs = (1 << {1: 13, 2: 14, 3: 15, 4: 15}.get(abi, 16)) - 1  # every file-system right of this ABI
    attr = _RulesetAttr(fs, 0b11 if abi >= 4 else 0, 0b11 if abi >= 6 else 0)
    ruleset = _libc.syscall(_CREATE, ctypes.byref(attr), ctypes.c_size_t(ctypes.sizeof(attr)), ctypes.c_uint32(0))
    if ruleset < 0:
        isolation["landlock_error"] = f"landlock_create_ruleset: {os.strerror(ctypes.get_errno())}"
        return
    readable = EXECUTE | READ_FILE | READ_DIR
    rules = [(workdir, fs), ("/proc" if isolation.get("proc") else "/proc/self", READ_FILE | READ_DIR)]
    rules += [(fd, readable) for fd in interpreter.values()] + [(path, readable) for path in SYSTEM]
    rules += [(f"/dev/{name}", READ_FILE | WRITE_FILE) for name in ("null", "zero", "full", "random", "urandom")]
    try:
        for where, rights in rules:
            _allow(ruleset, where, rights & fs)
        if _libc.syscall(_RESTRICT, ruleset, ctypes.c_uint32(0)) != 0:
            raise OSError(ctypes.get_errno(), f"landlock_restrict_self: {os.strerror(ctypes.get_errno())}")
    except OSError as exc:
        isolation["landlock_error"] = str(exc)
        return
    finally:
        os.close(ruleset)
    isolation["landlock"] = abi


def _allow(ruleset: int, where, rights: int) -> None:
    """Allow ``rights`` beneath a path or an open descriptor (skipped when the path does not exist)."""
    try:
        fd = os.open(where, os.O_PATH) if isinstance(where, str) else where
    except OSError:
        return
    try:
        if not os.path.isdir(f"/proc/self/fd/{fd}"):
            rights &= _FILE_RIGHTS
        rule = _PathBeneath(rights, fd)
        if _libc.syscall(_ADD_RULE, ruleset, _PATH_BENEATH, ctypes.byref(rule), ctypes.c_uint32(0)) != 0:
            raise OSError(ctypes.get_errno(), f"landlock_add_rule {where}: {os.strerror(ctypes.get_errno())}")
    finally:
        if isinstance(where, str):
            os.close(fd)


def seccomp_filter(isolation: dict):
    """The filter, built now (pyseccomp finds libseccomp.so.2 with a subprocess: not possible once the
    limits are set) and loaded last by ``.load()``; None, with ``seccomp_error``, when unavailable."""
    import ctypes.util

    search = ctypes.util.find_library  # it runs ldconfig twice (~40 ms a start): the sonames are known
    ctypes.util.find_library = lambda name: {"c": "libc.so.6", "seccomp": "libseccomp.so.2"}.get(name) or search(name)
    try:
        import pyseccomp as seccomp
    except (ImportError, RuntimeError, OSError) as exc:  # not installed, or no libseccomp.so.2
        isolation["seccomp_error"] = f"pyseccomp: {exc} (pip install pyseccomp; apt-get install libseccomp2)"
        return None
    finally:
        ctypes.util.find_library = search
    rules = seccomp.SyscallFilter(seccomp.ALLOW)
    for name in DENIED:
        try:
            rules.add_rule(seccomp.ERRNO(errno.EPERM), name)
        except (ValueError, OSError):  # not a system call of this architecture
            pass
    for flag in NAMESPACE_FLAGS:
        rules.add_rule(seccomp.ERRNO(errno.EPERM), "clone", seccomp.Arg(0, seccomp.MASKED_EQ, flag, flag))
    rules.add_rule(seccomp.ERRNO(errno.ENOSYS), "clone3")
    return rules
