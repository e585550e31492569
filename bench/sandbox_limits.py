"""The python tool's sandbox: what a call costs, and how long each kind of hostile code takes to be
stopped (docs/tools.md, "As tested").

    python bench/sandbox_limits.py [--repeats 3] [--smoke]

Costs: one stateless call of ``print(1)`` (a fresh sandboxed interpreter: start, run, tear down), one
cell in a live session, and 16 stateless calls through ``run_tool_calls`` with 8 workers. Hostile
code runs under the small limits of tests/tools/test_sandbox.py (2 s wall clock, 1 s CPU, 256 MB,
8 processes, 2 MB files, 200 characters; the CPU case under a 10 s wall clock, so that the CPU
limit stops it: on a busy machine one CPU second takes longer); each row is the median of
``--repeats`` calls and the last line the policy reads. ``--smoke``: one repeat, no case that waits
for a limit of seconds.
"""

from __future__ import annotations

import argparse
import statistics
import time

from stapo.tools import ToolCall, build_tool, run_tool_calls
from stapo.tools.python_tool import isolation_summary
from stapo.tools.sandbox import Sandbox

LIMITS = dict(timeout_s=2.0, cpu_time_s=1.0, memory_mb=256, max_processes=8, file_size_mb=2, max_output_chars=200)
HOSTILE = [  # (case, code, slow: waits for a limit of seconds)
    ("loops forever (CPU time; 10 s wall clock)", "while True:\n    pass", True),
    ("sleeps (wall clock)", "import time\ntime.sleep(60)", True),
    ("fork bomb (processes)", "import os\nwhile True:\n    os.fork()", False),
    ("thread bomb (processes)", "import threading, time\nwhile True:\n    threading.Thread(target=time.sleep, args=(60,)).start()", False),
    ("allocates 1 GB (memory)", "x = bytearray(1024 * 2**20)", False),
    ("prints 5 MB (output)", "print('x' * 5_000_000)", False),
    ("floods fd 1 (output pipe)", "import os\nwhile True:\n    os.write(1, b'x' * 65536)", False),
    ("writes a 3 MB file (file size)", "open('big', 'wb').write(b'x' * 3 * 2**20)", False),
    ("writes /tmp (read-only fs)", "open('/tmp/stapo-bench-escape', 'w')", False),
    ("connects to 127.0.0.1 (network)", "import socket\nsocket.create_connection(('127.0.0.1', 22), timeout=1)", False),
]


def _median_seconds(fn, repeats: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeats):
        start = time.monotonic()
        out = fn()
        times.append(time.monotonic() - start)
    return statistics.median(times), out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="one repeat, skip the cases that wait seconds")
    args = parser.parse_args()
    repeats = 1 if args.smoke else args.repeats
    python = build_tool("python", **LIMITS)
    with Sandbox(python.limits) as sandbox:
        sandbox.start()
        print(f"sandbox: {isolation_summary(sandbox.isolation)}\n")
    call_s, _ = _median_seconds(lambda: python({"code": "print(1)"}), repeats)
    session_tool = build_tool("python", stateful=True, **LIMITS)
    with session_tool.open_session() as session:
        session_tool({"code": "x = 0"}, session)
        cell_s, cell = _median_seconds(lambda: session_tool({"code": "x += 1\nx"}, session), repeats)
        assert not cell.error and int(cell.text) == repeats, cell
    jobs = [(python, ToolCall("python", {"code": f"print({i})"}, ""), None) for i in range(16)]
    batch_s, _ = _median_seconds(lambda: run_tool_calls(jobs, max_workers=8), repeats)
    print("| cost | seconds |\n|---|---|")
    print(f"| one stateless call (start, run, tear down) | {call_s:.3f} |")
    print(f"| one cell in a live session | {cell_s:.4f} |")
    print(f"| 16 stateless calls, 8 workers | {batch_s:.3f} |\n")
    print("| hostile code | seconds to the error | what the policy reads (its last line) |\n|---|---|---|")
    patient = build_tool("python", **{**LIMITS, "timeout_s": 10.0})  # so that the CPU limit is what stops it
    for case, code, slow in HOSTILE:
        if slow and args.smoke:
            continue
        tool = patient if "10 s wall clock" in case else python
        seconds, result = _median_seconds(lambda: tool({"code": code}), repeats)
        assert result.error, (case, result)
        last = result.text.strip().splitlines()[-1].replace("|", "\\|")[:80]
        cut = " (output cut)" if "[output cut: " in result.text else ""
        print(f"| {case} | {seconds:.2f} | `{last}`{cut} |")


if __name__ == "__main__":
    main()
