"""The python tool's sandbox against hostile code: every case ends in an error result within its limit,
the trainer (this process) unharmed, the real file system and network untouched, no process left behind.

Limits here are small (2 s wall, 1 s CPU, 256 MB, 8 processes, 2 MB files, 200 characters) so the
suite stays fast; ``--durations=0`` shows each case's time (docs/tools.md, "As tested").
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
import uuid

import pytest

from stapo.tools import ToolCall, build_tool, run_tool_calls
from stapo.tools.sandbox import _UID_BASE, _UID_SLOTS, Sandbox, isolation_summary

LIMITS = dict(timeout_s=2.0, cpu_time_s=1.0, memory_mb=256, max_processes=8, file_size_mb=2, max_output_chars=200)
SECRET = f"stapo-secret-{uuid.uuid4().hex}"


@pytest.fixture(scope="module")
def python():
    return build_tool("python", **LIMITS)


@pytest.fixture(scope="module")
def isolation(python):
    with Sandbox(python.limits) as sandbox:
        sandbox.start()
        return sandbox.isolation


def needs(isolation: dict, *keys: str) -> None:
    if not all(isolation.get(k) for k in keys):
        pytest.skip(f"this system gives the sandbox no {', '.join(keys)}: {isolation_summary(isolation)}")


def sandbox_processes(owner: int | None = None) -> list[int]:
    """Live processes running as one of the sandbox uids of ``owner`` (default: this process)."""
    low = _UID_BASE + ((owner or os.getpid()) % (1 << 22)) * _UID_SLOTS
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/status") as f:
                uid = int(next(line for line in f if line.startswith("Uid:")).split()[1])
        except (OSError, StopIteration, ValueError):
            continue
        if low <= uid < low + _UID_SLOTS and not _zombie(pid):
            found.append(int(pid))
    return found


def _zombie(pid) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def assert_nothing_left() -> None:
    if os.geteuid() != 0:
        return  # without a uid of its own the sandbox's processes cannot be told from ours
    deadline = time.monotonic() + 2.0
    while sandbox_processes() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sandbox_processes() == []


# A case that ends in an error of its own does so before the wall clock (timeout_s) could end it: that limit, not a
# guess at how fast a sandbox starts on a busy machine (~0.2-0.35 s with a load of 13 on 2 cores, where 1.0 s
# bounds stood), is what tells the two apart; a case the wall clock ends gets 1.5 s to be killed and reported.
OWN_ERROR_S = LIMITS["timeout_s"]
# (name, code, what the error says (alternatives split by |), seconds it may take): each ends in an error
HOSTILE = [
    ("sleeps past the wall clock", "import time\ntime.sleep(60)", "timed out after 2 s", 3.5),
    ("loops forever", "while True:\n    pass", "CPU time limit of 1 s|timed out after 2 s", 3.5),  # whichever first
    ("fork bomb", "import os\nwhile True:\n    os.fork()", "BlockingIOError", OWN_ERROR_S),
    ("thread bomb", "import threading, time\nwhile True:\n    threading.Thread(target=time.sleep, args=(60,)).start()",
     "can't start new thread", OWN_ERROR_S),
    ("allocates 1 GB", "x = bytearray(1024 * 2**20)", "MemoryError", OWN_ERROR_S),
    ("builds a huge list", "x = [0] * 10**9", "MemoryError", OWN_ERROR_S),
    ("recurses forever", "def f():\n    return f()\nf()", "RecursionError", OWN_ERROR_S),
    ("prints 5 MB", "print('x' * 5_000_000)", "[output cut: 5000001 characters, the limit is 200; the middle",
     OWN_ERROR_S),
    ("floods its output fd", "import os\nwhile True:\n    os.write(1, b'x' * 65536)", "printed more than 1048576 bytes",
     OWN_ERROR_S),
    ("writes a 3 MB file", "open('big', 'wb').write(b'x' * 3 * 2**20)", "File too large", OWN_ERROR_S),
    ("reads an env secret", "import os\nprint(os.environ['STAPO_TEST_SECRET'])", "KeyError: 'STAPO_TEST_SECRET'",
     OWN_ERROR_S),
    ("exits non-zero", "import sys\nsys.exit(3)", "", OWN_ERROR_S),
    ("crashes the interpreter", "import ctypes\nctypes.string_at(0)", "killed by SIGSEGV", OWN_ERROR_S),
]


@pytest.mark.parametrize("name, code, message, seconds", HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_code_ends_in_an_error_within_its_limit(python, monkeypatch, name, code, message, seconds):
    monkeypatch.setenv("STAPO_TEST_SECRET", SECRET)
    start = time.monotonic()
    result = python({"code": code})
    elapsed = time.monotonic() - start
    assert result.error, result
    assert any(m in result.text for m in message.split("|")), result.text
    assert len(result.text) <= LIMITS["max_output_chars"] + 80
    assert SECRET not in result.text
    assert elapsed < seconds, f"{name}: {elapsed:.2f} s"
    assert_nothing_left()


def test_cpu_time_limit():
    """1 CPU second under a 10 s wall clock: the CPU limit ends it (on a busy machine a CPU second can
    take longer than one second of wall time, hence no tighter bound on the elapsed time)."""
    start = time.monotonic()
    result = build_tool("python", **{**LIMITS, "timeout_s": 10.0})({"code": "while True:\n    pass"})
    assert result.error and "CPUTimeLimitExceeded: the cell used more than its CPU time limit of 1 s" in result.text
    assert time.monotonic() - start < 8.0
    assert_nothing_left()


def test_no_writes_outside_the_working_directory(python, isolation):
    needs(isolation, "read_only")
    name = f"stapo-escape-{uuid.uuid4().hex}"
    targets = [f"/tmp/{name}", f"../{name}", f"/var/tmp/{name}", f"/dev/shm/{name}", f"{os.getcwd()}/{name}"]
    for target in targets:  # /dev/shm does not exist in the sandbox's /dev
        result = python({"code": f"open({target!r}, 'w').write('x')"})
        assert result.error and ("Read-only file system" in result.text or "No such file" in result.text), result
    ok = python({"code": "open('inside.txt', 'w').write('fine'); import os; os.listdir('.')"})
    assert (ok.text, ok.error) == ("['inside.txt']\n", False)  # an empty directory of its own, writable
    for where in ("/tmp", "/var/tmp", "/dev/shm", tempfile.gettempdir(), os.getcwd()):
        assert not os.path.exists(os.path.join(where, name)), where  # the real file system, afterwards
    assert not [d for d in os.listdir(tempfile.gettempdir()) if d.startswith("stapo-sandbox-")]


def test_no_network(python, isolation):
    needs(isolation, "network")
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        code = f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)"
        result = python({"code": code})
        assert result.error and "Network is unreachable" in result.text, result.text
        listener.settimeout(0.3)
        with pytest.raises(socket.timeout):
            listener.accept()  # nothing came through
    assert python({"code": "import socket\n[n for _, n in socket.if_nameindex()]"}).text == "['lo']\n"


def test_cannot_see_or_signal_the_trainer(python, isolation, monkeypatch):
    needs(isolation, "pid")
    monkeypatch.setenv("STAPO_TEST_SECRET", SECRET)
    me = os.getpid()
    for code in (f"import os\nos.kill({me}, 9)", f"open('/proc/{me}/environ').read()"):
        result = python({"code": code})
        assert result.error and SECRET not in result.text, (code, result.text)
    assert python({"code": "import os\nos.killpg(0, 9)\nprint('still here')"}).text == "still here\n"
    assert python({"code": "import os\nsorted(int(p) for p in os.listdir('/proc') if p.isdigit())"}).text == "[1]\n"
    assert python({"code": "import os\nos.listdir('/home')"}).text == "[]\n"  # home directories hidden
    caps = "next(line.split()[1] for line in open('/proc/self/status') if line.startswith('CapEff'))"
    assert python({"code": caps}).text == "'0000000000000000'\n"  # no capabilities
    if isolation.get("devices"):  # no GPU, disk or terminal devices
        assert python({"code": "import os\nsorted(os.listdir('/dev'))"}).text == \
            "['fd', 'full', 'null', 'random', 'stderr', 'stdin', 'stdout', 'urandom', 'zero']\n"


def test_background_processes_do_not_outlive_the_call(python):
    code = "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\nprint('parent done')"
    result = python({"code": code})
    assert (result.text, result.error) == ("parent done\n", False)
    assert_nothing_left()


def test_the_sandbox_dies_with_a_killed_trainer():
    trainer = subprocess.Popen([sys.executable, "-c", TRAINER], stdout=subprocess.PIPE, text=True)
    launcher, workdir = trainer.stdout.readline().split()
    launcher = int(launcher)
    time.sleep(0.3)  # its cell is sleeping now
    trainer.kill()  # SIGKILL: no finalizer, no close()
    trainer.wait()
    deadline = time.monotonic() + 3.0
    while not _zombie(launcher) or (os.geteuid() == 0 and sandbox_processes(trainer.pid)):
        assert time.monotonic() < deadline, "the sandbox outlived its trainer"
        time.sleep(0.05)
    while os.path.exists(workdir):  # the orphaned launcher removes it on its way out
        assert time.monotonic() < deadline, f"{workdir} outlived its trainer"
        time.sleep(0.05)


TRAINER = """
from stapo.tools.sandbox import Sandbox, SandboxLimits
box = Sandbox(SandboxLimits(timeout_s=60), stateful=True)
box.start()
print(box._proc.pid, box._workdir, flush=True)
box.run("import time\\ntime.sleep(60)")
"""


def test_stateful_sessions_keep_state_and_are_isolated(isolation):
    tool = build_tool("python", stateful=True, **LIMITS)
    assert "persist" in tool.schema()["function"]["description"]
    with tool.open_session() as one, tool.open_session() as two:
        assert tool({"code": "a = 40\nopen('note', 'w').write('one')"}, one).error is False
        assert tool({"code": "a = 'two'"}, two).error is False
        assert tool({"code": "a += 2\na"}, one).text == "42\n"
        assert tool({"code": "1/0"}, one).error  # an exception does not end the session
        assert tool({"code": "a, open('note').read()"}, one).text == "(42, 'one')\n"
        assert tool({"code": "a, __import__('os').listdir('.')"}, two).text == "('two', [])\n"
        if isolation.get("pid"):
            assert tool({"code": "import subprocess\np = subprocess.Popen(['sleep', '60'])"}, one).error is False
            assert tool({"code": "p.wait(timeout=10)"}, one).text == "-9\n"  # killed when its cell ended
        slow = tool({"code": "import time\ntime.sleep(60)"}, one)
        assert slow.error and "timed out after 2 s" in slow.text and "the next call starts a new one" in slow.text
        assert "NameError" in tool({"code": "a"}, one).text  # a new interpreter
        assert tool({"code": "a"}, two).text == "'two'\n"  # the other session never noticed
        pid = two.sandbox._proc.pid
    assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/status").read().find("State:\tZ") >= 0
    assert_nothing_left()


def test_concurrent_calls_through_run_tool_calls(python):
    jobs = [(python, ToolCall("python", {"code": f"import time\ntime.sleep(0.4)\nprint({i} * {i})"}, ""), None)
            for i in range(4)]
    start = time.monotonic()
    results = run_tool_calls(jobs, max_workers=4)
    elapsed = time.monotonic() - start
    assert [r.text for r in results] == ["0\n", "1\n", "4\n", "9\n"]
    # not one by one, which takes at least the sum of the calls' own wall times, sandbox starts included (a
    # fixed 1.5 s against 4 x 0.4 s of sleeps left a busy machine 0.1 s for four sandbox starts)
    assert elapsed < sum(r.seconds for r in results), (elapsed, [r.seconds for r in results])


def test_isolation_required_and_bad_parameters():
    with pytest.raises(ValueError, match="backend must be one of"):
        build_tool("python", backend="docker")
    with pytest.raises(ValueError, match="isolation must be one of"):
        build_tool("python", isolation="strict")
    with pytest.raises(ValueError, match="keeps no state"):
        build_tool("python", backend="sandbox_fusion", url="http://x", stateful=True)
    with pytest.raises(ValueError, match="memory_mb must be > 0"):
        build_tool("python", memory_mb=0)
    off = build_tool("python", isolation="off", **LIMITS)
    with Sandbox(off.limits) as sandbox:
        sandbox.start()
        assert not sandbox.isolation.get("network")
    assert off({"code": "print(1)"}).text == "1\n"  # limits only, still a fresh process
