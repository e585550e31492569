"""Off-policy corrections (stapo.losses.corrections): hand-computed values for every weight and rejection
statistic, and equality with the formulas of docs/losses.md ("Off-policy corrections") on random batches.

The hand-built batch: ``log r = log pi_old - log pi_sampler`` is [0.5, -0.5, 0.0] on row 0 and [1.0] on
row 1 (two padding slots holding NaN / inf, which must never leak)::

    k1 = -log r            row 0: -0.5, 0.5, 0          row 1: -1
    k2 = (log r)^2 / 2     row 0: 0.125, 0.125, 0       row 1: 0.5
    k3 = r - 1 - log r     row 0: e^.5 - 1.5 = 0.148721, e^-.5 - .5 = 0.106531, 0     row 1: e - 2 = 0.718282
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from stapo.losses import RS_OPTIONS, RolloutCorrection, importance_weights, normalize_weights, rs_statistic
from stapo.losses.corrections import log_ratio, parse_is_threshold, parse_rs_thresholds

NAN, INF = float("nan"), float("inf")
E = math.e
K3 = (math.exp(0.5) - 1.5, math.exp(-0.5) - 0.5, 0.0, E - 2.0)  # row 0's three tokens, row 1's one


@pytest.fixture
def batch():
    old = torch.tensor([[-1.0, -2.0, -0.5], [0.0, NAN, 0.0]])
    sampler = torch.tensor([[-1.5, -1.5, -0.5], [-1.0, 0.0, -INF]])
    mask = torch.tensor([[True, True, True], [True, False, False]])
    return sampler, old, mask


def test_log_ratio_ignores_padding(batch):
    sampler, old, mask = batch
    torch.testing.assert_close(log_ratio(old, sampler, mask), torch.tensor([[0.5, -0.5, 0.0], [1.0, 0.0, 0.0]]))


@pytest.mark.parametrize("option, expected", [
    ("token_k1", [[-0.5, 0.5, 0.0], [-1.0, 0.0, 0.0]]),
    ("token_k2", [[0.125, 0.125, 0.0], [0.5, 0.0, 0.0]]),
    ("seq_sum_k1", [0.0, -1.0]),
    ("seq_sum_k2", [0.25, 0.5]),
    ("seq_sum_k3", [K3[0] + K3[1], K3[3]]),
    ("seq_mean_k1", [0.0, -1.0]),
    ("seq_mean_k2", [0.25 / 3, 0.5]),
    ("seq_mean_k3", [(K3[0] + K3[1]) / 3, K3[3]]),
    ("seq_max_k2", [0.125, 0.5]),
    ("seq_max_k3", [K3[0], K3[3]]),
])
def test_statistics_by_hand(batch, option, expected):
    sampler, old, mask = batch
    stat = rs_statistic(option, log_ratio(old, sampler, mask), mask)
    got = stat if stat.dim() == 1 else torch.where(mask, stat, 0.0)  # padding values are never read
    torch.testing.assert_close(got, torch.tensor(expected))


# (option, threshold, rejected valid tokens): the statistics of the module doc against each bound
REJECTIONS = [
    ("token_k1", "0.7_1.5", [[1, 1, 0], [1]]),      # exp(k1) = 0.61, 1.65, 1 | 0.37: inside [0.7, 1.5] only 1
    ("token_k2", 0.12, [[1, 1, 0], [1]]),           # 0.125 > 0.12
    ("token_k3", 0.12, [[1, 0, 0], [1]]),           # 0.149 > 0.12 >= 0.107
    ("seq_sum_k1", "0.5_2.0", [[0, 0, 0], [1]]),    # exp(0) = 1 in, exp(-1) = 0.37 out
    ("seq_sum_k2", 0.3, [[0, 0, 0], [1]]),          # 0.25 | 0.5
    ("seq_sum_k3", 0.25, [[1, 1, 1], [1]]),         # 0.2553 | 0.718: both rows out
    ("seq_mean_k1", 2.0, [[0, 0, 0], [1]]),         # one number: [1/2, 2]; exp(0) | exp(-1)
    ("seq_mean_k2", 0.1, [[0, 0, 0], [1]]),         # 0.0833 | 0.5
    ("seq_mean_k3", 0.09, [[0, 0, 0], [1]]),        # 0.0851 | 0.718
    ("seq_max_k2", 0.2, [[0, 0, 0], [1]]),          # 0.125 | 0.5
    ("seq_max_k3", 0.14, [[1, 1, 1], [1]]),         # 0.1487 | 0.718
]


@pytest.mark.parametrize("option, threshold, rejected", REJECTIONS, ids=[r[0] for r in REJECTIONS])
def test_each_rejection_option_by_hand(batch, option, threshold, rejected):
    sampler, old, mask = batch
    result = RolloutCorrection(rollout_rs=option, rollout_rs_threshold=threshold)(sampler, old, mask)
    expected = torch.tensor([rejected[0], rejected[1] + [0, 0]], dtype=torch.bool)
    assert torch.equal(result.rejected, expected)
    assert result.weights is None
    rows_out = [any(r) for r in rejected]
    assert result.sums["rejected_tokens"].item() == sum(map(sum, rejected))
    assert result.sums["rejected_seqs"].item() == sum(rows_out)
    assert (result.sums["correction_tokens"].item(), result.sums["correction_seqs"].item()) == (4, 2)


def test_several_options_must_all_pass(batch):
    sampler, old, mask = batch
    # token_k3 <= 0.12 rejects token 0:0 and row 1; seq_sum_k1 in [0.5, 2] rejects row 1: the union
    both = RolloutCorrection(rollout_rs="token_k3, seq_sum_k1,token_k3", rollout_rs_threshold="0.12,0.5_2.0")
    assert [b.option for b in both.bounds] == ["token_k3", "seq_sum_k1"]  # duplicates dropped, verl's order
    got = both(sampler, old, mask).rejected
    assert torch.equal(got, torch.tensor([[True, False, False], [True, False, False]]))


def test_token_and_sequence_weights_by_hand(batch):
    sampler, old, mask = batch
    lr = log_ratio(old, sampler, mask)
    # token: e^0.5 = 1.6487, e^-0.5 = 0.6065, 1 | e = 2.718 -> truncated at 2; padding 0
    torch.testing.assert_close(importance_weights(lr, mask, "token", 2.0),
                               torch.tensor([[math.exp(0.5), math.exp(-0.5), 1.0], [2.0, 0.0, 0.0]]))
    # IcePop band [0.7, 1.5]: 1.65 and 0.61 fall outside (0), 1 stays, 2.718 outside
    torch.testing.assert_close(importance_weights(lr, mask, "token", 1.5, 0.7),
                               torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.0, 0.0]]))
    # sequence: exp(0.5 - 0.5 + 0) = 1 on row 0; exp(1) = 2.718 on row 1 -> truncated at 2, or out of [0.5, 2]
    torch.testing.assert_close(importance_weights(lr, mask, "sequence", 2.0),
                               torch.tensor([[1.0, 1.0, 1.0], [2.0, 0.0, 0.0]]))
    torch.testing.assert_close(importance_weights(lr, mask, "sequence", 2.0, 0.5),
                               torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]]))


def test_a_sequence_weight_is_a_product_in_log_space():
    # 400 tokens of log r = 0.1 each: the product is e^40, which overflows no sum in log space and is
    # clamped at e^20 (verl's safety bound) before the cap
    old, sampler = torch.full((1, 400), -1.0), torch.full((1, 400), -1.1)
    mask = torch.ones(1, 400, dtype=torch.bool)
    lr = log_ratio(old, sampler, mask)
    assert torch.equal(importance_weights(lr, mask, "sequence", 1e12), torch.full((1, 400), math.exp(20.0)))
    assert torch.equal(importance_weights(lr, mask, "sequence", 3.0), torch.full((1, 400), 3.0))
    # weights are constants of the loss: no gradient flows into them from theta_old's log-probs
    assert not importance_weights(log_ratio(old.requires_grad_(), sampler, mask), mask, "token", 2.0).requires_grad


def test_batch_normalization_by_hand(batch):
    sampler, old, mask = batch
    lr = log_ratio(old, sampler, mask)
    token = importance_weights(lr, mask, "token", 2.0)  # valid: 1.6487, 0.6065, 1, 2: mean 1.31381
    mean = (math.exp(0.5) + math.exp(-0.5) + 3.0) / 4
    normalized = normalize_weights(token, mask, "token")
    torch.testing.assert_close(normalized, token / mean)
    assert normalized[mask].mean().item() == pytest.approx(1.0)
    # sequence: one weight per row (1 and 2): mean 1.5, whatever the row lengths (3 and 1 tokens)
    seq = normalize_weights(importance_weights(lr, mask, "sequence", 2.0), mask, "sequence")
    torch.testing.assert_close(seq, torch.tensor([[2 / 3, 2 / 3, 2 / 3], [4 / 3, 0.0, 0.0]]))
    zero = torch.zeros(2, 3)  # every weight zeroed by a band: left as it is, never 0 / 0
    assert torch.equal(normalize_weights(zero, mask, "token"), zero)


def test_the_correction_reports_verl_diagnostics_as_sums(batch):
    sampler, old, mask = batch
    result = RolloutCorrection(rollout_is="token", rollout_is_threshold=2.0)(sampler, old, mask)
    s = {k: v.item() for k, v in result.sums.items()}
    raw = [math.exp(0.5), math.exp(-0.5), 1.0, E]
    applied = [math.exp(0.5), math.exp(-0.5), 1.0, 2.0]
    assert s["rollout_is_raw_sum"] == pytest.approx(sum(raw))  # untruncated, as verl's rollout_is_mean
    assert s["rollout_is_max"] == pytest.approx(E)
    assert s["rollout_is_weight_sum"] == pytest.approx(sum(applied))
    assert s["rollout_is_weight_sq_sum"] == pytest.approx(sum(w * w for w in applied))
    assert s["rollout_is_clipped"] == 1.0  # row 1's e truncated to 2
    assert s["rejected_tokens"] == 0.0 and not result.rejected.any()


def test_batch_normalized_weights_keep_the_pre_normalization_diagnostics(batch):
    sampler, old, mask = batch
    plain = RolloutCorrection(rollout_is="sequence")(sampler, old, mask)
    normed = RolloutCorrection(rollout_is="sequence", rollout_is_batch_normalize=True)(sampler, old, mask)
    torch.testing.assert_close(normed.weights, plain.weights / 1.5)
    assert normed.sums["rollout_is_weight_sum"].item() == pytest.approx(3 * 1.0 + 2.0)  # token-weighted


def test_all_off_is_a_no_op_that_needs_no_sampler(batch):
    _, old, mask = batch
    result = RolloutCorrection()(None, old, mask)
    assert result.weights is None and not result.rejected.any()
    assert RolloutCorrection().describe() == "none"
    with pytest.raises(ValueError, match="needs the sampler's log-probs"):
        RolloutCorrection(rollout_is="token")(None, old, mask)


def test_describe_says_what_is_corrected():
    line = RolloutCorrection(rollout_is="sequence", rollout_is_threshold="0.5_2.0", rollout_is_batch_normalize=True,
                             rollout_rs="token_k1,seq_mean_k3", rollout_rs_threshold="2.0,0.01").describe()
    assert line == ("sequence-level importance weights pi_old/pi_sampler, zero outside [0.5, 2], batch-normalized; "
                    "reject tokens unless exp(token_k1) in [0.5, 2]; reject sequences unless seq_mean_k3 <= 0.01")


@pytest.mark.parametrize("settings, message", [
    ({"rollout_is": "geometric"}, "rollout_is must be one of ['token', 'sequence'] or null"),
    ({"rollout_is": "token", "rollout_is_threshold": 0}, "rollout_is_threshold: thresholds must be finite and > 0"),
    ({"rollout_is": "token", "rollout_is_threshold": "2_0.5"}, "has lower > upper"),
    ({"rollout_is_batch_normalize": True}, "rollout_is_batch_normalize normalizes importance weights"),
    ({"rollout_rs": "seq_max_k1", "rollout_rs_threshold": 2}, "unknown option 'seq_max_k1'"),
    ({"rollout_rs": "token_k3"}, "needs rollout_rs_threshold"),
    ({"rollout_rs_threshold": 2}, "rollout_rs_threshold is set but rollout_rs is not"),
    ({"rollout_rs": "token_k3,seq_sum_k2", "rollout_rs_threshold": "1,2,3"}, "one threshold for all options or one"),
    ({"rollout_rs": "token_k2", "rollout_rs_threshold": "0.5_2.0"}, "take one upper bound"),
    ({"rollout_rs": "token_k1", "rollout_rs_threshold": 0.52}, "gives the band [1.92308, 0.52], empty"),
    ({"rollout_rs": "token_k1", "rollout_rs_threshold": "x_2"}, "'x' is not a number"),
])
def test_bad_settings_name_the_setting(settings, message):
    with pytest.raises(ValueError) as err:
        RolloutCorrection(**settings)
    assert message in str(err.value)


def test_threshold_parsing_follows_verl():
    assert parse_is_threshold(2) == (None, 2.0) and parse_is_threshold("0.5_2.0") == (0.5, 2.0)
    one = parse_rs_thresholds("token_k1,seq_mean_k3", 3.0)  # one value for both; k1: [1/3, 3]
    assert [(b.option, b.lower, b.upper) for b in one] == [("token_k1", 1 / 3, 3.0), ("seq_mean_k3", None, 3.0)]


# ---- the formulas of docs/losses.md, written out token by token, on random batches --------------------

def _reference(lr: list[list[float]], valid: list[list[bool]], option: str) -> list[float | list[float]]:
    """docs/losses.md's statistics per row with Python floats (tokens: a list per row)."""
    kind, scope = option[-2:], option.rsplit("_", 1)[0]
    out = []
    for row, ok in zip(lr, valid):
        ks = []
        for x, v in zip(row, ok):
            x = max(-20.0, min(20.0, x))
            ks.append({"k1": -x, "k2": x * x / 2, "k3": math.exp(x) - 1 - x}[kind] if v else None)
        present = [k for k in ks if k is not None]
        if scope == "token":
            out.append(ks)
        else:
            agg = {"seq_sum": sum, "seq_max": max, "seq_mean": lambda p: sum(p) / len(p)}[scope]
            out.append(agg(present) if present else 0.0)
    return out


def _random_batch(seed: int):
    rng = random.Random(seed)
    b, t = 6, 9
    lengths = [rng.randint(0, t) for _ in range(b)]  # a row may be empty
    valid = [[j < n for j in range(t)] for n in lengths]
    lr = [[rng.gauss(0.0, 0.4) if v else 0.0 for v in row] for row in valid]
    old = torch.tensor([[rng.uniform(-6, 0) for _ in range(t)] for _ in range(b)])
    sampler = old - torch.tensor(lr)
    sampler = torch.where(torch.tensor(valid), sampler, torch.full_like(sampler, NAN))  # padding: garbage
    return sampler, old, torch.tensor(valid), lr, valid


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_statistics_and_rejection_equal_the_documented_formulas(seed):
    sampler, old, mask, lr, valid = _random_batch(seed)
    outcomes = set()
    for option in RS_OPTIONS:
        stat = rs_statistic(option, log_ratio(old, sampler, mask), mask)
        ref = _reference(lr, valid, option)
        for i, row in enumerate(ref):
            if isinstance(row, list):
                for j, value in enumerate(row):
                    if value is not None:
                        assert stat[i, j].item() == pytest.approx(value, rel=1e-5, abs=1e-6), (option, i, j)
            else:
                assert stat[i].item() == pytest.approx(row, rel=1e-5, abs=1e-6), (option, i)
        bound = 0.08 if not option.endswith("k1") else None  # k1: the band [0.8, 1.25] on exp(k1)
        rejected = RolloutCorrection(rollout_rs=option, rollout_rs_threshold=bound or "0.8_1.25")(
            sampler, old, mask).rejected
        for i, row in enumerate(ref):
            for j in range(len(valid[i])):
                value = row[j] if isinstance(row, list) else row
                if not valid[i][j]:
                    assert not rejected[i, j]
                    continue
                passes = value <= bound if bound else math.log(0.8) <= value <= math.log(1.25)
                assert bool(rejected[i, j]) == (not passes), (option, i, j)
                outcomes.add(passes)
    assert outcomes == {True, False}  # the bounds cut through the batch: both outcomes were checked


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_weights_equal_the_documented_formulas(seed, level):
    sampler, old, mask, lr, valid = _random_batch(seed)
    for threshold in (1.2, "0.8_1.25"):
        lower, upper = parse_is_threshold(threshold)
        for normalize in (False, True):
            got = RolloutCorrection(rollout_is=level, rollout_is_threshold=threshold,
                                    rollout_is_batch_normalize=normalize)(sampler, old, mask).weights
            ref = []
            for row, ok in zip(lr, valid):
                total = sum(x for x, v in zip(row, ok) if v)
                raws = [math.exp(max(-20, min(20, total if level == "sequence" else x))) for x in row]
                ref.append([(min(r, upper) if lower is None else (r if lower <= r <= upper else 0.0)) if v else 0.0
                            for r, v in zip(raws, ok)])
            if normalize:
                units = [w for row, ok in zip(ref, valid) for w, v in zip(row, ok) if v] if level == "token" \
                    else [row[0] for row, ok in zip(ref, valid) if any(ok)]
                mean = sum(units) / len(units)
                ref = [[w / mean for w in row] for row in ref] if mean > 1e-8 else ref
            torch.testing.assert_close(got, torch.tensor(ref), rtol=1e-5, atol=1e-6)
