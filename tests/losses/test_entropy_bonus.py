"""Entropy bonus: the chunked op's differentiable entropy equals autograd on full logits, hand-computed
gradients on a 2-token vocabulary, and the bonus term of clipped_surrogate_loss."""

import math

import pytest
import torch

from stapo.losses import clipped_surrogate_loss, logprobs_and_entropy_from_logits, token_logprobs_and_entropy


def make(n, h=8, v=29, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, h, generator=g) * 2, torch.randn(v, h, generator=g) * 0.7,
            torch.randint(0, v, (n,), generator=g), torch.randn(n, generator=g), torch.randn(n, generator=g))


@pytest.mark.parametrize("n, chunk", [(1, 4), (13, 4), (37, 64)])
@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_chunked_entropy_gradient_matches_full_logits_autograd(n, chunk, temperature):
    hidden, weight, labels, a, b = make(n, seed=n + chunk)
    h1, w1 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    lp, ent = token_logprobs_and_entropy(h1, w1, labels, temperature, chunk_size=chunk, entropy_grad=True)
    assert ent.requires_grad
    ((a * lp).sum() + (b * ent).sum()).backward()
    h2, w2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    lp_ref, ent_ref = logprobs_and_entropy_from_logits(h2 @ w2.T, labels, temperature, entropy_grad=True)
    ((a * lp_ref).sum() + (b * ent_ref).sum()).backward()
    torch.testing.assert_close(ent, ent_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(h1.grad, h2.grad, atol=1e-5, rtol=1e-5)
    # W's gradient sums the chunks' products: against a float64 reference the chunked op's is 4.8e-5 off
    # (|grad| <= 25.7), the full logits' 5e-6; at rtol 1e-5 that used 78-87% of the tolerance on every kernel
    # path measured (ATen AVX512 / AVX2 / scalar, MKL default / compatible), so another CPU's blocking could
    # cross it. rtol 1e-4: 2e-6 relative is fp32 accumulation, a wrong gradient is off by far more.
    torch.testing.assert_close(w1.grad, w2.grad, atol=1e-5, rtol=1e-4)


def test_entropy_gradient_by_hand_on_two_tokens():
    # W = I (V = H = 2), T = 1: logits = hidden = (0, ln 3) -> p = (1/4, 3/4),
    # H = -(1/4 ln 1/4 + 3/4 ln 3/4) = ln 4 - 3/4 ln 3.
    # dH/dz_v = -p_v (ln p_v + H): v=0: -1/4 (-ln 4 + ln 4 - 3/4 ln 3) = +3/16 ln 3; v=1: -3/16 ln 3.
    # dH/dh = dH/dz @ W = (3/16 ln 3, -3/16 ln 3); dH/dW_v = dH/dz_v * h = (0, +-3/16 (ln 3)^2).
    ln3 = math.log(3.0)
    hidden = torch.tensor([[0.0, ln3]], requires_grad=True)
    weight = torch.eye(2, requires_grad=True)
    _, ent = token_logprobs_and_entropy(hidden, weight, torch.tensor([1]), entropy_grad=True)
    assert ent.item() == pytest.approx(math.log(4) - 0.75 * ln3, abs=1e-6)
    ent.sum().backward()
    c = 3 / 16 * ln3
    torch.testing.assert_close(hidden.grad, torch.tensor([[c, -c]]), atol=1e-6, rtol=0)
    torch.testing.assert_close(weight.grad, torch.tensor([[0.0, c * ln3], [0.0, -c * ln3]]), atol=1e-6, rtol=0)


def test_entropy_stays_detached_by_default_and_without_grad():
    hidden, weight, labels, _, _ = make(5)
    _, ent = token_logprobs_and_entropy(hidden.requires_grad_(), weight, labels)
    assert not ent.requires_grad
    with torch.no_grad():
        _, ent = token_logprobs_and_entropy(hidden, weight, labels, entropy_grad=True)
    assert not ent.requires_grad


def test_surrogate_entropy_bonus_uses_kept_tokens_and_the_global_normalizer():
    # ratio 1 and A = 0: the surrogate is 0, only the bonus acts. Kept entropies 0.5 + 1 + 2 = 3.5;
    # the silenced token holds NaN and must not leak into loss or gradient.
    logprobs = torch.full((1, 4), -1.0)
    entropy = torch.tensor([[0.5, 1.0, 2.0, float("nan")]], requires_grad=True)
    keep = torch.tensor([[True, True, True, False]])
    loss, m = clipped_surrogate_loss(logprobs, logprobs, torch.zeros(1), keep, entropy=entropy, entropy_coef=0.1)
    assert loss.item() == pytest.approx(-0.1 * 3.5 / 3)  # token-mean over 3 kept tokens
    assert m["entropy_bonus_sum"].item() == pytest.approx(3.5)
    loss.backward()
    torch.testing.assert_close(entropy.grad, torch.tensor([[-0.1 / 3] * 3 + [0.0]]))
    # a trainer passes the GLOBAL kept count (here 7 over all micro-batches): -0.1 * 3.5 / 7 = -0.05
    loss, _ = clipped_surrogate_loss(logprobs, logprobs, torch.zeros(1), keep, normalizer=7,
                                     entropy=entropy.detach(), entropy_coef=0.1)
    assert loss.item() == pytest.approx(-0.05)
    # coef 0: the loss is the plain surrogate; the metric is still reported
    loss, m = clipped_surrogate_loss(logprobs, logprobs, torch.ones(1), keep, entropy=entropy.detach())
    assert loss.item() == pytest.approx(-1.0) and m["entropy_bonus_sum"].item() == pytest.approx(3.5)
    with pytest.raises(ValueError, match="entropy shape"):
        clipped_surrogate_loss(logprobs, logprobs, torch.zeros(1), keep, entropy=torch.zeros(1, 3))


def test_bonus_gradient_reaches_hidden_states_through_the_chunked_op():
    hidden, weight, labels, _, _ = make(6, seed=3)
    h1 = hidden.clone().requires_grad_()
    lp, ent = token_logprobs_and_entropy(h1, weight, labels, chunk_size=4, entropy_grad=True)
    keep = torch.tensor([[True, True, False], [True, True, True]])
    loss, _ = clipped_surrogate_loss(lp.view(2, 3), lp.detach().view(2, 3), torch.tensor([1.0, -1.0]), keep,
                                     entropy=ent.view(2, 3), entropy_coef=0.01)
    loss.backward()
    h2 = hidden.clone().requires_grad_()
    lp2, ent2 = logprobs_and_entropy_from_logits(h2 @ weight.T, labels, entropy_grad=True)
    loss2, _ = clipped_surrogate_loss(lp2.view(2, 3), lp2.detach().view(2, 3), torch.tensor([1.0, -1.0]), keep,
                                      entropy=ent2.view(2, 3), entropy_coef=0.01)
    loss2.backward()
    torch.testing.assert_close(h1.grad, h2.grad, atol=1e-6, rtol=1e-5)
    assert h1.grad[2].abs().sum() == 0  # the silenced token (row 0, t = 2) gets no gradient at all


@pytest.mark.parametrize("needs", ["hidden", "weight"])
def test_entropy_only_gradient_for_one_input(needs):
    # logprobs unused (their incoming gradient is zero): only the entropy term flows back
    hidden, weight, labels, _, b = make(9, seed=11)
    hidden.requires_grad_(needs == "hidden")
    weight.requires_grad_(needs == "weight")
    _, ent = token_logprobs_and_entropy(hidden, weight, labels, 0.8, chunk_size=4, entropy_grad=True)
    (grad,) = torch.autograd.grad((b * ent).sum(), hidden if needs == "hidden" else weight)
    h2, w2 = hidden.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    _, ent_ref = logprobs_and_entropy_from_logits(h2 @ w2.T, labels, 0.8, entropy_grad=True)
    ref = torch.autograd.grad((b * ent_ref).sum(), h2 if needs == "hidden" else w2)[0]
    torch.testing.assert_close(grad, ref, atol=1e-5, rtol=1e-5)
