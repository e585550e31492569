"""bench/async_overlap.py --smoke against a real vLLM CPU server: the three modes run and report, and the
server's idle share is measured on the server, per step."""

from __future__ import annotations

import json
import sys

import pytest
from conftest import ROOT, run

pytestmark = pytest.mark.timeout(1800)


def test_async_overlap_smoke_reports_every_mode(servers, tmp_path):
    proc = run([sys.executable, str(ROOT / "bench" / "async_overlap.py"), "--smoke", "--server", servers[0].address,
                "--out", str(tmp_path)])
    results = json.loads((tmp_path / "results.json").read_text())
    assert list(results) == ["colocated", "server k=0", "server k=1"]
    assert all([r["step"] for r in rows] == [1, 2] for rows in results.values())
    assert [r["policy_staleness"] for r in results["server k=1"]] == [0, 1]
    assert all(r["policy_staleness"] == 0 for r in results["server k=0"])
    assert "server k=1 vs k=0" in proc.stdout
    for mode in ("server k=0", "server k=1"):  # measured on the server (its running-request gauge), per step
        assert all(0.0 <= r["server_idle_frac"] <= 1.0 for r in results[mode]), results[mode]
    # the server generated during every lock-step step and during k=1's first (k=1's step 2 may find its batch
    # generated already, during step 1's update): its token counter rose, whether or not a gauge sample caught
    # the generation (at this size it can fall between samples)
    assert all(r["server_tokens"] > 0 for r in results["server k=0"]), results["server k=0"]
    assert results["server k=1"][0]["server_tokens"] > 0, results["server k=1"]
    assert all("server_idle_frac" not in r for r in results["colocated"])
