"""``import stapo.losses`` must stay light: torch only (CONTRIBUTING.md)."""

import subprocess
import sys

HEAVY = ("transformers", "deepspeed", "datasets", "accelerate", "vllm", "sympy", "stapo.trainer", "stapo.rollout")


def test_import_is_light():
    code = "import sys, stapo.losses; print(','.join(m for m in %r if m in sys.modules))" % (HEAVY,)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "", f"stapo.losses pulled in: {out.stdout.strip()}"
