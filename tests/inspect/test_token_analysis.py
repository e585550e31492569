"""Table 1 classes, Lemma A.1 gradient-norm proxy, token frequencies, silenced ratio."""

import json
import math
from collections import Counter

import pytest
import torch

from stapo.inspect.analysis import (CLASS_NAMES, SPURIOUS_CLASS, display_token,
                                    grad_norm_by_class, grad_norm_proxy,
                                    silenced_ratio_over_training, spurious_mask, token_classes,
                                    token_frequencies)
from stapo.inspect.records import write_token_record
from stapo.run_dir import token_record_path


def test_classes_follow_table_1(record):
    got = token_classes(record.logprob, record.entropy, record.advantage, 0.01, 0.5)
    assert got.tolist() == [5, 7, 1, 3, 7, 0, 6, 4]  # worked out in conftest's table
    assert CLASS_NAMES[SPURIOUS_CLASS] == "low H, low p, A>0"
    assert CLASS_NAMES[0] == "high H, high p, A<0"  # Table 1, first row


def test_class_boundaries_and_zero_advantage():
    # H == τ_h is "high" (strict <), A == 0 has no class, p far below τ_p is "low"
    logprob = torch.tensor([math.log(0.5), math.log(1e-4), math.log(1e-4)])
    entropy = torch.tensor([0.5, 0.25, 0.25])
    adv = torch.tensor([1.0, 1.0, 0.0])
    assert token_classes(logprob, entropy, adv, tau_p=2e-3, tau_h=0.5).tolist() == [1, 7, -1]


def test_grad_norm_proxy_by_hand():
    # A=2, p=0.5, Σπ²=0.3: 4·(1 − 1 + 0.3) = 1.2 ; A=−1, p=0.001, Σπ²=0.9: 1·(1 − 0.002 + 0.9)
    logprob = torch.tensor([math.log(0.5), math.log(0.001)])
    got = grad_norm_proxy(logprob, torch.tensor([0.3, 0.9]), torch.tensor([2.0, -1.0]))
    assert got.tolist() == pytest.approx([1.2, 1.898], rel=1e-5)


def test_grad_norm_by_class_by_hand(record):
    stats = grad_norm_by_class([record, record])  # duplicated: means unchanged, counts doubled
    assert [s.index for s in stats] == list(range(8))
    assert [s.count for s in stats] == [2, 2, 0, 2, 2, 2, 2, 4]
    assert stats[7].silenced == 4 and sum(s.silenced for s in stats) == 4
    assert stats[7].frac == pytest.approx(4 / 16)
    # class 7: " answer" 1·(1 − 0.002 + 0.9) = 1.898, "." 1·(1 − 0.004 + 0.98) = 1.976
    assert stats[7].mean_grad_norm_sq == pytest.approx((1.898 + 1.976) / 2, rel=1e-5)
    norm7 = (math.sqrt(1.898) + math.sqrt(1.976)) / 2
    assert stats[7].mean_grad_norm == pytest.approx(norm7, rel=1e-5)
    # baseline for A>0 is class 1 (" is": 1 − 1 + 0.3 = 0.3)
    assert stats[7].rel_to_baseline == pytest.approx(norm7 / math.sqrt(0.3) - 1, rel=1e-5)
    # class 0 ("I", A<0): 1 − 1.6 + 0.65 = 0.05 is its own baseline
    assert stats[0].mean_grad_norm_sq == pytest.approx(0.05, rel=1e-4)
    assert stats[0].rel_to_baseline == pytest.approx(0.0, abs=1e-6)
    assert stats[2].count == 0 and math.isnan(stats[2].mean_grad_norm)
    # low p + low H + A>0 dominates here, as in paper Fig. 2b
    assert max(stats, key=lambda s: -1 if math.isnan(s.mean_grad_norm)
               else s.mean_grad_norm).index == 7


def test_grad_norm_by_class_needs_records():
    with pytest.raises(ValueError, match="at least one"):
        grad_norm_by_class([])


def test_spurious_mask_is_independent_of_the_active_mask(make_record):
    rec = make_record(silenced=[False] * 8, mask_name="none")  # GRPO: nothing silenced
    assert spurious_mask(rec).tolist() == [False, True, False, False, True, False, False, False]
    # tighter τ_h = 0.15 leaves only "." (H = 0.1)
    assert spurious_mask(rec, tau_h=0.15).nonzero().flatten().tolist() == [4]


def test_token_frequencies(make_record):
    silenced, kept = token_frequencies([make_record(), make_record()])
    assert silenced == Counter({"answer": 2, ".": 2})
    assert kept == Counter({w: 2 for w in ("The", "is", "4", "I", "think", "5")})
    assert display_token(" \n") == "␣⏎" and display_token("  x ") == "x"


def test_silenced_ratio_prefers_metrics_then_records(tmp_path, make_record):
    write_token_record(token_record_path(tmp_path, 10), make_record(10))
    write_token_record(token_record_path(tmp_path, 10, 1),
                       make_record(10, 1, silenced=[False] * 8))
    write_token_record(token_record_path(tmp_path, 20), make_record(20))
    # step 10: (2 + 0) / 16 = 0.125 ; step 20: 2 / 8 = 0.25
    assert silenced_ratio_over_training(tmp_path) == [(10, 0.125), (20, 0.25)]
    lines = [{"step": 1, "silenced_frac": 1e-4}, {"step": 2, "loss": 1.0},
             {"step": 3, "silenced_frac": 3e-4}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert silenced_ratio_over_training(tmp_path) == [(1, 1e-4), (3, 3e-4)]
