"""Smoke test of bench/zero_tuning.py: 2 gloo ranks, tiny model, all settings, collectives and fetches counted."""

import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "bench" / "zero_tuning.py"


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_zero_tuning_smoke_prints_every_setting():
    proc = subprocess.run([sys.executable, str(SCRIPT), "--smoke"], capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| ")]
    assert [r.split("|")[1].strip() for r in rows[1:]] == ["deepspeed_defaults", "tuned_single_trace", "tuned"]
    header = [c.strip() for c in rows[0].strip("|").split("|")]
    gathers = header.index("all_gather_into_tensor / step")
    complete = {}
    for row in rows[1:]:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert int(cells[gathers]) > 0  # ZeRO-3 gathered parameters during the counted step
        complete[cells[0]] = int(cells[header.index("fetches on a complete trace")].rstrip("%"))
    # a trace per pass kind: every fetch after the first step (the smoke model too); one trace: far fewer
    assert complete["tuned"] == 100 and complete["tuned_single_trace"] < 90, complete
    assert "the GPU effect is not measured here" in proc.stdout
