"""Smoke test of bench/memory_knobs.py: activation checkpointing against off, each in its own process, on CPU.

The compiled configurations are left out here: torch.compile of the layers' forward and backward takes minutes
on 2 CPU cores (docs/benchmarks.md, "Memory knobs", has the measured rows). ~27 s of CPU time: two processes
that each import DeepSpeed, build a 2-layer engine and run the phases twice."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "memory_knobs.py"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_memory_knobs_smoke_measures_checkpointing_against_off(tmp_path):
    out = tmp_path / "knobs.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--knobs", "off,checkpointing", "--json", str(out)],
                          capture_output=True, text=True, timeout=290)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert [r["knob"] for r in rows] == ["off", "checkpointing"]
    for r in rows:
        assert r["stats_s"] > 0 and r["update_s"] > 0 and r["added_peak_mib"] >= 0 and r["device"] == "CPU"
    assert rows[0]["logprob_max_diff"] == 0.0
    assert rows[1]["logprob_max_diff"] <= 1e-5  # recomputation changes nothing but float rounding (fp32)
    table = [line for line in proc.stdout.splitlines() if line.startswith("|")]
    assert len(table) == 4 and table[2].startswith("| off |") and "| 1.00 |" in table[2]
