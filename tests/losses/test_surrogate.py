"""Clipped surrogate (paper Eq. 1) and its three aggregations, hand-computed + invariants."""

import math

import pytest
import torch

from stapo.losses import aggregate_loss, build_mask, clipped_surrogate_loss, TokenStats

NAN, INF = float("nan"), float("inf")


def one_row(ratios, adv, **kw):
    """Single sequence, keep-all, token-mean; per-token ratios given directly."""
    r = torch.tensor([ratios])
    logprobs = r.log().requires_grad_()
    loss, metrics = clipped_surrogate_loss(
        logprobs, torch.zeros_like(r), torch.tensor([adv]), torch.ones_like(r, dtype=torch.bool), **kw
    )
    loss.backward()
    return loss, metrics, logprobs.grad


def test_positive_advantage_cases():
    # A = +1, eps = [0.2, 0.28]:
    #  rho 1.1 -> inside, surrogate 1.1 (grad d(-rho)/dlogp = -1.1 / 3 tokens)
    #  rho 1.5 -> min(1.5, 1.28) = 1.28 clipped high, zero grad
    #  rho 0.5 -> min(0.5, 0.8) = 0.5 unclipped, grad -0.5 / 3
    loss, m, grad = one_row([1.1, 1.5, 0.5], [1.0, 1.0, 1.0])
    torch.testing.assert_close(loss, torch.tensor(-(1.1 + 1.28 + 0.5) / 3))
    torch.testing.assert_close(grad, torch.tensor([[-1.1 / 3, 0.0, -0.5 / 3]]))
    assert m["clip_high_count"] == 1 and m["clip_low_count"] == 0 and m["kept_tokens"] == 3
    torch.testing.assert_close(m["ratio_sum"], torch.tensor(3.1))
    torch.testing.assert_close(m["pg_loss_sum"], torch.tensor(-(1.1 + 1.28 + 0.5)))


def test_negative_advantage_cases():
    # A = -1:
    #  rho 0.5 -> min(-0.5, -0.8) = -0.8: clipped low, loss +0.8, zero grad
    #  rho 1.5 -> min(-1.5, -1.28) = -1.5: unclipped, loss +1.5, grad +1.5/3
    #  rho 1.1, A = -2 -> min(-2.2, -2.2) = -2.2, loss 2.2, grad 2.2/3
    loss, m, grad = one_row([0.5, 1.5, 1.1], [-1.0, -1.0, -2.0])
    torch.testing.assert_close(loss, torch.tensor((0.8 + 1.5 + 2.2) / 3))
    torch.testing.assert_close(grad, torch.tensor([[0.0, 1.5 / 3, 2.2 / 3]]))
    assert m["clip_low_count"] == 1 and m["clip_high_count"] == 0 and m["dual_clip_count"] == 0


def test_dual_clip():
    # A = -1, clip_c = 3: per-token loss min(pg, 3 * 1)
    #  rho 4   -> pg = 4 > 3: capped at 3 (dual clip, zero grad)
    #  rho 1.5 -> pg = 1.5 (grad 1.5 / 3)
    #  A = +1, rho 4 -> pg = -1.28 (positive advantages are never dual-clipped)
    loss, m, grad = one_row([4.0, 1.5, 4.0], [-1.0, -1.0, 1.0], clip_c=3.0)
    torch.testing.assert_close(loss, torch.tensor((3.0 + 1.5 - 1.28) / 3))
    torch.testing.assert_close(grad, torch.tensor([[0.0, 1.5 / 3, 0.0]]))
    assert m["dual_clip_count"] == 1 and m["clip_high_count"] == 1
    no_dual, _, _ = one_row([4.0, 1.5, 4.0], [-1.0, -1.0, 1.0])
    torch.testing.assert_close(no_dual, torch.tensor((4.0 + 1.5 - 1.28) / 3))
    with pytest.raises(ValueError, match="clip_c"):
        one_row([1.0], [1.0], clip_c=1.0)


# Aggregations: ratio 1 everywhere, so per-token loss = -A.
# A = [[1, 2, 3], [4, 5, 6]], keep = [[T, T, F], [T, F, F]]
ADV = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
KEEP = torch.tensor([[True, True, False], [True, False, False]])


@pytest.mark.parametrize(
    "agg, kw, expected",
    [
        ("token-mean", {}, -(1 + 2 + 4) / 3),  # kept sum 7 over 3 kept tokens
        ("token-mean", {"normalizer": 10}, -7 / 10),  # global count passed by the trainer
        ("seq-mean-token-mean", {}, -(1.5 + 4.0) / 2),  # rows: (1+2)/2, 4/1; mean over B=2
        ("seq-mean-token-mean", {"normalizer": 4}, -(1.5 + 4.0) / 4),
        ("seq-mean-token-sum-norm", {}, -(3 / 3 + 4 / 3) / 2),  # rows / T=3, mean over B=2
        ("seq-mean-token-sum-norm", {"max_response_length": 6}, -(3 / 6 + 4 / 6) / 2),
        ("seq-mean-token-sum-norm", {"max_response_length": 6, "normalizer": torch.tensor(1.0)}, -(3 / 6 + 4 / 6)),
    ],
)
def test_aggregations(agg, kw, expected):
    zeros = torch.zeros(2, 3)
    loss, _ = clipped_surrogate_loss(zeros, zeros, ADV, KEEP, agg=agg, **kw)
    torch.testing.assert_close(loss, torch.tensor(expected))


def test_unknown_agg_and_shape_errors():
    z = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="agg must be one of"):
        clipped_surrogate_loss(z, z, ADV, KEEP, agg="mean")
    with pytest.raises(ValueError, match="keep must be a bool"):
        clipped_surrogate_loss(z, z, ADV, KEEP.float())
    with pytest.raises(ValueError, match="old_logprobs shape"):
        clipped_surrogate_loss(z, torch.zeros(2, 4), ADV, KEEP)
    with pytest.raises(ValueError, match="advantages must be"):
        clipped_surrogate_loss(z, z, torch.zeros(3), KEEP)


def dapo_reference(logprobs, old, adv, mask, eps_low=0.2, eps_high=0.28):
    """Straightforward DAPO token-mean loss, written independently of stapo."""
    total, count = 0.0, 0
    for i in range(logprobs.shape[0]):
        for t in range(logprobs.shape[1]):
            if mask[i, t]:
                ratio = torch.exp(logprobs[i, t] - old[i, t])
                clipped = torch.clamp(ratio, 1 - eps_low, 1 + eps_high)
                total = total + torch.min(ratio * adv[i], clipped * adv[i])
                count += 1
    return -total / count


def random_batch(seed, b=4, t=7):
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(b, t, generator=g) * 3
    logprobs = old + torch.randn(b, t, generator=g) * 0.3
    adv = torch.randn(b, generator=g)
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    valid = torch.arange(t)[None, :] < lengths[:, None]
    return logprobs, old, adv, valid


@pytest.mark.parametrize("seed", range(3))
def test_none_mask_token_mean_equals_dapo(seed):
    logprobs, old, adv, valid = random_batch(seed)
    keep = build_mask("none")(TokenStats(logprobs, torch.zeros_like(old), adv, valid))
    lp1 = logprobs.clone().requires_grad_()
    loss, _ = clipped_surrogate_loss(lp1, old, adv, keep)
    loss.backward()
    lp2 = logprobs.clone().requires_grad_()
    ref = dapo_reference(lp2, old, adv, valid)
    ref.backward()
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(lp1.grad, lp2.grad)


def test_silenced_tokens_zero_grad_and_renormalized():
    logprobs, old, adv, valid = random_batch(7)
    keep = valid.clone()
    keep[0, 0] = keep[2, 1] = False  # silenced, with garbage values that must not leak
    lp = logprobs.clone()
    lp[0, 0], lp[2, 1] = NAN, INF
    lp[~valid] = -INF  # padding too
    lp.requires_grad_()
    loss, metrics = clipped_surrogate_loss(lp, old, adv, keep, clip_c=3.0, ref_logprobs=old, kl_coef=0.1)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(lp.grad).all()
    assert lp.grad[~keep].eq(0).all()  # EXACTLY zero, not 0 * nan
    assert all(torch.isfinite(v) for v in metrics.values())
    # renormalization: same as the loss over only the kept tokens, packed into one row
    packed = lambda x: x[keep][None, :]  # noqa: E731
    adv_bt = adv[:, None].expand_as(keep)
    ones = torch.ones(1, int(keep.sum()), dtype=torch.bool)
    loss_kept, _ = clipped_surrogate_loss(
        packed(logprobs), packed(old), packed(adv_bt), ones, clip_c=3.0, ref_logprobs=packed(old), kl_coef=0.1
    )
    torch.testing.assert_close(loss, loss_kept)


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_empty_keep_gives_zero_loss_and_finite_grads(agg):
    logprobs, old, adv, _ = random_batch(1)
    lp = logprobs.clone().requires_grad_()
    keep = torch.zeros_like(lp, dtype=torch.bool)
    for normalizer in (None, 0, torch.tensor(0.0)):
        loss, metrics = clipped_surrogate_loss(lp, old, adv, keep, agg=agg, normalizer=normalizer, ref_logprobs=old, kl_coef=0.5)
        assert loss.requires_grad and loss.item() == 0.0
        (grad,) = torch.autograd.grad(loss, lp)
        assert torch.equal(grad, torch.zeros_like(grad))
        assert metrics["kept_tokens"] == 0 and metrics["pg_loss_sum"] == 0


def test_micro_batches_with_global_normalizer_add_up():
    # token-mean over a mini-batch == sum of micro-batch losses with the global kept count
    logprobs, old, adv, keep = random_batch(11, b=6)
    full, _ = clipped_surrogate_loss(logprobs, old, adv, keep)
    total = keep.sum()
    parts = [clipped_surrogate_loss(logprobs[s], old[s], adv[s], keep[s], normalizer=total)[0] for s in (slice(0, 2), slice(2, 6))]
    torch.testing.assert_close(parts[0] + parts[1], full)


def test_k3_kl_term():
    # rho = 1 (logprobs == old) and A = 0 -> surrogate 0; ref - logp = log 2:
    # k3 = exp(log 2) - log 2 - 1 = 1 - ln 2 = 0.306853; loss = 0.1 * k3 (token-mean of a constant)
    logp = torch.full((1, 2), math.log(0.5))
    loss, metrics = clipped_surrogate_loss(
        logp, logp, torch.zeros(1), torch.ones(1, 2, dtype=torch.bool), ref_logprobs=torch.zeros(1, 2), kl_coef=0.1
    )
    torch.testing.assert_close(loss, torch.tensor(0.1 * (1 - math.log(2))))
    torch.testing.assert_close(metrics["kl_sum"], torch.tensor(2 * (1 - math.log(2))))
    # approx_kl (old vs new) = 0 when nothing moved
    assert metrics["approx_kl_sum"] == 0


def test_approx_kl_metric_and_metric_types():
    # new logp = old + log 2 (rho = 2): k3(old vs new) = exp(-ln 2) + ln 2 - 1 = 0.5 + 0.693147 - 1
    old = torch.zeros(1, 1)
    _, m = clipped_surrogate_loss(old + math.log(2), old, torch.ones(1), torch.ones(1, 1, dtype=torch.bool))
    torch.testing.assert_close(m["approx_kl_sum"], torch.tensor(math.log(2) - 0.5))
    assert set(m) == {"pg_loss_sum", "kept_tokens", "clip_low_count", "clip_high_count", "dual_clip_count", "approx_kl_sum", "ratio_sum"}
    for v in m.values():
        assert isinstance(v, torch.Tensor) and v.dim() == 0 and not v.requires_grad


def test_log_ratio_clamp_keeps_kept_tokens_finite():
    # a kept token with log ratio 100: clamped at 20, loss finite, clipped high -> zero grad
    lp = torch.tensor([[100.0]], requires_grad=True)
    loss, _ = clipped_surrogate_loss(lp, torch.zeros(1, 1), torch.ones(1), torch.ones(1, 1, dtype=torch.bool))
    loss.backward()
    torch.testing.assert_close(loss, torch.tensor(-1.28))
    assert lp.grad.item() == 0.0


def test_aggregate_loss_is_the_one_normalizer():
    x = torch.tensor([[1.0, NAN], [3.0, 5.0]])
    keep = torch.tensor([[True, False], [True, True]])
    torch.testing.assert_close(aggregate_loss(x, keep), torch.tensor(3.0))  # (1+3+5)/3
    torch.testing.assert_close(aggregate_loss(x, keep, "seq-mean-token-mean"), torch.tensor((1 + 4) / 2))


# ----------------------------------------------------------------------------- token weights (IS)
def test_is_weights_scale_each_token_after_clipping():
    # A = +1, rho = [1.1, 1.5, 0.5], w = [2, 0.5, 1]:
    #  surrogate per token (clip-higher 1.28): -[1.1, 1.28, 0.5]; weighted: -[2.2, 0.64, 0.5]
    #  loss = -(2.2 + 0.64 + 0.5) / 3; grads: -1.1*2/3, 0 (clipped), -0.5*1/3
    w = torch.tensor([[2.0, 0.5, 1.0]])
    loss, m, grad = one_row([1.1, 1.5, 0.5], [1.0, 1.0, 1.0], weights=w)
    torch.testing.assert_close(loss, torch.tensor(-(2.2 + 0.64 + 0.5) / 3))
    torch.testing.assert_close(grad, torch.tensor([[-2.2 / 3, 0.0, -0.5 / 3]]))
    torch.testing.assert_close(m["pg_loss_sum"], torch.tensor(-(2.2 + 0.64 + 0.5)))
    assert m["kept_tokens"] == 3  # weights never change the normalizer


def test_is_weights_multiply_the_dual_clip_cap():
    # A = -1, rho = 5, clip_c = 3: PPO loss max(5, clip(5)=1.28) = 5, dual-clip cap 3 -> 3;
    # weight 0.5 -> 1.5 (the cap is weighted too); the capped token has zero gradient
    w = torch.tensor([[0.5]])
    loss, m, grad = one_row([5.0], [-1.0], clip_c=3.0, weights=w)
    torch.testing.assert_close(loss, torch.tensor(1.5))
    assert m["dual_clip_count"] == 1 and grad.abs().sum() == 0


def test_unit_is_weights_reproduce_the_plain_loss_and_silenced_inf_weights_are_ignored():
    r = torch.tensor([[1.1, 0.7, 1.4], [0.9, 1.0, 2.0]])
    adv = torch.tensor([1.0, -1.0])
    keep = torch.tensor([[True, True, False], [True, False, True]])
    plain, _ = clipped_surrogate_loss(r.log(), torch.zeros_like(r), adv, keep)
    ones, _ = clipped_surrogate_loss(r.log(), torch.zeros_like(r), adv, keep, weights=torch.ones_like(r))
    torch.testing.assert_close(plain, ones)
    w = torch.tensor([[1.0, 1.0, INF], [1.0, NAN, 1.0]])  # inf / NaN only on silenced tokens
    masked, _ = clipped_surrogate_loss(r.log(), torch.zeros_like(r), adv, keep, weights=w)
    torch.testing.assert_close(plain, masked)
    with pytest.raises(ValueError, match="weights shape"):
        clipped_surrogate_loss(r.log(), torch.zeros_like(r), adv, keep, weights=torch.ones(2, 2))
