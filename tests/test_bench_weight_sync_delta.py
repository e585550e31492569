"""Smoke test of bench/weight_sync_delta.py: real AdamW steps, then full and delta syncs through ServerEngine
into a receiver process running stapo's worker side over gloo; both receivers end with the same bytes (the
script fails otherwise), fp32 weights all change at lr 1e-6 and bf16 weights mostly do not."""

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "weight_sync_delta.py"


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_weight_sync_delta_smoke_sends_less_for_bf16():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--threads", "1"], capture_output=True, text=True,
                          timeout=590)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r[0]: r for r in ([c.strip() for c in line.strip("|").split("|")] for line in proc.stdout.splitlines()
                              if line.startswith("| tiny, fp32 |") or line.startswith("| smoke shape, bf16 |"))
            if len(r) == 6}
    ratio = {name: float(row[4]) for name, row in rows.items()}
    assert ratio["tiny, fp32"] == pytest.approx(1.0, abs=0.01)  # every fp32 element changed: buckets go whole
    assert ratio["smoke shape, bf16"] < 0.2
    steps = [line for line in proc.stdout.splitlines() if line.startswith("| smoke shape, bf16 | ") and len(line.split("|")) == 10]
    measured = [float(line.split("|")[3].strip().rstrip("%")) for line in steps]
    assert len(measured) == 2 and all(0 < m < 10 for m in measured)  # percent of bf16 elements changed per step
    assert "| Qwen3-32B | 65.6 GB |" in proc.stdout  # the projection: 2 bytes x 32.8e9 parameters
