"""The inspector's view of a token-weighting mask: up-/down-weighted tokens as a class next to S2T.

The hand-built record of conftest.py (τ_p = 0.01, τ_h = 0.5) with weights: "The" (0:0) and "."
(0:4, an S2T token) up-weighted 1.1, " think" (1:1) down-weighted 0.9, " answer" (0:1, S2T) silenced.
"""

from __future__ import annotations

import math

import pytest
import torch

from stapo.inspect import inspect_run, read_token_record, weight_classes, write_token_record
from stapo.inspect.collect import build_token_record
from stapo.run_dir import token_record_path

WEIGHTS = [1.1, 0.0, 1.0, 1.0, 1.1, 1.0, 0.9, 1.0]


def _weighted(make_record, step: int = 10):
    record = make_record(step, silenced=[w == 0 for w in WEIGHTS], mask_name="stare")
    record.weight = torch.tensor(WEIGHTS)
    record.validate()
    return record


def test_weight_classes_hand_built(make_record):
    up, down, silenced, rejected, s2t = weight_classes([_weighted(make_record)])
    assert rejected.count == 0 and math.isnan(rejected.mean_weight)  # no off-policy rejection in this record
    assert (up.count, up.s2t_overlap, down.count, silenced.count, silenced.s2t_overlap) == (2, 1, 1, 1, 1)
    assert up.frac == pytest.approx(2 / 8) and up.mean_weight == pytest.approx(1.1)
    assert up.median_prob == pytest.approx(0.002)  # torch.median of (0.9, 0.002): the lower middle
    assert up.mean_entropy == pytest.approx((0.3 + 0.1) / 2) and up.positive_frac == 1.0
    # sqrt(A²(1 − 2p + Σπ²)): "The" sqrt(1 − 1.8 + 0.82) = sqrt(0.02), "." sqrt(1 − 0.004 + 0.98)
    assert up.mean_grad_norm == pytest.approx((math.sqrt(0.02) + math.sqrt(1.976)) / 2, rel=1e-5)
    assert down.positive_frac == 0.0 and down.mean_grad_norm == pytest.approx(math.sqrt(1 - 0.006 + 0.7), rel=1e-5)
    assert s2t.count == 2 and s2t.mean_weight == pytest.approx((0.0 + 1.1) / 2)


def test_weights_round_trip_and_old_records_read_as_kept(tmp_path, make_record):
    record = _weighted(make_record)
    back = read_token_record(write_token_record(token_record_path(tmp_path, 10), record))
    assert torch.equal(back.weight, torch.tensor(WEIGHTS))
    old = record.to_dict()
    del old["weight"]  # a record written before token weights
    assert torch.equal(type(record)(**old).weight, record.kept.float())
    bad = record.to_dict()
    bad["weight"] = torch.ones(8)  # weight > 0 on a silenced token
    with pytest.raises(ValueError, match="weight > 0 must be exactly the kept tokens"):
        type(record)(**bad)


def test_build_token_record_takes_the_weights():
    keep = torch.tensor([[True, False, True]])
    record = build_token_record(
        step=1, minibatch=0, mask_name="stare", thresholds={"tau_p": 0.01, "tau_h": 0.5},
        token_ids=torch.tensor([[5, 6, 7]]), logprobs=torch.full((1, 3), -1.0), entropy=torch.ones(1, 3),
        advantages=torch.tensor([1.0]), response_mask=torch.tensor([[True, True, True]]), keep=keep,
        topk_ids=torch.zeros(1, 3, 2, dtype=torch.long), topk_probs=torch.zeros(1, 3, 2),
        collision=torch.ones(1, 3), decode_token=str, prompt_texts=["p"], response_texts=["r"], rewards=[1.0],
        weights=torch.tensor([[1.1, 0.7, 1.0]]))  # 0.7 sits on a silenced token: recorded as 0
    assert torch.equal(record.weight, torch.tensor([1.1, 0.0, 1.0]))


def test_inspect_run_reports_the_weighted_tokens(tmp_path, make_record):
    run = tmp_path / "run"
    write_token_record(token_record_path(run, 10), _weighted(make_record))
    out = inspect_run(run)
    table = (out / "weighted_tokens.md").read_text()
    assert "| up-weighted (w > 1) | 2 | 25.0000% | 1 | 1.1 |" in table
    assert "| down-weighted (0 < w < 1) | 1 | 12.5000% | 0 | 0.9 |" in table
    assert "## Weighted tokens next to S2T" in (out / "index.md").read_text()
    assert "<td>up-weighted (w &gt; 1)</td><td>2</td>" in (out / "report.html").read_text()


def test_rejected_tokens_are_their_own_class(tmp_path, make_record):
    # row 1 ("I", " think", " 5": A = -1) rejected whole by a sequence filter; the mask silenced 0:1 and 0:4
    record = make_record(10)
    record.rejected = torch.tensor([False] * 5 + [True] * 3)
    record.validate()
    *_, rejected, s2t = weight_classes([record])
    assert (rejected.count, rejected.s2t_overlap, rejected.positive_frac) == (3, 0, 0.0)
    assert rejected.frac == pytest.approx(3 / 8) and rejected.mean_entropy == pytest.approx((0.6 + 0.4 + 0.45) / 3)
    back = read_token_record(write_token_record(token_record_path(tmp_path / "run", 10), record))
    assert torch.equal(back.rejected, record.rejected)
    old = record.to_dict()
    del old["rejected"]  # a record written before the off-policy correction: nothing rejected
    assert not type(record)(**old).rejected.any()
    out = inspect_run(tmp_path / "run")
    assert "rejected by the off-policy correction: 3 (37.5000%)" in (out / "index.md").read_text()
    assert "| rejected (off-policy correction) | 3 | 37.5000% | 0 |" in (out / "weighted_tokens.md").read_text()


def test_build_token_record_takes_the_rejected_tokens():
    record = build_token_record(
        step=1, minibatch=0, mask_name="stapo", thresholds={"tau_p": 0.01, "tau_h": 0.5},
        token_ids=torch.tensor([[5, 6, 7], [8, 9, 0]]), logprobs=torch.full((2, 3), -1.0), entropy=torch.ones(2, 3),
        advantages=torch.tensor([1.0, -1.0]), response_mask=torch.tensor([[True, True, True], [True, True, False]]),
        keep=torch.ones(2, 3, dtype=torch.bool), topk_ids=torch.zeros(2, 3, 2, dtype=torch.long),
        topk_probs=torch.zeros(2, 3, 2), collision=torch.ones(2, 3), decode_token=str, prompt_texts=["p", "q"],
        response_texts=["r", "s"], rewards=[1.0, -1.0],
        rejected=torch.tensor([[False, False, False], [True, True, True]]))  # the padding slot is not a token
    assert torch.equal(record.rejected, torch.tensor([False, False, False, True, True]))
