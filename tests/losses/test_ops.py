"""Chunked token stats vs the naive full-logits path; masked reductions and quantiles."""

import math

import pytest
import torch

from stapo.losses import ops
from stapo.losses import (
    logprobs_and_entropy_from_logits,
    masked_mean,
    masked_quantile,
    masked_sum,
    token_logprobs_and_entropy,
    token_topk,
)


def naive(hidden, weight, labels, temperature):
    """Reference: full logits -> log_softmax -> gather; entropy -(p log p).sum (fp64)."""
    logp = torch.log_softmax((hidden.double() @ weight.double().T) / temperature, dim=-1)
    return logp.gather(1, labels[:, None]).squeeze(1), -(logp.exp() * logp).sum(-1)


def make(n, h=16, v=97, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(n, h, generator=g) * 2).to(dtype)
    weight = (torch.randn(v, h, generator=g) * 0.7).to(dtype)
    labels = torch.randint(0, v, (n,), generator=g)
    grad_out = torch.randn(n, generator=g)
    return hidden, weight, labels, grad_out


@pytest.mark.parametrize("n, chunk", [(1, 4), (13, 1), (13, 4), (37, 8), (37, 64), (64, 16)])
@pytest.mark.parametrize("temperature", [1.0, 0.6, 1.7])
def test_chunked_matches_naive_values_and_grads(n, chunk, temperature):
    hidden, weight, labels, g = make(n, seed=n + chunk)
    h1, w1 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    lp, ent = token_logprobs_and_entropy(h1, w1, labels, temperature, chunk_size=chunk)
    assert lp.dtype == ent.dtype == torch.float32 and lp.shape == ent.shape == (n,)
    assert not ent.requires_grad
    (lp * g).sum().backward()
    h2, w2 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    lp_ref, ent_ref = naive(h2, w2, labels, temperature)
    (lp_ref * g.double()).sum().backward()
    torch.testing.assert_close(lp.double(), lp_ref, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(ent.double(), ent_ref.detach(), atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(h1.grad.double(), h2.grad, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(w1.grad.double(), w2.grad, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("needs", ["hidden", "weight"])
def test_chunked_grad_for_one_input_only(needs):
    hidden, weight, labels, g = make(21, seed=5)
    hidden.requires_grad_(needs == "hidden")
    weight.requires_grad_(needs == "weight")
    lp, _ = token_logprobs_and_entropy(hidden, weight, labels, 0.8, chunk_size=5)
    (grad,) = torch.autograd.grad((lp * g).sum(), hidden if needs == "hidden" else weight)
    h2, w2 = hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    lp_ref, _ = naive(h2, w2, labels, 0.8)
    ref = torch.autograd.grad((lp_ref * g.double()).sum(), h2 if needs == "hidden" else w2)[0]
    torch.testing.assert_close(grad.double(), ref, atol=2e-5, rtol=1e-4)


def test_bf16_inputs():
    hidden, weight, labels, g = make(29, seed=3, dtype=torch.bfloat16)
    h1, w1 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    lp, ent = token_logprobs_and_entropy(h1, w1, labels, chunk_size=8)
    (lp * g).sum().backward()
    assert lp.dtype == torch.float32 and h1.grad.dtype == w1.grad.dtype == torch.bfloat16
    # on CPU every GEMM is fp32; CUDA's 16-bit logits GEMM has its own test (tests/gpu/test_head_gemm_gpu.py)
    assert not ops._exact_16bit_gemm(hidden, weight)
    # reference on the same bf16 values, computed in fp64: only the output grads are rounded
    h2, w2 = hidden.double().requires_grad_(), weight.double().requires_grad_()
    lp_ref, ent_ref = naive(h2, w2, labels, 1.0)
    (lp_ref * g.double()).sum().backward()
    torch.testing.assert_close(lp.double(), lp_ref, atol=5e-5, rtol=1e-5)  # fp32 compute inside
    torch.testing.assert_close(ent.double(), ent_ref.detach(), atol=5e-5, rtol=1e-5)
    torch.testing.assert_close(h1.grad.double(), h2.grad, atol=1e-2, rtol=1e-2)  # bf16 rounding
    torch.testing.assert_close(w1.grad.double(), w2.grad, atol=1e-2, rtol=1e-2)


def test_fp32_weight_copy_only_where_read(monkeypatch):
    """On the 16-bit GEMM path a pass without input grads makes no ``(V, H)`` fp32 copy of the weight (0.6-1.2 GB
    at Qwen3's vocabulary, per micro-batch); the Jacobian's ``p @ W`` products and the fp32 path still get one."""
    hidden, weight = torch.randn(3, 4, dtype=torch.bfloat16), torch.randn(7, 4, dtype=torch.bfloat16)
    assert ops._fp32_weight(hidden, weight, False).dtype == torch.float32  # CPU: the fp32 GEMM reads it
    monkeypatch.setattr(ops, "_exact_16bit_gemm", lambda h, w: True)
    assert ops._fp32_weight(hidden, weight, False) is None
    w32 = ops._fp32_weight(hidden, weight, True)
    assert w32.dtype == torch.float32 and torch.equal(w32, weight.float())
    fp32 = weight.float()
    assert ops._fp32_weight(hidden, fp32, True) is fp32  # no copy of an fp32 weight


def test_no_grad_and_inference_paths():
    hidden, weight, labels, _ = make(10, seed=9)
    ref_lp, ref_ent = naive(hidden, weight, labels, 1.0)
    with torch.no_grad():
        lp, ent = token_logprobs_and_entropy(hidden.requires_grad_(), weight, labels, chunk_size=3)
    assert not lp.requires_grad
    torch.testing.assert_close(lp.double(), ref_lp, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(ent.double(), ref_ent, atol=2e-5, rtol=1e-5)


def test_from_logits_matches_and_extreme_logits():
    hidden, weight, labels, _ = make(12, seed=2)
    logits = (hidden @ weight.T).reshape(3, 4, -1)
    lp, ent = logprobs_and_entropy_from_logits(logits, labels.reshape(3, 4), temperature=0.5)
    ref_lp, ref_ent = naive(hidden, weight, labels, 0.5)
    torch.testing.assert_close(lp.reshape(-1).double(), ref_lp, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(ent.reshape(-1).double(), ref_ent, atol=2e-5, rtol=1e-5)
    # a near-one-hot distribution: entropy ~0 and finite; the large offset cancels exactly
    w = torch.zeros(3, 1)
    w[0, 0] = 1.0
    lp, ent = token_logprobs_and_entropy(torch.full((1, 1), 200.0), w, torch.tensor([0]))
    assert lp.item() == pytest.approx(0.0, abs=1e-6) and 0.0 <= ent.item() < 1e-6


def test_input_validation():
    hidden, weight, labels, _ = make(4)
    with pytest.raises(ValueError, match="hidden size mismatch"):
        token_logprobs_and_entropy(hidden, weight[:, :3], labels)
    with pytest.raises(ValueError, match=r"labels must be \(N,\)"):
        token_logprobs_and_entropy(hidden, weight, labels[:2])
    with pytest.raises(ValueError, match="torch.long"):
        token_logprobs_and_entropy(hidden, weight, labels.int())
    with pytest.raises(ValueError, match="flatten"):
        token_logprobs_and_entropy(hidden[None], weight, labels)
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs_and_entropy(hidden, weight, labels, temperature=0.0)
    with pytest.raises(ValueError, match="chunk_size"):
        token_logprobs_and_entropy(hidden, weight, labels, chunk_size=0)


def test_token_topk_and_lemma_a1_gradient_norm():
    hidden, weight, labels, _ = make(9, seed=4)
    top = token_topk(hidden, weight, k=5, temperature=0.9, chunk_size=4)
    p = torch.softmax(hidden.double() @ weight.double().T / 0.9, dim=-1)
    ref = p.topk(5, dim=-1)
    torch.testing.assert_close(top.probs.double(), ref.values, atol=1e-6, rtol=1e-5)
    assert torch.equal(top.ids, ref.indices)
    torch.testing.assert_close(top.collision.double(), (p * p).sum(-1), atol=1e-6, rtol=1e-5)
    # Lemma A.1: ||d log p(y) / d logits||^2 = 1 - 2 p(y) + sum_v p(v)^2 (here w = 1)
    logits = (hidden.double() @ weight.double().T / 0.9).requires_grad_()
    (grad,) = torch.autograd.grad(torch.log_softmax(logits, -1).gather(1, labels[:, None]).sum(), logits)
    p_y = p.gather(1, labels[:, None]).squeeze(1)
    torch.testing.assert_close(grad.pow(2).sum(-1), 1 - 2 * p_y + top.collision.double(), atol=1e-5, rtol=1e-5)


def test_token_topk_by_hand():
    # identity lm_head: the hidden states are the logits
    # row 0: logits [0, ln 3] -> p = [1/4, 3/4]; sum p^2 = 1/16 + 9/16 = 0.625
    # row 1: uniform over 2 -> sum p^2 = 0.5; at temperature 2 row 0 becomes [1, sqrt 3] / (1 + sqrt 3)
    logits = torch.tensor([[0.0, math.log(3.0)], [1.0, 1.0]])
    top = token_topk(logits, torch.eye(2), k=1, chunk_size=1)
    assert top.ids.tolist() == [[1], [0]]
    assert top.probs[:, 0].tolist() == pytest.approx([0.75, 0.5])
    assert top.collision.tolist() == pytest.approx([0.625, 0.5])
    p = torch.tensor([1.0, math.sqrt(3.0)]) / (1 + math.sqrt(3.0))
    hot = token_topk(logits[:1], torch.eye(2), k=2, temperature=2.0)
    assert hot.collision.item() == pytest.approx(float(p.square().sum()))


def test_masked_sum_mean():
    x = torch.tensor([[1.0, 2.0, float("nan")], [4.0, float("inf"), 6.0]])
    m = torch.tensor([[True, True, False], [True, False, False]])
    assert masked_sum(x, m).item() == 7.0  # 1 + 2 + 4, NaN/inf masked out
    assert masked_mean(x, m).item() == pytest.approx(7 / 3)
    assert masked_mean(x, m, dim=1).tolist() == [1.5, 4.0]
    empty = torch.zeros_like(m)
    assert masked_mean(x, empty).item() == 0.0 and masked_sum(x, empty).item() == 0.0
    assert masked_mean(x, empty, dim=1).tolist() == [0.0, 0.0]
    y = torch.tensor([1.0, float("inf")], requires_grad=True)
    masked_mean(y, torch.tensor([True, False])).backward()
    assert y.grad.tolist() == [1.0, 0.0]


@pytest.mark.parametrize("n", [1, 2, 5, 64, 1001])
@pytest.mark.parametrize("q", [0.0, 0.1, 0.2, 0.5, 0.8, 0.999, 1.0])
def test_masked_quantile_equals_torch_quantile(n, q):
    g = torch.Generator().manual_seed(n)
    values = torch.randn(n + 7, generator=g)
    mask = torch.ones(n + 7, dtype=torch.bool)
    mask[torch.randperm(n + 7, generator=g)[:7]] = False
    got = masked_quantile(values, mask, q)
    assert got.dim() == 0
    torch.testing.assert_close(got, torch.quantile(values[mask], q))


def test_masked_quantile_hand_values_and_empty():
    v = torch.tensor([[4.0, 1.0, 100.0], [3.0, 2.0, -50.0]])
    m = torch.tensor([[True, True, False], [True, True, False]])
    # valid sorted 1 2 3 4: q=.5 -> rank 1.5 -> 2.5 ; q=.8 -> rank 2.4 -> 3.4
    assert masked_quantile(v, m, 0.5).item() == pytest.approx(2.5)
    assert masked_quantile(v, m, 0.8).item() == pytest.approx(3.4)
    assert masked_quantile(v, torch.zeros_like(m), 0.8).item() == math.inf  # documented: +inf
    with pytest.raises(ValueError, match="q must be"):
        masked_quantile(v, m, 1.5)


@pytest.mark.slow
def test_masked_quantile_past_torch_quantile_limit():
    n = (1 << 24) + 5  # torch.quantile refuses > 16M elements
    values = torch.arange(n, dtype=torch.float32).flip(0)
    mask = torch.ones(n, dtype=torch.bool)
    # sorted = 0..n-1 ; q = 0.25 -> rank 0.25 (n-1) = 4194305.0 exactly representable
    assert masked_quantile(values, mask, 0.25).item() == 0.25 * (n - 1)


def test_zero_tokens():
    hidden = torch.zeros(0, 8, requires_grad=True)
    weight = torch.randn(11, 8, requires_grad=True)
    lp, ent = token_logprobs_and_entropy(hidden, weight, torch.zeros(0, dtype=torch.long))
    assert lp.shape == ent.shape == (0,)
    lp.sum().backward()
    assert hidden.grad.shape == (0, 8) and torch.equal(weight.grad, torch.zeros(11, 8))
