"""The python sandbox's security suite, run as a trainer in one mode (tests/tools/test_sandbox_security.py
starts it; docs/tools.md, "Threat model", has its table):

    python tests/tools/sandbox_attacks.py '{"mode": "root", "isolation": "auto", "secret": "..."}'

``mode``: "root" (as started), "user" (an unused uid, in a mount namespace of its own where the
interpreter and this checkout stay reachable) or "user-nouserns" (the same, with user namespaces
denied by a seccomp filter, as Docker's default profile does); root without CAP_SYS_ADMIN is "root"
started under ``setpriv --bounding-set=-sys_admin``. Each attack prints one JSON line: its name,
whether the sandbox held, the seconds it took and the last line the policy was told.
"""

from __future__ import annotations

import ctypes
import json
import os
import platform
import resource
import select
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LIMITS = dict(timeout_s=2.0, cpu_time_s=1.0, memory_mb=256, max_processes=8, file_size_mb=2, max_output_chars=200)
SYSCALLS = {"x86_64": {"keyctl": 250, "io_uring_setup": 425}, "aarch64": {"keyctl": 219, "io_uring_setup": 425}}
_libc = ctypes.CDLL(None, use_errno=True)


def _ok(result: int, what: str) -> None:
    if result != 0:
        raise OSError(ctypes.get_errno(), f"{what}: {os.strerror(ctypes.get_errno())}")


def _closed(path: str):
    """The first directory on ``path`` that other users cannot enter, or None."""
    current = "/"
    for part in [p for p in path.split("/") if p]:
        current = os.path.join(current, part)
        if os.path.isdir(current) and not os.stat(current).st_mode & 0o001:
            return current
    return None


def become_user(uid: int, deny_user_namespaces: bool) -> None:
    """As root: a mount namespace where closed directories above the interpreter and this checkout
    are empty tmpfs with those directories bound back, then uid ``uid`` with no capabilities."""
    _ok(_libc.unshare(0x00020000), "unshare(CLONE_NEWNS)")
    _ok(_libc.mount(None, b"/", None, 0x4000 | 0x40000, None), "mount(MS_REC|MS_PRIVATE)")
    needed = {os.path.realpath(p) for p in [sys.prefix, sys.base_prefix, *sys.path, str(ROOT)]
              if p and os.path.exists(p)}
    closed = {c for c in map(_closed, needed) if c}
    if closed & needed:
        raise SystemExit(f"skip: {sorted(closed & needed)} is closed to other users")
    keep = {p: os.open(p, os.O_PATH) for p in needed if any(p.startswith(c + "/") for c in closed)}
    for top in sorted(closed):
        _ok(_libc.mount(b"tmpfs", top.encode(), b"tmpfs", 0, b"mode=0755"), f"mount tmpfs {top}")
    for path, fd in keep.items():
        is_dir = os.path.isdir(f"/proc/self/fd/{fd}")
        os.makedirs(path if is_dir else os.path.dirname(path), exist_ok=True)
        if not is_dir:
            open(path, "a").close()
        _ok(_libc.mount(f"/proc/self/fd/{fd}".encode(), path.encode(), None, 0x1000 | 0x4000, None), f"bind {path}")
    os.chdir("/")
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
    if deny_user_namespaces:  # Docker's default seccomp profile: no unshare/clone of a user namespace
        import pyseccomp as seccomp

        rules = seccomp.SyscallFilter(seccomp.ALLOW)
        for name in ("unshare", "clone"):
            rules.add_rule(seccomp.ERRNO(1), name, seccomp.Arg(0, seccomp.MASKED_EQ, 0x10000000, 0x10000000))
        rules.add_rule(seccomp.ERRNO(38), "clone3")
        rules.load()


# ---- what is left behind ------------------------------------------------------------------------

def leftovers() -> list[int]:
    """Live processes that can only be the sandbox's: of its uid range (as root) or of this uid."""
    from stapo.tools.sandbox import _UID_BASE, _UID_SLOTS

    low = _UID_BASE + (os.getpid() % (1 << 22)) * _UID_SLOTS
    mine = (lambda uid: low <= uid < low + _UID_SLOTS) if os.getuid() == 0 else (lambda uid: uid == os.getuid())
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        fields = dict(line.split(":\t", 1) for line in status.splitlines() if ":\t" in line)
        if int(pid) != os.getpid() and mine(int(fields["Uid"].split()[0])) and not fields["State"].startswith("Z"):
            found.append(int(pid))
    return found


def _pending(sock: socket.socket) -> bool:
    """True when a connection or datagram reached ``sock`` (taken, so that the next attack starts clean)."""
    if not select.select([sock], [], [], 0.2)[0]:
        return False
    if sock.type == socket.SOCK_DGRAM:
        sock.recv(64)
    else:
        sock.accept()[0].close()
    return True


def _usable(result) -> bool:
    """False when the cell could not import what it needed (the tool unusable, not the attack stopped)."""
    return "ModuleNotFoundError" not in result.text


def _last(result) -> str:
    lines = result.text.strip().splitlines()
    return lines[-1] if lines else "(no output)"


def _framings(messages: list) -> list:
    """Each message as a JSON line (today's protocol) and length-prefixed."""
    return [m + b"\n" for m in messages] + [struct.pack(">I", len(m)) + m for m in messages]


def _fds(data_list: str) -> str:
    """Code that writes each of ``data_list`` to every descriptor but the output's (3..31)."""
    return (f"import os\nfor fd in range(3, 32):\n    for data in {data_list}:\n        try:\n"
            "            os.write(fd, data)\n        except OSError:\n            pass\n")


# ---- the attacks ----------------------------------------------------------------------------------

class Attacks:
    def __init__(self, cfg: dict, work: Path):
        from stapo.tools import build_tool

        self.cfg, self.work, self.secret = cfg, work, cfg["secret"]
        self.tool = build_tool("python", isolation=cfg["isolation"], **LIMITS)
        self.session_tool = build_tool("python", isolation=cfg["isolation"], stateful=True, **LIMITS)
        self.tcp = socket.create_server(("127.0.0.1", 0))
        self.udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.udp.bind(("127.0.0.1", 0))
        self.unix_open = socket.socket(socket.AF_UNIX)
        self.unix_open.bind(str(work / "open.sock"))
        os.chmod(work / "open.sock", 0o777)
        self.unix_open.listen()
        self.unix_private = socket.socket(socket.AF_UNIX)
        self.unix_private.bind(str(work / "private.sock"))
        os.chmod(work / "private.sock", 0o600)
        self.unix_private.listen()
        self.abstract = f"\0stapo-attack-{os.getpid()}"
        self.unix_abstract = socket.socket(socket.AF_UNIX)
        self.unix_abstract.bind(self.abstract)
        self.unix_abstract.listen()
        (work / "secret.txt").write_text(self.secret)
        os.chmod(work / "secret.txt", 0o644)
        self.network_blocked = None

    def daemon(self):
        """A double-forked, setsid daemon that ignores SIGTERM, then (after the call) connects out and
        writes /dev/shm and /tmp."""
        marks = [f"/dev/shm/stapo-attack-{os.getpid()}", f"/tmp/stapo-attack-{os.getpid()}"]
        code = (f"import os, signal, socket, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
                f"        signal.signal(signal.SIGTERM, signal.SIG_IGN)\n        time.sleep(0.5)\n"
                f"        for path in {marks!r}:\n            try:\n                open(path, 'w').close()\n"
                f"            except OSError:\n                pass\n        try:\n"
                f"            socket.create_connection(('127.0.0.1', {self.tcp.getsockname()[1]}), timeout=1)\n"
                f"        except OSError:\n            pass\n        time.sleep(30)\n    os._exit(0)\nprint('started')")
        result = self.tool({"code": code})
        time.sleep(1.0)
        left, connected = leftovers(), _pending(self.tcp)
        written = [m for m in marks if os.path.exists(m)]
        for mark in written:
            os.unlink(mark)
        held = result.text == "started\n" and not left and not connected and not written
        return held, _last(result) + ("" if held else f" | alive: {left}, connected: {connected}, wrote: {written}")

    def reply_flood(self):
        """Megabytes without a newline into every descriptor: the trainer must not pay for parsing them."""
        code = ("import os\nchunk = b'x' * 65536\nwhile True:\n    for fd in range(3, 32):\n        try:\n"
                "            os.write(fd, chunk)\n        except OSError:\n            pass")
        before = resource.getrusage(resource.RUSAGE_SELF)
        result = self.tool({"code": code})
        after = resource.getrusage(resource.RUSAGE_SELF)
        cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
        return result.error and cpu < 0.25, f"{_last(result)} | trainer CPU {cpu:.2f} s"

    def forged_reply(self):
        """A stateful cell writes replies of its own (today's JSON line and a length-prefixed one)."""
        forged = [json.dumps({"k": k, "error": False, "cut": 0, "tail": ""}).encode() for k in range(3)]
        code = _fds(repr(_framings(forged))) + "import time\ntime.sleep(0.3)\nprint('first')"
        with self.session_tool.open_session() as session:
            self.session_tool({"code": code}, session)
            second = self.session_tool({"code": "print('second')"}, session)
            third = self.session_tool({"code": "print('third')"}, session)
        ok_second = second.text == "second\n" or (second.error and "the next call starts a new one" in second.text)
        return ok_second and third.text == "third\n", f"second: {second.text!r}, third: {third.text!r}"

    def nan_reply(self):
        """``{"cut": NaN}`` on every descriptor: ``Sandbox.run`` must return, not raise."""
        from stapo.tools.sandbox import Sandbox

        code = _fds(repr(_framings([b'{"cut": NaN}'])))
        with Sandbox(self.tool.limits, stateful=True) as box:
            try:
                result = box.run(code)
            except Exception as exc:  # noqa: BLE001 - what today's code does
                return False, f"Sandbox.run raised {exc!r}"
        return True, result.ended or _last(result)

    def threads_between_cells(self):
        """A thread that ignores SIGXCPU, lifts its soft CPU limit to the hard one and spins between cells."""
        cell = ("import resource, signal, threading\nsignal.signal(signal.SIGXCPU, signal.SIG_IGN)\n"
                "hard = resource.getrlimit(resource.RLIMIT_CPU)[1]\n"
                "resource.setrlimit(resource.RLIMIT_CPU, (hard, hard))\n"
                "def spin():\n    while True:\n        pass\nthreading.Thread(target=spin, daemon=True).start()\n")
        used = "u = __import__('resource').getrusage(0)\nprint(u.ru_utime + u.ru_stime{})"
        with self.session_tool.open_session() as session:
            first = self.session_tool({"code": cell + used.format(", hard")}, session)
            time.sleep(1.0)
            second = self.session_tool({"code": used.format("")}, session)
        try:
            cpu1, hard = first.text.split()
            spent = float(second.text) - float(cpu1)
        except ValueError:
            return False, f"{first.text!r} {second.text!r}"
        return spent < 0.2 and int(hard) >= 0, f"{spent:.2f} CPU-s in 1 s between cells; hard limit {hard}"

    def path_unix_socket(self):
        paths = [str(self.work / "open.sock"), str(self.work / "private.sock")]
        result = self.tool({"code": self._connect_unix(paths)})
        reached = [p for p, s in zip(paths, (self.unix_open, self.unix_private)) if _pending(s)]
        return not reached and _usable(result), f"{_last(result)}" + (f" | reached {reached}" if reached else "")

    def abstract_unix_socket(self):
        result = self.tool({"code": self._connect_unix([self.abstract])})
        return not _pending(self.unix_abstract) and _usable(result), _last(result)

    @staticmethod
    def _connect_unix(addresses: list) -> str:
        return (f"import socket\nfor address in {addresses!r}:\n    s = socket.socket(socket.AF_UNIX)\n"
                "    s.settimeout(1)\n    s.connect(address)\n    print('connected', address)")

    def network(self):
        tcp, udp = self.tcp.getsockname()[1], self.udp.getsockname()[1]
        code = (f"import socket\nu = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
                f"u.sendto(b'x', ('127.0.0.1', {udp}))\n"
                f"socket.create_connection(('127.0.0.1', {tcp}), timeout=1)")
        result = self.tool({"code": code})
        reached = [name for name, s in (("tcp", self.tcp), ("udp", self.udp)) if _pending(s)]
        self.network_blocked = not reached if _usable(result) else None  # None: the tool could not even try
        return not reached and _usable(result), _last(result) + (f" | reached {reached}" if reached else "")

    def description(self):
        """The tool description the policy reads says "No network" exactly when there is none."""
        text = self.tool.schema()["function"]["description"]
        claims = "No network" in text
        sentence = next((s.strip() for s in text.split(".") if "etwork" in s), text)
        return claims == self.network_blocked, f"{sentence}. (network blocked: {self.network_blocked})"

    def syscalls(self):
        """Nested user namespaces, ptrace, keyctl, io_uring."""
        numbers = SYSCALLS.get(platform.machine(), SYSCALLS["x86_64"])
        code = ("import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\nallowed = []\n"
                "if libc.unshare(0x10000000 | 0x40000000) == 0:\n    allowed.append('unshare(user, net)')\n"
                f"if libc.syscall({numbers['keyctl']}, 0, -3, 1) >= 0:\n    allowed.append('keyctl')\n"
                f"if libc.syscall({numbers['io_uring_setup']}, 1, ctypes.create_string_buffer(120)) >= 0:\n"
                "    allowed.append('io_uring_setup')\npid = os.fork()\nif pid == 0:\n"
                "    os._exit(0 if libc.ptrace(0, 0, 0, 0) == 0 else 1)\n"
                "if os.waitpid(pid, 0)[1] == 0:\n    allowed.append('ptrace')\nprint(allowed)")
        result = self.tool({"code": code})
        return result.text.strip() == "[]", _last(result)

    def signals(self):
        code = (f"import os\nreached = []\nfor pid in ({os.getpid()}, os.getppid()):\n    if pid > 1:\n"
                "        try:\n            os.kill(pid, 0)\n            reached.append(pid)\n"
                "        except OSError as exc:\n            print(exc)\nprint('reached', reached)")
        result = self.tool({"code": code})
        return result.text.strip().endswith("reached []"), _last(result)

    def writes_outside(self):
        marks = [f"/tmp/stapo-attack-w-{os.getpid()}", f"/var/tmp/stapo-attack-w-{os.getpid()}",
                 f"/dev/shm/stapo-attack-w-{os.getpid()}", str(self.work / "written")]
        code = (f"for path in {marks!r}:\n    try:\n        open(path, 'w').write('x')\n        print('wrote', path)\n"
                "    except OSError as exc:\n        print(exc)")
        result = self.tool({"code": code})
        written = [m for m in marks if os.path.exists(m)]
        for mark in written:
            os.unlink(mark)
        return not written, _last(result) + (f" | wrote {written}" if written else "")

    def reads_files(self):
        result = self.tool({"code": f"print(open({str(self.work / 'secret.txt')!r}).read())"})
        return self.secret not in result.text, _last(result)

    def reads_trainer_cmdline(self):
        code = f"print(open('/proc/{os.getpid()}/cmdline').read())"
        result = self.tool({"code": code})
        return self.secret not in result.text, _last(result).replace(self.secret, "<secret>")

    def venv_in_closed_home(self):
        """The trainer's interpreter is a venv with a package of its own, in a 0700 home and in an open
        directory under /tmp (which a mount namespace hides): both import."""
        told = []
        for mode in (0o700, 0o755):
            home = Path(tempfile.mkdtemp(prefix="stapo-home-"))
            try:
                home.chmod(mode)
                told.append(self._venv_imports(home))
            finally:
                shutil.rmtree(home, ignore_errors=True)
        return told == [repr("42\n")] * 2, " / ".join(t[-120:] for t in told)

    def _venv_imports(self, home: Path) -> str:
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(home / "venv")], check=True,
                       capture_output=True, timeout=60)
        site = next((home / "venv" / "lib").glob("python3*/site-packages"))
        (site / "stapo_probe").mkdir()
        (site / "stapo_probe" / "__init__.py").write_text("VALUE = 42\n")
        try:
            import pyseccomp

            shutil.copy(pyseccomp.__file__, site)
        except ImportError:
            pass
        script = (f"from stapo.tools import build_tool\n"
                  f"tool = build_tool('python', isolation={self.cfg['isolation']!r})\n"
                  "r = tool({'code': 'import socket, stapo_probe\\nprint(stapo_probe.VALUE)'})\n"
                  "print(repr(r.text))")
        proc = subprocess.run([str(home / "venv" / "bin" / "python"), "-c", script], capture_output=True, text=True,
                              timeout=60, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)})
        return ((proc.stdout.strip() or proc.stderr.strip()).splitlines() or ["(nothing)"])[-1]

    def required(self):
        """Not an attack: whether isolation='required' runs here, or what it says."""
        from stapo.tools import build_tool

        try:
            result = build_tool("python", isolation="required", **LIMITS)({"code": "print(1)"})
        except ValueError as exc:  # refused at start
            return True, str(exc)
        return True, "runs" if result.text == "1\n" else _last(result)


ORDER = ["network", "description", "daemon", "reply_flood", "forged_reply", "nan_reply", "threads_between_cells",
         "path_unix_socket", "abstract_unix_socket", "syscalls", "signals", "writes_outside", "reads_files",
         "reads_trainer_cmdline", "venv_in_closed_home", "required"]


def main() -> None:
    cfg = json.loads(sys.argv[1])
    if cfg["mode"] != "root":
        become_user(cfg["uid"], deny_user_namespaces=cfg["mode"] == "user-nouserns")
    sys.path.insert(0, str(ROOT))
    from stapo.tools import build_tool
    from stapo.tools.python_tool import isolation_summary
    from stapo.tools.sandbox import Sandbox

    with Sandbox(build_tool("python", isolation=cfg["isolation"], **LIMITS).limits) as box:
        box.start()
        print(json.dumps({"isolation": isolation_summary(box.isolation), "uid": os.getuid()}), flush=True)
    work = Path(tempfile.mkdtemp(prefix="stapo-attack-"))
    work.chmod(0o755)
    try:
        attacks = Attacks(cfg, work)
        for name in cfg.get("only") or ORDER:
            start = time.monotonic()
            try:
                held, told = getattr(attacks, name)()
            except Exception as exc:  # noqa: BLE001 - reported as a failure of that attack
                held, told = False, f"harness error: {exc!r}"
            print(json.dumps({"attack": name, "held": bool(held), "seconds": round(time.monotonic() - start, 2),
                              "told": told[-300:]}), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
