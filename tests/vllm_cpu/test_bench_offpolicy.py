"""bench/offpolicy.py --smoke against a real vLLM CPU server: asynchronous runs with and without a rejection
filter train, and the report gives each its row (staleness, mismatch, what was rejected)."""

from __future__ import annotations

import json
import sys

import pytest
from conftest import ROOT, run

pytestmark = pytest.mark.timeout(1800)


def test_offpolicy_smoke_runs_and_reports(servers, tmp_path):
    out = tmp_path / "study"
    bench = [sys.executable, str(ROOT / "bench" / "offpolicy.py"), "--smoke", "--out", str(out)]
    run([*bench, "--server", servers[0].address])
    results, doc, figure = tmp_path / "results.jsonl", tmp_path / "doc.md", tmp_path / "fig.png"
    doc.write_text("prose\n<!-- BEGIN offpolicy -->\nold\n<!-- END offpolicy -->\nmore prose\n")
    run([*bench, "--report", "--results", str(results), "--doc", str(doc), "--figure", str(figure)])
    rows = [json.loads(line) for line in results.read_text().splitlines()]
    assert [(r["mode"], r["correction"], r["status"], r["steps_done"]) for r in rows] == [
        ("async_k2", "none", "done", 2), ("async_k2", "seq_mean_k3", "done", 2)]
    assert all(r["staleness"] > 0 and r["mismatch_kl"] is not None for r in rows), rows  # step 2 is stale
    assert rows[0]["rejected_frac"] == 0.0 and rows[0]["is_ess"] is None  # loss.rollout_is=null: no weights
    text = doc.read_text()
    assert text.startswith("prose\n<!-- BEGIN offpolicy -->") and text.endswith("<!-- END offpolicy -->\nmore prose\n")
    assert "| async_k2 | `seq_mean_k3` | 0 (of 1) |" in text and figure.stat().st_size > 10_000
