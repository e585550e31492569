"""bench/async_overlap.py --smoke against a real vLLM CPU server: the three modes run and report."""

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
