"""Token recording during training feeds ``stapo inspect`` (paper Fig. 2, App. C).

On a real tiny-model run: the recorded silenced set is exactly what the S2T rule gives on the
recorded p, H and A with the recorded thresholds; the inspector's table lists exactly those tokens
with their recorded values; ``stapo inspect RUN_DIR`` writes the report."""

from __future__ import annotations

import math

import pytest
import torch

from test_trainer import tiny_config


def length_parity_reward(response: str, ground_truth: str) -> float:
    return 1.0 if len(response) % 2 else -1.0  # mixed rewards in almost every group

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def recorded_run(tmp_path_factory, tiny_model_dir, arithmetic_jsonl):
    from stapo import STAPOTrainer

    tmp = tmp_path_factory.mktemp("recorded")
    cfg = tiny_config(tmp, tiny_model_dir, arithmetic_jsonl, "mask.params={tau_p: 0.05}",
                      "inspect.record_every=1", "trainer.total_steps=2")
    STAPOTrainer(cfg, reward_fn=length_parity_reward).train()
    return tmp / "run"


def test_records_hold_exactly_what_the_mask_silenced(recorded_run):
    from stapo.inspect import load_records, silenced_token_table

    records = load_records(recorded_run)
    assert [r.step for r in records] == [1, 2]
    for rec in records:
        assert rec.mask_name == "stapo"
        s2t = (rec.advantage > 0) & (rec.logprob < math.log(rec.thresholds["tau_p"])) & (
            rec.entropy < rec.thresholds["tau_h"])
        assert torch.equal(rec.silenced, s2t)
        assert torch.equal(rec.kept, ~s2t)
        assert int(rec.silenced.sum()) < len(rec.silenced)
        assert torch.allclose(rec.topk_probs[:, 0], rec.topk_probs.max(dim=1).values)
        assert (rec.collision > 0).all() and (rec.collision <= 1).all()
    assert sum(int(r.silenced.sum()) for r in records) > 0
    rows = silenced_token_table(records)
    expected = {(r.step, int(row), int(pos)): (math.exp(float(lp)), float(h), float(a))
                for r in records for row, pos, lp, h, a, s in
                zip(r.row, r.position, r.logprob, r.entropy, r.advantage, r.silenced) if s}
    got = {(t.step, t.row, t.position): (t.prob, t.entropy, t.advantage) for t in rows}
    assert got.keys() == expected.keys()
    for key, (p, h, a) in expected.items():
        assert got[key] == pytest.approx((p, h, a), rel=1e-5)


def test_stapo_inspect_writes_the_report(recorded_run, capsys):
    from stapo.cli import main

    assert main(["inspect", str(recorded_run)]) == 0
    out = recorded_run / "inspect"
    for name in ("index.md", "report.html"):
        assert (out / name).stat().st_size > 0
    assert len(list(out.glob("*.png"))) >= 4
    printed = capsys.readouterr().out.splitlines()  # the headline numbers first, then where the report is
    assert printed[0].startswith("records: ") and "mask: stapo, τ_p = " in printed[0]
    assert printed[1].startswith("valid tokens: ") and "silenced by the mask: " in printed[1]
    assert printed[-1] == f"inspector report: {out} (index.md, report.html)"


def test_topk_comes_from_the_same_theta_as_p_and_h(tmp_path, tiny_model_dir, arithmetic_jsonl):
    # The record is taken before the first mini-batch's update: wherever the sampled token is among
    # the top-5 alternatives, its top-k probability IS exp(logprob) the mask saw (after an update it
    # would have moved by far more than float rounding at lr 1e-2). Temperature 0.1 sharpens the
    # random tiny model so that sampled tokens are often among the top 5.
    from stapo import STAPOTrainer
    from stapo.inspect import load_records

    cfg = tiny_config(tmp_path, tiny_model_dir, arithmetic_jsonl, "inspect.record_every=1", "rollout.temperature=0.1",
                      "optim.lr=1e-2")
    STAPOTrainer(cfg, reward_fn=length_parity_reward).train()
    matched = 0
    for rec in load_records(tmp_path / "run"):
        hit = rec.topk_ids == rec.token_id[:, None]  # (N, K)
        rows = hit.any(dim=1)
        got = (rec.topk_probs * hit).sum(dim=1)[rows]
        torch.testing.assert_close(got, rec.logprob[rows].exp(), rtol=1e-4, atol=1e-6)
        matched += int(rows.sum())
    assert matched > 20, "too few sampled tokens among the top-5 to compare"


def test_recording_every_minibatch_keeps_each_one_and_changes_no_training(tmp_path, tiny_model_dir,
                                                                          arithmetic_jsonl):
    # inspect.record_minibatches=all: one record per (step, mini-batch), each taken before its own
    # update (mini-batch 1's top-k agrees with the p the mask saw after mini-batch 0's update), and
    # the run's metrics equal, bit for bit, those of the same run recording nothing.
    from stapo import STAPOTrainer
    from stapo.inspect import load_records, silenced_token_table
    from stapo.run_dir import read_metrics
    from stapo.telemetry.metrics import training_metrics

    runs = {}
    for name, extra in {"all": ("inspect.record_every=1", "inspect.record_minibatches=all"),
                        "off": ("inspect.record_every=0",)}.items():
        cfg = tiny_config(tmp_path / name, tiny_model_dir, arithmetic_jsonl, "rollout.temperature=0.1",
                          "optim.lr=1e-2", "mask.params={tau_p: 0.05}", *extra)
        STAPOTrainer(cfg, reward_fn=length_parity_reward).train()
        runs[name] = tmp_path / name / "run"
    records = load_records(runs["all"])
    assert [(r.step, r.minibatch) for r in records] == [(1, 0), (1, 1), (2, 0), (2, 1)]
    for rec in records:
        hit = rec.topk_ids == rec.token_id[:, None]
        rows = hit.any(dim=1)
        assert int(rows.sum()) > 5
        torch.testing.assert_close((rec.topk_probs * hit).sum(dim=1)[rows], rec.logprob[rows].exp(),
                                   rtol=1e-4, atol=1e-6)
    labels = {(t.step, t.minibatch) for t in silenced_token_table(records)}
    assert any(mb > 0 for _, mb in labels), "no silenced token in a later mini-batch to label"

    def training(run):
        return [training_metrics(row) for row in read_metrics(run / "metrics.jsonl")]

    assert training(runs["all"]) == training(runs["off"])
