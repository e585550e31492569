"""Token masks: hand-built tables, invariants and the registry (paper §3.3, Algorithm 1 l.10)."""

import dataclasses
import math
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from stapo.losses import (
    TokenMask,
    TokenStats,
    available_masks,
    build_mask,
    describe_masks,
    mask_params,
    register_mask,
)

BUILTINS = ["none", "stapo", "prob_only", "high_entropy_low_prob", "entropy_top"]
T, F = True, False


def table_stats() -> TokenStats:
    """B=2, T=4; row 0 has A=+1, row 1 has A=-1; (1, 3) is padding.

    Valid entropies sorted: .05 .1 .2 .3 2 3 4 (n=7). q=0.8 -> rank 0.8*6 = 4.8 ->
    tau_h = 2 + 0.8 * (3 - 2) = 2.8. (Had the padding's H=9 leaked in: n=8, rank 5.6,
    tau_h = 3.6, and token (0, 2) with H=3 would flip.)
    """
    p = torch.tensor([[1e-4, 0.5, 1e-3, 1e-4], [1e-4, 0.9, 1e-4, 1e-4]])
    entropy = torch.tensor([[0.1, 2.0, 3.0, 0.2], [0.3, 0.05, 4.0, 9.0]])
    valid = torch.tensor([[T, T, T, T], [T, T, T, F]])
    return TokenStats(p.log(), entropy, torch.tensor([1.0, -1.0]), valid)


EXPECTED_KEEP = {
    # row 0 (A > 0): (0,0) p<tau_p,H=.1<2.8 ; (0,1) p=.5 ; (0,2) p=1e-3<2e-3,H=3>=2.8 ; (0,3) p<tau_p,H=.2
    # row 1 (A < 0): advantage-gated masks keep all valid tokens; padding is never kept
    "none": [[T, T, T, T], [T, T, T, F]],
    "stapo": [[F, T, T, F], [T, T, T, F]],
    "prob_only": [[F, T, F, F], [T, T, T, F]],
    "high_entropy_low_prob": [[T, T, F, T], [T, T, T, F]],
    # entropy_top silences every H < 2.8: keeps only H=3 and H=4 (2 of 7 ~ top 20%)
    "entropy_top": [[F, F, T, F], [F, F, T, F]],
}


@pytest.mark.parametrize("name", BUILTINS)
def test_builtin_table(name):
    stats = table_stats()
    mask = build_mask(name)
    result = mask.apply(stats)
    expected = torch.tensor(EXPECTED_KEEP[name])
    assert torch.equal(result.keep, expected)
    assert torch.equal(mask(stats), expected)  # __call__ == mask == apply().keep
    assert torch.equal(result.silenced, stats.response_mask & ~expected)
    if name in ("stapo", "high_entropy_low_prob", "entropy_top"):
        torch.testing.assert_close(result.thresholds["tau_h"], torch.tensor(2.8))
    else:
        assert result.thresholds == {}


def test_entropy_boundary_and_tau_p_boundary():
    # A=+1, p=1e-4 everywhere, H = [.1, .2, .3]; q=.5 -> rank 1 -> tau_h = .2 exactly.
    # H == tau_h is "high" entropy: stapo silences only H=.1, high_entropy_low_prob silences .2 and .3.
    stats = TokenStats(
        torch.full((1, 3), math.log(1e-4)), torch.tensor([[0.1, 0.2, 0.3]]), torch.ones(1), torch.ones(1, 3, dtype=torch.bool)
    )
    assert build_mask("stapo", entropy_quantile=0.5)(stats).tolist() == [[F, T, T]]
    assert build_mask("high_entropy_low_prob", entropy_quantile=0.5)(stats).tolist() == [[T, F, F]]
    assert build_mask("entropy_top", entropy_quantile=0.5)(stats).tolist() == [[F, T, T]]
    # p exactly tau_p is not "p < tau_p" (log-space comparison)
    at_tau = TokenStats(torch.full((1, 2), math.log(2e-3)), torch.zeros(1, 2), torch.ones(1), torch.ones(1, 2, dtype=torch.bool))
    assert build_mask("prob_only")(at_tau).all()


def test_per_token_advantages_and_tau_p_log_space():
    # (B, T) advantages: only the positive-advantage low-probability token is silenced by prob_only.
    # p = 1e-30 would underflow nothing in log space; tau_p = 1 silences any p < 1.
    logp = torch.tensor([[-69.0, -69.0, 0.0]])  # p ~ 1e-30, 1e-30, 1
    adv = torch.tensor([[0.5, -0.5, 0.5]])
    stats = TokenStats(logp, torch.zeros(1, 3), adv, torch.ones(1, 3, dtype=torch.bool))
    assert build_mask("prob_only")(stats).tolist() == [[F, T, T]]
    assert build_mask("prob_only", tau_p=1.0)(stats).tolist() == [[F, T, T]]  # p = 1 is not < 1


def random_stats(seed: int, b: int, t: int, adv_per_token: bool = False) -> TokenStats:
    g = torch.Generator().manual_seed(seed)
    logprobs = -torch.rand(b, t, generator=g) * 12  # p in [6e-6, 1]
    entropy = torch.rand(b, t, generator=g) * 3
    shape = (b, t) if adv_per_token else (b,)
    advantages = torch.randint(-1, 2, shape, generator=g).float()
    lengths = torch.randint(0, t + 1, (b,), generator=g)
    valid = torch.arange(t)[None, :] < lengths[:, None]
    logprobs = torch.where(valid, logprobs, torch.tensor(float("nan")))  # padding may be garbage
    return TokenStats(logprobs, entropy, advantages, valid)


@settings(max_examples=40, deadline=None)
@given(
    seed=st.integers(0, 10_000),
    b=st.integers(1, 6),
    t=st.integers(1, 12),
    per_token=st.booleans(),
    name=st.sampled_from(BUILTINS),
    q=st.floats(0.0, 1.0),
)
def test_never_keeps_padding_and_stapo_only_positive(seed, b, t, per_token, name, q):
    stats = random_stats(seed, b, t, per_token)
    params = {k: v for k, v in {"entropy_quantile": q, "tau_p": 0.05}.items() if k in mask_params(name)}
    result = build_mask(name, **params).apply(stats)
    assert result.keep.dtype == torch.bool and result.keep.shape == (b, t)
    assert not (result.keep & ~stats.response_mask).any()
    assert torch.equal(result.silenced, stats.response_mask & ~result.keep)
    if name in ("stapo", "prob_only", "high_entropy_low_prob"):
        assert not (result.silenced & (stats.advantages_bt <= 0)).any()
    if name == "stapo":  # stapo silences a subset of prob_only's
        wider = build_mask("prob_only", tau_p=0.05).apply(stats).silenced
        assert not (result.silenced & ~wider).any()


@pytest.mark.parametrize("q", [0.0, 0.2, 0.5, 0.8, 0.95, 1.0])
def test_entropy_top_keeps_top_fraction(q):
    stats = random_stats(3, 16, 64)
    n = int(stats.response_mask.sum())
    kept = int(build_mask("entropy_top", entropy_quantile=q)(stats).sum())
    # distinct entropies: tau_h lies between order statistics lo = floor(q (n-1)) and lo + 1
    assert abs(kept - (1 - q) * n) <= 1.0


def test_empty_batch_is_defined():
    stats = TokenStats(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2), torch.zeros(2, 3, dtype=torch.bool))
    for name in BUILTINS:
        result = build_mask(name).apply(stats)
        assert not result.keep.any() and not result.silenced.any()
    assert build_mask("stapo").apply(stats).thresholds["tau_h"] == float("inf")


def test_token_stats_validation_and_broadcast():
    ok = torch.zeros(2, 3)
    valid = torch.ones(2, 3, dtype=torch.bool)
    assert TokenStats(ok, ok, torch.tensor([1.0, -1.0]), valid).advantages_bt.tolist() == [[1.0] * 3, [-1.0] * 3]
    with pytest.raises(ValueError, match="entropy"):
        TokenStats(ok, torch.zeros(2, 4), torch.zeros(2), valid)
    with pytest.raises(ValueError, match="advantages"):
        TokenStats(ok, ok, torch.zeros(3), valid)
    with pytest.raises(ValueError, match="bool"):
        TokenStats(ok, ok, torch.zeros(2), valid.float())
    with pytest.raises(ValueError, match=r"\(B, T\)"):
        TokenStats(torch.zeros(6), torch.zeros(6), torch.zeros(6), torch.ones(6, dtype=torch.bool))


def test_user_subclass_in_ten_lines(clean_registry):
    @register_mask("neg_low_prob")
    @dataclass
    class NegLowProb(TokenMask):
        """Silence negative-advantage tokens with p < tau_p."""

        tau_p: float = 1e-3

        def silence(self, stats: TokenStats):
            return (stats.advantages_bt < 0) & (stats.logprobs < math.log(self.tau_p))

    assert "neg_low_prob" in available_masks()
    assert mask_params("neg_low_prob") == {"tau_p": 1e-3}
    # table: row 1 (A<0) tokens with p < 1e-3: (1,0) and (1,2); (1,3) is padding anyway
    keep = build_mask("neg_low_prob")(table_stats())
    assert keep.tolist() == [[T, T, T, T], [F, T, F, F]]
    assert build_mask("neg_low_prob", tau_p=1e-5)(table_stats()).tolist() == EXPECTED_KEEP["none"]


def test_register_without_dataclass_decorator(clean_registry):
    @register_mask("first_token")
    class FirstToken(TokenMask):
        """Silence position 0."""

        width: int = 1

        def silence(self, stats):
            return torch.arange(stats.logprobs.shape[1]) < self.width

    assert dataclasses.is_dataclass(FirstToken)
    assert build_mask("first_token", width=2)(table_stats()).tolist() == [[F, F, T, T], [F, F, T, F]]


def test_registry_errors(clean_registry):
    with pytest.raises(ValueError, match="available masks: (.*, )?entropy_top, high_entropy_low_prob, none"):
        build_mask("stapo2")
    with pytest.raises(ValueError, match=r"unknown parameter\(s\) \['tau'\].*tau_p=0.002, entropy_quantile=0.8"):
        build_mask("stapo", tau=0.1)
    with pytest.raises(ValueError, match="valid parameters: \\(none\\)"):
        build_mask("none", tau_p=0.1)
    with pytest.raises(ValueError, match="already registered"):

        @register_mask("stapo")
        class Other(TokenMask):
            def silence(self, stats):
                return torch.zeros_like(stats.response_mask)

    stapo_cls = type(build_mask("stapo"))
    assert register_mask("stapo")(stapo_cls) is stapo_cls  # same class again: fine
    with pytest.raises(TypeError, match="TokenMask subclass"):
        register_mask("x")(int)

    @register_mask("bad_dtype")
    class BadDtype(TokenMask):
        def silence(self, stats):
            return stats.entropy  # float, not bool

    with pytest.raises(TypeError, match="BadDtype.silence must return a bool tensor"):
        build_mask("bad_dtype")(table_stats())


@pytest.mark.parametrize(
    "name, params, match",
    [
        ("stapo", {"tau_p": 0.0}, "tau_p"),
        ("stapo", {"tau_p": 1.5}, "tau_p"),
        ("prob_only", {"tau_p": -1e-3}, "tau_p"),
        ("stapo", {"entropy_quantile": 1.2}, "entropy_quantile"),
        ("entropy_top", {"entropy_quantile": -0.1}, "entropy_quantile"),
        ("high_entropy_low_prob", {"entropy_quantile": 2}, "entropy_quantile"),
    ],
)
def test_param_validation(name, params, match):
    with pytest.raises(ValueError, match=match):
        build_mask(name, **params)


def test_describe_masks_lists_params_and_defaults(clean_registry):
    infos = {i.name: i for i in describe_masks()}
    assert sorted(infos) == sorted(BUILTINS + ["stare", "clip_cov"])  # + the token-weighting built-ins
    assert infos["stapo"].params == {"tau_p": 2e-3, "entropy_quantile": 0.8}
    assert infos["entropy_top"].params == {"entropy_quantile": 0.8}
    assert infos["none"].params == {}
    assert "tau_h" in infos["stapo"].summary
