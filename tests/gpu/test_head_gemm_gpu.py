"""GPU lane: the lm_head op's 16-bit logits GEMM (fp32 out) gives the fp32 GEMM's log-probs, entropies and
gradients (stapo/losses/ops.py, ``_exact_16bit_gemm``). On CPU the op always runs the fp32 GEMM
(tests/losses). Marked `gpu`; skipped without CUDA."""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from stapo.losses import ops

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _require_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")


def _run(hidden, weight, labels, temperature, sixteen: bool):
    with mock.patch.object(ops, "_exact_16bit_gemm", lambda h, w: sixteen):
        h, w = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
        logprobs, entropy = ops.token_logprobs_and_entropy(h, w, labels, temperature, chunk_size=64,
                                                           entropy_grad=True)
        (logprobs * torch.linspace(-1, 1, len(labels), device="cuda")).sum().add(entropy.sum()).backward()
    return logprobs.detach(), entropy.detach(), h.grad, w.grad


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_the_16bit_logits_gemm_equals_the_fp32_gemm(dtype, temperature):
    gen = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(300, 256, device="cuda", generator=gen).to(dtype)
    weight = (torch.randn(5000, 256, device="cuda", generator=gen) * 0.3).to(dtype)  # logits of std ~5
    labels = torch.randint(0, 5000, (300,), device="cuda", generator=gen)
    assert ops._exact_16bit_gemm(hidden, weight) and not ops._exact_16bit_gemm(hidden.float(), weight.float())
    new, old = _run(hidden, weight, labels, temperature, True), _run(hidden, weight, labels, temperature, False)
    ref = torch.log_softmax(hidden.double() @ weight.double().t() / temperature, -1)
    ref_lp, ref_ent = ref.gather(1, labels[:, None]).squeeze(1), -(ref.exp() * ref).sum(-1)
    for name, value, exact in (("logprobs", 0, ref_lp), ("entropy", 1, ref_ent)):
        err_new = (new[value].double() - exact).abs().max().item()
        err_old = (old[value].double() - exact).abs().max().item()
        # the fp32 GEMM's own error is ~2e-5 here (fp32 log-sum-exp over the vocabulary); H200: 1.4e-5 - 2.1e-5
        assert err_new < 1e-4 and err_new <= 4 * err_old + 1e-6, (name, err_new, err_old)
    for name, value in (("hidden grad", 2), ("weight grad", 3)):  # both rounded to the 16-bit dtype at the end
        torch.testing.assert_close(new[value].float(), old[value].float(), rtol=2e-2,
                                   atol=2e-2 * old[value].float().abs().max().item(), msg=name)


def test_a_no_grad_pass_makes_no_fp32_copy_of_the_weight():
    """The old op made ``weight.float()`` (V x H x 4 bytes) on every call; with the 16-bit logits GEMM a pass without
    grads reads only the 16-bit weight, so its peak is the chunk buffer plus small vectors."""
    vocab, width, n_tok, chunk = 151_936, 1024, 512, 128
    hidden = torch.randn(n_tok, width, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(vocab, width, device="cuda", dtype=torch.bfloat16) * 0.02
    labels = torch.randint(0, vocab, (n_tok,), device="cuda")
    with torch.no_grad():
        ops.token_logprobs_and_entropy(hidden, weight, labels, 0.7, chunk_size=chunk)  # cuBLAS workspace etc.
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        ops.token_logprobs_and_entropy(hidden, weight, labels, 0.7, chunk_size=chunk)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before
    fp32_weight = vocab * width * 4  # 622 MB
    chunk_buffer = chunk * vocab * 4  # 78 MB
    assert extra < chunk_buffer * 2 + 64 * 2**20 < fp32_weight, (extra, chunk_buffer, fp32_weight)
