"""bench/vs_trl.py: the 20-Entropy selection rules on hand-built entropies, and a smoke run of both
trainers (TRL is a benchmark-only dependency: everything here skips without it)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow
pytest.importorskip("trl")

BENCH = Path(__file__).resolve().parents[1] / "bench"


@pytest.fixture(scope="module")
def bench_modules():
    sys.path.insert(0, str(BENCH))
    try:
        import _vs_trl_selection
        import vs_trl

        yield vs_trl, _vs_trl_selection
    finally:
        sys.path.remove(str(BENCH))


def test_trl_thresholds_per_micro_batch_stapo_over_the_mini_batch(bench_modules, tmp_path):
    _, sel = bench_modules
    entropy = torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0], [10.0, 20.0, 30.0, 40.0, 50.0]])  # (B=2, T=5)
    mask = torch.ones(2, 5, dtype=torch.bool)
    # TRL, one row per micro-batch, 0.8-quantile (linear): row 0: 1 + 0.8*4 = 4.2 -> keeps 5;
    # row 1: 10 + 0.8*40 = 42 -> keeps 50.
    t_keep, t_thr = sel.trl_keep(entropy, mask, micro_batch=1, keep_fraction=0.2)
    assert t_thr == pytest.approx([4.2, 42.0])
    assert t_keep.tolist() == [[False] * 4 + [True], [False] * 4 + [True]]
    # stapo over all 10 valid tokens: sorted index 0.8*9 = 7.2 -> 30 + 0.2*(40-30) = 32 -> keeps 40, 50.
    s_keep, tau_h = sel.stapo_keep(entropy, mask, keep_fraction=0.2)
    assert tau_h == pytest.approx(32.0)
    assert s_keep.tolist() == [[False] * 5, [False, False, False, True, True]]
    # with one micro-batch covering the mini-batch the two rules select the same tokens
    assert torch.equal(sel.trl_keep(entropy, mask, micro_batch=2, keep_fraction=0.2)[0], s_keep)
    # padding is never kept by either rule
    mask[0, 4] = False
    assert not sel.trl_keep(entropy, mask, 1, 0.2)[0][0, 4] and not sel.stapo_keep(entropy, mask, 0.2)[0][0, 4]


def test_selection_table_normalizers(bench_modules, tmp_path):
    _, sel = bench_modules
    entropy = torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0], [10.0, 20.0, 30.0, 40.0, 50.0]])
    mask = torch.ones(2, 5, dtype=torch.bool)
    torch.save([{"entropy": entropy, "response_mask": mask}], tmp_path / "rec.pt")
    text = "\n".join(sel.selection_tables(tmp_path / "rec.pt", micro_batch=1, keep_fraction=0.2,
                                          updates_per_iteration=1))
    # TRL: 2 kept over 10 valid tokens -> sum of weights 0.2; stapo: 2 kept over 2 -> 1.0
    assert "| 2 | 0.200 | 10 (all valid tokens of the step's window) | 1/10 | 0.200 |" in text
    assert "| 2 | 0.200 | 2 (kept tokens) | 1/2 | 1.000 |" in text
    assert "Jaccard overlap 0.333" in text  # both keep {50}; one of them keeps 5 or 40: 1/3


def test_smoke_run_both_trainers(bench_modules, tmp_path):
    vs_trl, _ = bench_modules
    out = vs_trl.main(["--smoke", "--variants", "entropy", "--out", str(tmp_path)])
    runs = out["results"]["entropy"]
    for trainer in ("stapo", "trl"):
        (res,) = runs[trainer]
        assert len(res.step_times) == 2 and all(t > 0 for t in res.step_times), trainer
        assert len(res.rewards) == 2 and all(-1.0 <= r <= 1.0 for r in res.rewards), trainer
        assert res.peak_rss_mb > 50, trainer
    assert (tmp_path / "rewards.png").stat().st_size > 1000
    saved = json.loads((tmp_path / "results.json").read_text())
    assert set(saved["results"]["entropy"]) == {"stapo", "trl"}
    report = out["report"]
    assert "| entropy | trl |" in report and "TRL `top_entropy_quantile=0.2`" in report
    assert "| 1.000 |" in report  # stapo renormalizes: its kept tokens' weights sum to 1


def _odd_length_reward(response: str, ground_truth: str) -> float:
    """Mixed rewards on a random tiny model (its answers are never right)."""
    return 1.0 if len(response) % 2 else -1.0


def _weights(trainer) -> dict[str, torch.Tensor]:
    from stapo.sync.buckets import iter_weight_buckets

    return {name: t.clone() for bucket in iter_weight_buckets(trainer.model) for name, t in bucket}


def test_zero_stage_0_trains_like_zero_stage_3(bench_modules, tmp_path, tiny_model_dir):
    """The bench's single-process CPU fix (``trainer.zero_stage=0``) must train the same model:
    same sampled responses and rewards, same weights after two iterations (4 optimizer steps)."""
    import dataclasses

    import _stapo_run

    from stapo import STAPOTrainer

    vs_trl, _ = bench_modules
    spec = vs_trl.RunSpec(model_dir=str(tiny_model_dir), prompts=2, group_size=4, max_new_tokens=8,
                          iterations=2, updates_per_iteration=2, micro_batch=2, lr=1e-3)
    rows = [{"prompt": p.question, "answer": p.answer} for p in vs_trl.problems(spec)]
    runs = {}
    for zero in (3, 0):
        cfg = _stapo_run.stapo_config(dataclasses.replace(spec, zero_stage=zero), tmp_path / f"zero{zero}")
        trainer = STAPOTrainer(cfg, reward_fn=_odd_length_reward, train_dataset=rows)
        before = _weights(trainer)
        metrics = [trainer.step() for _ in range(spec.iterations)]
        runs[zero] = (before, _weights(trainer), metrics)
    (before3, after3, m3), (before0, after0, m0) = runs[3], runs[0]
    assert any(not torch.equal(before0[k], after0[k]) for k in before0), "zero_stage=0 changed no weight"
    assert [m["reward_mean"] for m in m0] == [m["reward_mean"] for m in m3]
    assert all(m["skipped_updates"] == 0 for m in m0 + m3)
    assert any(0 < m["reward_mean"] + 1 < 2 for m in m0), "rewards were not mixed: no learning signal"
    # fp32 gradients are summed in a different order (ZeRO-3's flat partitions vs plain .grad), and
    # Adam's m / sqrt(v) turns a last-bit difference on a near-zero gradient into a visible one: allow
    # 5e-5 per element (~1% of the largest update, 4 steps x lr 1e-3) on at most 0.1% of elements.
    updated = max((after3[k] - before3[k]).abs().max().item() for k in after3)
    assert updated > 1e-3, f"zero_stage=3 barely moved the weights ({updated})"
    for name in after3:
        diff = (after0[name] - after3[name]).abs()
        assert diff.max() < 5e-5, f"{name}: zero_stage 0 vs 3 differ by {diff.max():.2e}"
        assert (diff > 1e-6).float().mean() < 1e-3, f"{name}: {(diff > 1e-6).float().mean():.2%} of entries differ"
