"""Smoke test of bench/gpu_step.py: tiny shape on CPU, padded vs packed x ZeRO-1 vs ZeRO-3."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from gpu_step import WORKLOADS, synthetic_batch  # noqa: E402


def test_synthetic_batch_is_rl_shaped():
    seqs = synthetic_batch(16, 8, (6, 8), 24, vocab=384)
    assert seqs["prompt_mask"].shape == (16, 8) and seqs["response_mask"].shape == (16, 24)
    p_len, r_len = seqs["prompt_mask"].sum(1), seqs["response_mask"].sum(1)
    assert ((6 <= p_len) & (p_len <= 8)).all()
    assert ((5 <= r_len) & (r_len <= 24)).all()  # round(0.2 * 24) = 5 .. 24
    assert seqs["prompt_mask"][:, -1].all()  # left padding: every prompt ends at the last column
    assert seqs["response_mask"][:, 0].all()  # right padding
    assert seqs["lengths"] == (p_len + r_len).tolist()
    assert (seqs["prompt_ids"][~seqs["prompt_mask"]] == 0).all()
    groups = seqs["advantages"].view(2, 8)
    assert (groups.abs() == 1).all() and (groups.sum(1) == 0).all()  # 4 x +1, 4 x -1 per group


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_gpu_step_smoke_runs_all_configurations(tmp_path):
    out = tmp_path / "gpu_step.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_step.py"), "--smoke", "--json", str(out)],
                          capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    rows = data["rows"]
    assert [(r["layout"], r["zero"]) for r in rows] == [("padded", 1), ("padded", 3), ("packed", 1), ("packed", 3)]
    work = WORKLOADS["smoke"]
    seqs = synthetic_batch(work["sequences"], work["group"], work["prompt"], work["response"], vocab=384)
    assert data["tokens"] == sum(seqs["lengths"])  # real tokens only, the same for every layout
    assert data["peak"] is None  # CPU: MFU absent, not 0
    for r in rows:
        assert r["stats_s"] > 0 and r["update_s"] > 0
        assert "mfu_update" not in r and r["tokens_per_s_update"] > 0
    # padded: 4 rows per mini-batch / 2 rows per micro-batch = 2 micro-batches x 4 mini-batches
    assert rows[0]["micro_batches"] == 8
    table = [line for line in proc.stdout.splitlines() if line.startswith("|")]
    assert len(table) == 2 + 4 and "| – |" in table[2]  # header, rule, 4 rows; MFU blank on CPU
    assert "ZeRO-3 / ZeRO-1 step time: padded " in proc.stdout and ", packed " in proc.stdout
