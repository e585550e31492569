"""Token record format: round trip, validation, file naming, and building from (B, T) tensors."""

import math

import pytest
import torch

from stapo.inspect.collect import build_token_record
from stapo.inspect.records import load_records, read_token_record, write_token_record
from stapo.run_dir import token_record_path


def _same(a, b):
    assert a.to_dict().keys() == b.to_dict().keys()
    for k, v in a.to_dict().items():
        w = b.to_dict()[k]
        if isinstance(v, torch.Tensor):
            assert v.dtype == w.dtype and torch.equal(v, w), k
        else:
            assert v == w, k


def test_round_trip_is_exact_and_atomic(tmp_path, record):
    path = write_token_record(token_record_path(tmp_path, 10), record)
    assert path == tmp_path / "token_records" / "step_000010.pt"
    assert not list(path.parent.glob("*.tmp"))
    _same(read_token_record(path), record)
    # the on-disk object is a plain dict that loads with weights_only=True
    raw = torch.load(path, weights_only=True)
    assert raw["rows"][1]["response_text"] == "I think 5" and raw["mask_name"] == "stapo"
    # a dict is accepted by the writer too
    _same(read_token_record(write_token_record(tmp_path / "x.pt", record.to_dict())), record)


def test_load_records_orders_by_step_and_minibatch(tmp_path, make_record):
    for step, mb in ((20, 0), (5, 1), (5, 0)):
        write_token_record(token_record_path(tmp_path, step, mb), make_record(step, mb))
    (tmp_path / "token_records" / "notes.txt").write_text("ignored")
    assert token_record_path(tmp_path, 5, 1).name == "step_000005_mb1.pt"
    assert [(r.step, r.minibatch) for r in load_records(tmp_path)] == [(5, 0), (5, 1), (20, 0)]


def test_no_records_names_the_option(tmp_path):
    with pytest.raises(FileNotFoundError, match="inspect.record_every=N"):
        load_records(tmp_path)


@pytest.mark.parametrize("field, value, message", [
    ("entropy", torch.zeros(7), "'entropy' has 7 entries"),
    ("kept", torch.ones(8), "'kept' must be a 1-d torch.bool"),
    ("topk_probs", torch.zeros(8, 4), "topk_probs has 4 columns"),
    ("token_text", ["a"] * 7, "token_text/topk_text need 8"),
    ("row", torch.tensor([0, 0, 0, 0, 0, 1, 1, 2]), "token rows \\[2\\]"),
])
def test_validation_names_the_field(record, field, value, message):
    data = record.to_dict()
    data[field] = value
    with pytest.raises(ValueError, match=message):
        type(record)(**data)


def test_kept_and_silenced_must_be_disjoint(record):
    data = record.to_dict()
    data["kept"] = torch.ones(8, dtype=torch.bool)
    with pytest.raises(ValueError, match="both kept and silenced"):
        type(record)(**data)


def test_corrupt_file_is_named(tmp_path):
    bad = tmp_path / "token_records" / "step_000001.pt"
    bad.parent.mkdir()
    bad.write_bytes(b"not a pickle")
    with pytest.raises(ValueError, match="step_000001.pt"):
        load_records(tmp_path)


def test_build_token_record_flattens_valid_tokens():
    # B=2, T=3; row 1 has one padding position at t=2
    token_ids = torch.tensor([[7, 8, 9], [4, 5, 0]])
    valid = torch.tensor([[True, True, True], [True, True, False]])
    keep = torch.tensor([[True, False, True], [True, True, True]])  # keep on padding ignored
    logprobs = -torch.arange(6, dtype=torch.float32).view(2, 3)
    entropy = torch.arange(6, dtype=torch.float32).view(2, 3) / 10
    collision = torch.full((2, 3), 0.5)
    topk_ids = torch.tensor([7, 8, 9, 4, 5]).repeat(2, 3, 1)  # (B, T, 5)
    topk_probs = torch.full((2, 3, 5), 0.1)
    decoded = []

    def decode(i):
        decoded.append(i)
        return f"<{i}>"

    rec = build_token_record(
        step=3, minibatch=1, mask_name="stapo", thresholds={"tau_p": 2e-3, "tau_h": 0.3},
        token_ids=token_ids, logprobs=logprobs, entropy=entropy,
        advantages=torch.tensor([0.5, -0.5]), response_mask=valid, keep=keep,
        topk_ids=topk_ids, topk_probs=topk_probs, collision=collision, decode_token=decode,
        prompt_texts=["p0", "p1"], response_texts=["r0", "r1"], rewards=[1.0, -1.0])
    assert rec.row.tolist() == [0, 0, 0, 1, 1] and rec.position.tolist() == [0, 1, 2, 0, 1]
    assert rec.token_text == ["<7>", "<8>", "<9>", "<4>", "<5>"]
    assert rec.logprob.tolist() == [0.0, -1.0, -2.0, -3.0, -4.0]
    assert rec.advantage.tolist() == [0.5, 0.5, 0.5, -0.5, -0.5]
    assert rec.silenced.tolist() == [False, True, False, False, False]
    assert rec.kept.tolist() == [True, False, True, True, True]
    assert rec.topk_text[0] == ["<7>", "<8>", "<9>", "<4>", "<5>"]
    assert sorted(decoded) == [4, 5, 7, 8, 9]  # each distinct id decoded once
    assert [r.advantage for r in rec.rows] == [0.5, -0.5] and rec.rows[1].reward == -1.0
    with pytest.raises(ValueError, match="need 2 prompt_texts"):
        build_token_record(
            step=3, minibatch=1, mask_name="stapo", thresholds={"tau_p": 2e-3, "tau_h": 0.3},
            token_ids=token_ids, logprobs=logprobs, entropy=entropy,
            advantages=torch.tensor([0.5, -0.5]), response_mask=valid, keep=keep,
            topk_ids=topk_ids, topk_probs=topk_probs, collision=collision, decode_token=decode,
            prompt_texts=["p0"], response_texts=["r0", "r1"], rewards=[1.0, -1.0])


def test_missing_thresholds_get_stapo_defaults(record):
    # mask "none" reports no thresholds: τ_p -> 2e-3, τ_h -> 0.8 quantile of the entropies.
    # sorted H = [0.1, 0.2, 0.3, 0.4, 0.45, 0.6, 1.2, 2.0]; position 0.8·7 = 5.6
    # -> 0.6 + 0.6·(1.2 − 0.6) = 0.96
    data = record.to_dict()
    data["thresholds"] = {"tau_p": float("nan")}
    rec = type(record)(**data)
    assert rec.thresholds["tau_p"] == 2e-3
    assert rec.thresholds["tau_h"] == pytest.approx(0.96, rel=1e-6)
    assert rec.thresholds["tau_h"] == pytest.approx(torch.quantile(record.entropy, 0.8).item())
    data["thresholds"] = {"tau_p": 0.05, "tau_h": 0.25}  # given ones are kept
    assert type(record)(**data).thresholds == {"tau_p": 0.05, "tau_h": 0.25}
