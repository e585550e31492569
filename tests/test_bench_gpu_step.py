"""bench/gpu_step.py: the synthetic batch, the head's FLOP share by hand, and the smoke run on CPU."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from _gpu_step_report import head_flop_shares  # noqa: E402
from gpu_step import SMOKE, main, synthetic_batch  # noqa: E402


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


def test_head_flop_share_by_hand():
    from transformers import Qwen3Config

    config = Qwen3Config(vocab_size=10, hidden_size=4, intermediate_size=8, num_hidden_layers=1,
                         num_attention_heads=1, num_key_value_heads=1, head_dim=4)
    # body matmul params 4*4*(2+2) + 3*4*8 = 160, head 4*10 = 40; one sequence of 2 tokens (3 causal pairs),
    # the head at 1 response position: forward 2*160*2 + 4*1*1*4*3 + 2*40*1 = 640 + 48 + 80 = 768 FLOPs
    shares = head_flop_shares(config, [2], response_tokens=1)
    assert shares["head_flop_share"] == pytest.approx(80 / 768)
    # the update executes the body 3x (688 * 3) and 4 head matmuls (4 * 80)
    assert shares["head_flop_share_update_executed"] == pytest.approx(320 / (3 * 688 + 320))


def test_flops_prints_both_shapes_at_the_real_vocabulary(capsys):
    assert main(["--flops"]) == []
    table = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| qwen3")]
    assert [line.split(" | ")[:2] for line in table] == [["| qwen3_0p6b", "151,936"], ["| qwen3_1p7b", "151,936"]]
    assert "| 155.6M | 440.4M | 22.1% | 27.5% |" in table[0]  # 1,024 x 151,936 head; 28 x 15.7M decoder
    assert "| 311.2M | 1,409.3M | 15.5% | 19.7% |" in table[1]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_gpu_step_smoke_runs_all_configurations(tmp_path):
    out = tmp_path / "gpu_step.json"
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "gpu_step.py"), "--smoke", "--json", str(out)],
                          capture_output=True, text=True, timeout=230)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    rows = data["rows"]
    # --attn sdpa,auto: auto is sdpa on CPU, so one attention; padded and packed x ZeRO-1 and 3
    assert [(r["attn"], r["layout"], r["zero"]) for r in rows] == [
        ("sdpa", "padded", 1), ("sdpa", "padded", 3), ("sdpa", "packed", 1), ("sdpa", "packed", 3)]
    seqs = synthetic_batch(SMOKE["sequences"], SMOKE["group"], SMOKE["prompt"], SMOKE["response"], vocab=384)
    assert data["tokens"] == sum(seqs["lengths"])  # real tokens only, the same for every layout
    assert data["response_tokens"] == int(seqs["response_mask"].sum()) and data["vocab"] == 384
    assert data["peak"] is None  # CPU: MFU absent, not 0
    assert data["head_stats_s"] > 0 and data["head_update_s"] > 0
    for r in rows:
        assert r["stats_s"] > 0 and r["update_s"] > 0 and "error" not in r
        assert "mfu_update" not in r and r["tokens_per_s_update"] > 0
        assert r["head_share_update"] == pytest.approx(data["head_update_s"] / r["update_s"])
    # padded: 4 rows per mini-batch / 2 rows per micro-batch = 2 micro-batches x 4 mini-batches
    assert rows[0]["micro_batches"] == 8
    table = [line for line in proc.stdout.splitlines() if line.startswith("|")]
    assert len(table) == 2 + 4 and "| – |" in table[2]  # header, rule, 4 rows; MFU blank on CPU
    assert "head % update" in table[0]
    assert "ZeRO-3 / ZeRO-1 step time: sdpa padded " in proc.stdout and ", sdpa packed " in proc.stdout
