"""Token weights in the mask registry: ``weigh(stats)``, the weighted loss, ``stare`` and ``clip_cov``.

Exact values on hand-built tensors (arithmetic in the comments), the bit-identity of {0, 1} weights
with the keep mask in every aggregation mode, and ``stare`` against an independent transcription of
the released STARE code's per-batch formula (hp-luo/STARE, ``compute_stare_token_weights`` and
``compute_policy_loss_stare``) on random batches.
"""

from __future__ import annotations

import math

import pytest
import torch

from stapo.losses import AGG_MODES, TokenMask, TokenStats, build_mask, clipped_surrogate_loss, register_mask
from stapo.losses.selection import global_random_pick, global_top_k, top_ratio_count
from stapo.losses.weighting_masks import ratio_clipped, token_covariance

T_, F_ = True, False


def _random_batch(seed: int, b: int = 6, t: int = 11, per_token_adv: bool = False):
    g = torch.Generator().manual_seed(seed)
    logprobs = -torch.rand(b, t, generator=g) * 4.0
    old = logprobs + (torch.rand(b, t, generator=g) - 0.5) * 0.8  # ratios on both sides of the clip range
    mask = torch.rand(b, t, generator=g) > 0.25
    mask[:, 0] = True
    adv = torch.randn(b, generator=g).round(decimals=1)
    adv[0] = 0.0  # a zero-advantage row is never selected
    if per_token_adv:
        adv = adv[:, None].expand(b, t).clone()
    return logprobs, old, adv, mask


# ---- the weighted loss ---------------------------------------------------------------------------

def test_zero_one_weights_are_bit_identical_to_the_keep_mask_in_every_mode():
    for seed in range(5):
        logprobs, old, adv, mask = _random_batch(seed)
        keep = mask & (torch.rand(mask.shape, generator=torch.Generator().manual_seed(seed + 9)) > 0.3)
        for agg in AGG_MODES:
            for clip_c in (None, 3.0):
                a = logprobs.clone().requires_grad_(True)
                b = logprobs.clone().requires_grad_(True)
                is_weights = torch.rand(mask.shape) + 0.5
                kw = dict(agg=agg, clip_c=clip_c, max_response_length=16)
                plain, m1 = clipped_surrogate_loss(a, old, adv, keep, weights=is_weights, **kw)
                # the trainer's composition (stapo.trainer.update.loss_tokens): keep = mask keep (weight > 0),
                # weights = mask weights x IS weights
                mask_weights = keep.float()
                weighted, m2 = clipped_surrogate_loss(b, old, adv, mask & (mask_weights > 0),
                                                      weights=mask_weights * is_weights, **kw)
                plain.backward()
                weighted.backward()
                assert torch.equal(plain, weighted), (seed, agg, clip_c)
                assert torch.equal(a.grad, b.grad), (seed, agg, clip_c)
                assert all(torch.equal(m1[k], m2[k]) for k in m1)


def test_weights_scale_the_numerator_not_the_denominator():
    # one row, ratio 1 (logprobs == old): l_t = -A = -1 on each of 4 valid tokens; weights 2, 1, 0, 0.5
    logprobs = torch.zeros(1, 5)
    keep = torch.tensor([[T_, T_, T_, T_, F_]])
    weights = torch.tensor([[2.0, 1.0, 0.0, 0.5, 7.0]])  # 7 sits on padding: ignored
    keep = keep & (weights > 0)  # a mask's weight 0 silences (MaskResult.keep); the weights never change keep
    adv = torch.tensor([1.0])
    loss, metrics = clipped_surrogate_loss(logprobs, logprobs, adv, keep, weights=weights)
    # numerator -(2 + 1 + 0.5) = -3.5; denominator: tokens with w > 0 = 3 -> -3.5 / 3
    assert loss.item() == pytest.approx(-3.5 / 3)
    assert metrics["kept_tokens"].item() == 3
    assert metrics["pg_loss_sum"].item() == pytest.approx(-3.5)
    seq, _ = clipped_surrogate_loss(logprobs, logprobs, adv, keep, weights=weights, agg="seq-mean-token-mean")
    assert seq.item() == pytest.approx(-3.5 / 3)  # one row: (-3.5 / 3 kept) / 1 row
    norm, _ = clipped_surrogate_loss(logprobs, logprobs, adv, keep, weights=weights, agg="seq-mean-token-sum-norm",
                                     max_response_length=7)
    assert norm.item() == pytest.approx(-3.5 / 7)
    with pytest.raises(ValueError, match="weights shape"):
        clipped_surrogate_loss(logprobs, logprobs, adv, keep, weights=weights[:, :3])


def test_weight_zero_token_gets_exactly_zero_gradient_even_when_nan():
    class Weights(TokenMask):
        def weigh(self, stats):
            return torch.tensor([[1.5, 0.0]])

    logprobs = torch.tensor([[-1.0, float("nan")]], requires_grad=True)
    stats = TokenStats(logprobs.detach(), torch.zeros(1, 2), torch.tensor([1.0]), torch.tensor([[T_, T_]]))
    result = Weights().apply(stats)  # weight 0: out of result.keep
    loss, _ = clipped_surrogate_loss(logprobs, torch.tensor([[-1.0, -1.0]]), torch.tensor([1.0]), result.keep,
                                     weights=result.weights)
    loss.backward()
    assert torch.isfinite(loss)
    assert logprobs.grad.tolist() == [[-1.5, 0.0]]  # d/dlogp of -1.5 * exp(logp - old) at ratio 1


# ---- the registry: weigh(stats) ------------------------------------------------------------------

def _stats(**kw) -> TokenStats:
    logprobs = torch.log(torch.tensor([[0.5, 0.1, 0.9, 0.2], [0.3, 0.05, 0.6, 0.7]]))
    base = dict(logprobs=logprobs, entropy=torch.full((2, 4), 0.1), advantages=torch.tensor([1.0, -1.0]),
                response_mask=torch.tensor([[T_, T_, T_, F_], [T_, T_, T_, T_]]))
    return TokenStats(**{**base, **kw})


def test_plain_mask_result_carries_keep_as_weights():
    result = build_mask("stapo", tau_p=0.2).apply(_stats())
    assert torch.equal(result.weights, result.keep.float())
    assert not result.upweighted.any() and not result.downweighted.any()


def test_user_weighting_strategy(clean_registry):
    @register_mask("half_negatives")
    class HalfNegatives(TokenMask):
        """Halve the weight of negative-advantage tokens, silence those with p < floor."""

        floor: float = 0.08

        def weigh(self, stats):
            w = torch.where(stats.advantages_bt < 0, 0.5, 1.0)
            return torch.where(stats.logprobs < math.log(self.floor), 0.0, w), {"floor": torch.tensor(self.floor)}

    result = build_mask("half_negatives").apply(_stats())
    # row 0 (A = +1): weights 1, 1, 1 and padding 0; row 1 (A = -1): 0.5, 0 (p = 0.05 < 0.08), 0.5, 0.5
    assert result.weights.tolist() == [[1.0, 1.0, 1.0, 0.0], [0.5, 0.0, 0.5, 0.5]]
    assert result.keep.tolist() == [[T_, T_, T_, F_], [T_, F_, T_, T_]]
    assert result.silenced.tolist() == [[F_, F_, F_, F_], [F_, T_, F_, F_]]
    assert result.downweighted.sum().item() == 3 and not result.upweighted.any()
    assert result.thresholds["floor"].item() == pytest.approx(0.08)


def test_weigh_output_is_checked(clean_registry):
    @register_mask("bool_weights")
    class BoolWeights(TokenMask):
        def weigh(self, stats):
            return stats.response_mask

    @register_mask("negative_weights")
    class NegativeWeights(TokenMask):
        def weigh(self, stats):
            return -torch.ones_like(stats.logprobs)

    with pytest.raises(TypeError, match="BoolWeights.weigh must return a float tensor"):
        build_mask("bool_weights").apply(_stats())
    with pytest.raises(ValueError, match="NegativeWeights.weigh returned 7 weight"):
        build_mask("negative_weights").apply(_stats())
    with pytest.raises(NotImplementedError, match="silence\\(stats\\) or weigh\\(stats\\)"):
        TokenMask().apply(_stats())


# ---- global selections ---------------------------------------------------------------------------

def test_top_ratio_count_follows_the_released_rounding():
    assert [top_ratio_count(n, 0.1) for n in (0, 1, 9, 10, 11, 30, 31)] == [0, 1, 1, 1, 2, 3, 4]
    assert 0.07 * 100 > 7 and top_ratio_count(100, 0.07) == 7  # math.ceil of the float product: 8
    assert top_ratio_count(5, 1.0) == 5


def test_top_k_breaks_ties_by_position():
    values = torch.tensor([[3.0, 1.0, 3.0], [3.0, 5.0, 0.0]])
    candidates = torch.tensor([[T_, T_, T_], [T_, T_, F_]])
    # 5 candidates, ratio 0.5: k = ceil(2.5) = 3: the 5, then two of the three 3s, first in row-major order
    assert global_top_k(values, candidates, 0.5).tolist() == [[T_, F_, T_], [F_, T_, F_]]


def test_random_pick_is_seeded_and_stays_in_the_candidates():
    candidates = torch.rand(8, 9, generator=torch.Generator().manual_seed(0)) > 0.5
    a = global_random_pick(candidates, 5, seed=11)
    assert torch.equal(a, global_random_pick(candidates, 5, seed=11))
    assert not torch.equal(a, global_random_pick(candidates, 5, seed=12))
    assert a.sum().item() == 5 and not (a & ~candidates).any()
    assert global_random_pick(candidates, 10_000, seed=1).sum().item() == candidates.sum().item()


# ---- stare ----------------------------------------------------------------------------------------

def released_stare_weights(log_prob, advantages, response_mask, variant, top_ratio, w, m, gate_on):
    """Independent transcription of the released per-batch selection (one micro-batch, one rank)."""
    weights = torch.ones_like(advantages)
    valid = response_mask > 0
    surprisal = -log_prob.detach()

    def top(candidates):
        chosen = torch.zeros_like(candidates)
        n = int(candidates.sum())
        if n == 0:
            return chosen
        k = min(max(1, int(n * top_ratio + 0.999999)), n)
        idx = torch.topk(surprisal[candidates], k=k).indices
        chosen.view(-1)[candidates.view(-1).nonzero().squeeze(-1)[idx]] = True
        return chosen

    plus = top(valid & (advantages > 0))
    minus = top(valid & (advantages < 0)) if variant == "C2" else torch.zeros_like(valid)
    if gate_on:
        weights = torch.where(plus, torch.full_like(weights, w), weights)
        if variant == "C2":
            weights = torch.where(minus, torch.full_like(weights, m), weights)
    return weights


def released_stare_loss(old_log_prob, log_prob, advantages, response_mask, weights, clip_low, clip_high, clip_c):
    """The released ``compute_policy_loss_stare`` with token-mean aggregation."""
    ratio = torch.exp(torch.clamp(log_prob - old_log_prob, -20.0, 20.0))
    loss1 = -advantages * ratio
    loss2 = -advantages * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
    clipped = torch.maximum(loss1, loss2)
    dual = torch.min(-advantages * clip_c, clipped)
    per_token = torch.where(advantages < 0, dual, clipped) * weights
    return (per_token * response_mask).sum() / response_mask.sum()


@pytest.mark.parametrize("variant", ["O1", "C2"])
@pytest.mark.parametrize("top_p_ratio", [0.1, 0.35, 1.0])
def test_stare_equals_the_released_per_batch_formula(variant, top_p_ratio):
    for seed in range(6):
        logprobs, old, adv, mask = _random_batch(seed, per_token_adv=seed % 2 == 1)
        adv_bt = adv if adv.dim() == 2 else adv[:, None].expand_as(logprobs)
        for entropy, gate_on in ((0.1, True), (0.3, False), (2.0, False)):  # strict H < 0.3
            mask_ = build_mask("stare", variant=variant, top_p_ratio=top_p_ratio)
            stats = TokenStats(logprobs, torch.zeros_like(logprobs), adv, mask, batch_entropy=entropy)
            result = mask_.apply(stats)
            want = released_stare_weights(logprobs, adv_bt, mask, variant, top_p_ratio, 1.1, 0.9, gate_on)
            assert torch.equal(result.weights, torch.where(mask, want, 0.0)), (seed, entropy)
            assert result.thresholds["gate"].item() == float(gate_on)
            ours, _ = clipped_surrogate_loss(logprobs, old, adv, result.keep, clip_c=3.0, weights=result.weights)
            theirs = released_stare_loss(old, logprobs, adv_bt, mask.float(), want, 0.2, 0.28, 3.0)
            torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-7)
            if gate_on:
                assert result.upweighted.sum() == top_ratio_count(int((mask & (adv_bt > 0)).sum()), top_p_ratio)
                down = top_ratio_count(int((mask & (adv_bt < 0)).sum()), top_p_ratio) if variant == "C2" else 0
                assert result.downweighted.sum() == down
            else:  # gate off: exactly GRPO
                assert torch.equal(result.weights, mask.float())


def test_stare_hand_built():
    # A > 0 row: surprisals -log(0.5, 0.1, 0.9) = 0.69, 2.30, 0.11 -> k = ceil(0.5 * 3) = 2: p = 0.1 and 0.5
    # A < 0 row: surprisals of p = 0.3, 0.05, 0.6, 0.7 -> k = ceil(0.5 * 4) = 2: p = 0.05 and 0.3
    stats = _stats(batch_entropy=0.2)
    o1 = build_mask("stare", top_p_ratio=0.5).apply(stats)
    torch.testing.assert_close(o1.weights, torch.tensor([[1.1, 1.1, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0]]))
    c2 = build_mask("stare", variant="c2", top_p_ratio=0.5, reweight_m=0.5).apply(stats)
    torch.testing.assert_close(c2.weights, torch.tensor([[1.1, 1.1, 1.0, 0.0], [0.5, 0.5, 1.0, 1.0]]))
    # the weighted token-mean at ratio 1: -(1.1 + 1.1 + 1) on row 0, +(0.5 + 0.5 + 1 + 1) on row 1, over 7 tokens
    loss, _ = clipped_surrogate_loss(stats.logprobs, stats.logprobs, stats.advantages, c2.keep, weights=c2.weights)
    assert loss.item() == pytest.approx((-3.2 + 3.0) / 7)


def test_stare_adaptive_schedule_and_state():
    mask = build_mask("stare", adaptive=True, alpha=0.25, w_max=1.5, m_min=0.5)
    seen = []
    for entropy in (0.1, 0.1, 0.1, 0.5, float("nan"), 0.3):
        mask.start_step(entropy)
        seen.append((mask.state_dict()["reweight_w"], mask.state_dict()["reweight_m"], mask.state_dict()["gate_on"]))
    # W: 1.1 +0.25 -> 1.35, +0.25 -> 1.5 (w_max), 1.5, then H > target: -0.25 -> 1.25; NaN: unchanged;
    # H = target: sgn 0 -> unchanged, gate off (strict <). M: 0.9 -0.25 -> 0.65, 0.5 (m_min), 0.5, 0.75, 0.75, 0.75
    assert seen == [(pytest.approx(1.35), pytest.approx(0.65), True), (1.5, 0.5, True), (1.5, 0.5, True),
                    (1.25, 0.75, False), (1.25, 0.75, False), (1.25, 0.75, False)]
    restored = build_mask("stare", adaptive=True, alpha=0.25)
    restored.load_state_dict(mask.state_dict())
    assert restored.state_dict() == mask.state_dict()
    stats = _stats(batch_entropy=0.1)
    assert torch.equal(restored.apply(stats).weights, mask.apply(stats).weights)
    assert mask.apply(stats).weights.max().item() == pytest.approx(1.25)
    static = build_mask("stare")
    static.start_step(0.1)
    assert static.state_dict()["reweight_w"] == 1.1  # not adaptive: the weights stay
    # no batch entropy in the stats: the controller's gate (off after H = 0.3 above)
    assert mask.apply(_stats()).thresholds["gate"].item() == 0.0


@pytest.mark.parametrize("params, match", [
    ({"top_p_ratio": 0.0}, "top_p_ratio must be in \\(0, 1\\]"),
    ({"top_p_ratio": 1.5}, "top_p_ratio must be in \\(0, 1\\]"),
    ({"variant": "O2"}, "variant must be one of O1, C2"),
    ({"reweight_w": float("inf")}, "reweight_w must be a finite number"),
    ({"reweight_m": -0.1}, "reweight_m >= 0"),
    ({"w_max": 0.9}, "w_max >= 1"),
    ({"m_min": 1.5}, "0 <= m_min <= 1"),
    ({"adaptive": "yes"}, "adaptive must be true or false"),
])
def test_stare_parameter_errors(params, match):
    with pytest.raises(ValueError, match=match):
        build_mask("stare", **params)


# ---- clip_cov ------------------------------------------------------------------------------------

def test_clip_cov_covariance_and_band_hand_built():
    # A = +1, -1 (4 and 4 valid tokens; mean A = 0); log p of row 0 = 0 0 0 -8 (mean of all 8 = -2)
    logprobs = torch.tensor([[0.0, 0.0, 0.0, -8.0], [-2.0, -2.0, -2.0, -2.0]])
    stats = TokenStats(logprobs, torch.zeros(2, 4), torch.tensor([1.0, -1.0]), torch.ones(2, 4, dtype=torch.bool),
                       seed=0)
    cov = token_covariance(stats)
    # row 0: (1 - 0)(0 + 2) = 2 three times, (1)(-8 + 2) = -6; row 1: (-1)(-2 + 2) = 0
    assert cov.tolist() == [[2.0, 2.0, 2.0, -6.0], [0.0, 0.0, 0.0, 0.0]]
    # ratio 0.25 of N = 8: int(2) = 2 of the three band tokens (1 < cov < 5) get weight 0
    result = build_mask("clip_cov", ratio=0.25).apply(stats)
    assert result.silenced.sum().item() == 2 and not (result.silenced[:, 3:].any() or result.silenced[1].any())
    assert torch.equal(result.weights, result.keep.float())
    # a tiny ratio still zeroes one token (max(1, int(2e-4 * 8)) = 1)
    assert build_mask("clip_cov").apply(stats).silenced.sum().item() == 1
    # the same seed draws the same tokens; the band excludes tokens the ratio already clips
    assert torch.equal(result.keep, build_mask("clip_cov", ratio=0.25).apply(stats).keep)
    old = logprobs.clone()
    old[0, :2] -= 1.0  # rho = e > 1 + 0.28 with A > 0: clipped, out of the band
    clipped = TokenStats(logprobs, torch.zeros(2, 4), stats.advantages, stats.response_mask, old_logprobs=old,
                         clip_range=(0.2, 0.28), seed=0)
    assert ratio_clipped(clipped).tolist() == [[T_, T_, F_, F_], [F_, F_, F_, F_]]
    assert build_mask("clip_cov", ratio=0.25).apply(clipped).silenced.tolist() == [[F_, F_, T_, F_], [F_] * 4]


def test_clip_cov_needs_a_seed_and_valid_parameters():
    with pytest.raises(ValueError, match="TokenStats.seed must be set"):
        build_mask("clip_cov").apply(_stats())
    for params, match in (({"ratio": 0.0}, "ratio must be in"), ({"lb": 5.0, "ub": 1.0}, "lb < ub"),
                          ({"ub": float("nan")}, "ub must be a finite number")):
        with pytest.raises(ValueError, match=match):
            build_mask("clip_cov", **params)

