"""The sandbox started by a trainer that is not root: it enters its namespaces through a user
namespace (where the kernel allows unprivileged ones) and holds the same lines — no writes outside
its directory, no network, a process limit. Run as uid 65534 from this (root) test process."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TOOLS = ROOT / "stapo" / "tools"
NOBODY = 65534

# as root, in a mount namespace of its own: hide /root and /home, bind the interpreter back (the
# sandbox's own hide_homes), become uid 65534, run the check
HARNESS = """
import os, sys
sys.path.insert(0, {tools!r})
import _sandbox_isolation as isolate
isolate.call("unshare", isolate.CLONE_NEWNS)
isolate.call("mount", None, b"/", None, isolate.MS_REC | isolate.MS_PRIVATE, None)
isolate.hide_homes({{}})
os.setgroups([]); os.setgid({uid}); os.setuid({uid})
os.execve(sys.executable, [sys.executable, "-I", {check!r}], {{"PATH": "/usr/bin:/bin", "HOME": "/tmp"}})
"""

CHECK = """
import json, os, sys
sys.path.insert(0, {root!r})
from stapo.tools import build_tool
from stapo.tools.sandbox import Sandbox
python = build_tool("python", timeout_s=5, cpu_time_s=2, memory_mb=256, max_processes=8, max_output_chars=300)
with Sandbox(python.limits) as sandbox:
    sandbox.start()
    isolation = sandbox.isolation
cases = {{"write": "open('/tmp/{name}', 'w')",
          "network": "import socket\\nsocket.create_connection(('127.0.0.1', 9), timeout=1)",
          "fork": "import os\\nwhile True:\\n    os.fork()", "ok": "import os\\nprint(os.getuid(), os.getpid())",
          "caps": "print(next(l.split()[1] for l in open('/proc/self/status') if l.startswith('CapEff')))"}}
results = {{k: python({{"code": v}}) for k, v in cases.items()}}
print(json.dumps({{"uid": os.getuid(), "isolation": isolation,
                  "results": {{k: [r.error, r.text.strip().splitlines()[-1]] for k, r in results.items()}}}}))
"""


def _usable() -> str:
    if os.geteuid() != 0:
        return "needs root to start a process as another user"
    sys.path.insert(0, str(TOOLS))
    try:
        from _sandbox_isolation import closed_ancestor
    finally:
        sys.path.remove(str(TOOLS))
    if closed_ancestor(str(ROOT)):
        return f"{ROOT} is not readable by other users"
    try:
        with open("/proc/sys/user/max_user_namespaces") as f:
            if int(f.read()) == 0:
                return "user namespaces are disabled on this kernel"
    except OSError:
        pass
    return ""


@pytest.mark.skipif(bool(_usable()), reason=_usable() or "usable")
def test_an_unprivileged_trainer_gets_namespaces_through_a_user_namespace():
    work = Path(tempfile.mkdtemp(prefix="stapo-unpriv-"))
    try:
        work.chmod(0o755)
        name = f"stapo-escape-{os.getpid()}"
        check = work / "check.py"
        check.write_text(CHECK.format(root=str(ROOT), name=name))
        check.chmod(0o644)
        harness = HARNESS.format(tools=str(TOOLS), uid=NOBODY, check=str(check))
        proc = subprocess.run([sys.executable, "-I", "-c", harness], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-3000:]
        report = json.loads(proc.stdout.strip().splitlines()[-1])
        assert report["uid"] == NOBODY
        found = report["isolation"]
        assert found["user_namespace"] and found["network"] and found["pid"] and found["read_only"], found
        results = report["results"]
        assert results["write"][0] and "Read-only file system" in results["write"][1]
        assert results["network"][0] and "Network is unreachable" in results["network"][1]
        assert results["fork"][0] and "BlockingIOError" in results["fork"][1]
        assert results["ok"] == [False, "0 1"]  # root of its user namespace, PID 1 of its PID namespace
        assert results["caps"] == [False, "0000000000000000"]  # without any capability
        assert not os.path.exists(f"/tmp/{name}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
