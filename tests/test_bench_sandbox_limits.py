"""bench/sandbox_limits.py --smoke runs: the cost rows and the fast hostile cases, each an error."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_sandbox_limits_smoke():
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "sandbox_limits.py"), "--smoke"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "| one stateless call (start, run, tear down) |" in proc.stdout
    assert "| fork bomb (processes) |" in proc.stdout and "loops forever" not in proc.stdout
