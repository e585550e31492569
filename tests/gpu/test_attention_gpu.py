"""GPU lane: flex_attention and flash-attention on packed rows equal sdpa, forward AND backward.

On CPU only flex's forward runs (tests/trainer/test_attention.py); PyTorch's CPU flex_attention has no
backward and flash-attention needs CUDA. A random Qwen3-shaped model (2 layers) on sequences of 40-700
tokens packed into one row, so the block mask has skipped, whole and partial 128 x 128 tiles. Marked
`gpu`; skipped without CUDA (flash also without the flash-attn package)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _require_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")


def _model(dtype):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64, tie_word_embeddings=True,
                         attn_implementation="sdpa")
    return Qwen3ForCausalLM(config).to("cuda", dtype)


def _rows():
    from stapo.distributed.policy import teacher_forced_inputs

    gen = torch.Generator().manual_seed(0)
    prompt_lens = torch.randint(8, 40, (12,), generator=gen).tolist()
    response_lens = torch.randint(30, 660, (12,), generator=gen).tolist()
    b, lp, lt = 12, max(prompt_lens), max(response_lens)
    prompt_mask = torch.arange(lp)[None, :] >= lp - torch.tensor(prompt_lens)[:, None]
    response_mask = torch.arange(lt)[None, :] < torch.tensor(response_lens)[:, None]
    prompt_ids = torch.randint(1, 512, (b, lp), generator=gen) * prompt_mask
    response_ids = torch.randint(1, 512, (b, lt), generator=gen) * response_mask
    return teacher_forced_inputs(prompt_ids, prompt_mask, response_ids, response_mask, packed=True,
                                 one_row=True).to("cuda")


def _stats_and_grads(model, inputs, attn):
    from stapo.distributed.policy import response_token_stats

    model.set_attn_implementation(attn)
    model.zero_grad()
    logprobs, entropy = response_token_stats(model, inputs, temperature=1.0, chunk_size=128)
    (logprobs * torch.linspace(-1, 1, logprobs.numel(), device="cuda").view_as(logprobs)).sum().backward()
    grads = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}
    return logprobs.detach(), entropy, grads


def _compare(model, inputs, attn, logprob_tol, grad_rtol):
    ref_lp, ref_h, ref_g = _stats_and_grads(model, inputs, "sdpa")
    lp, h, g = _stats_and_grads(model, inputs, attn)
    assert (lp - ref_lp).abs().max() <= logprob_tol and (h - ref_h).abs().max() <= logprob_tol
    assert g.keys() == ref_g.keys() and len(g) > 10
    for name in g:
        scale = ref_g[name].abs().max().clamp(min=1e-6)
        assert (g[name] - ref_g[name]).abs().max() <= grad_rtol * scale, name


def test_flex_forward_and_backward_on_packed_rows_equal_sdpa():
    inputs = _rows()
    assert inputs.input_ids.shape[0] == 1 and inputs.input_ids.shape[1] > 2000  # one row, many tiles
    _compare(_model(torch.float32), inputs, "flex_attention", logprob_tol=1e-4, grad_rtol=1e-3)


def test_flash_forward_and_backward_on_packed_rows_equal_sdpa():
    from stapo.distributed.attention import choose_attention

    flash = choose_attention("auto", dtype=torch.bfloat16)
    if not flash.startswith("flash_attention"):
        pytest.skip(f"flash-attention is not installed for this GPU (auto chose {flash})")
    # bf16: both kernels round differently; the bound is bf16 noise over two layers, not fp32's
    _compare(_model(torch.bfloat16), _rows(), flash, logprob_tol=5e-2, grad_rtol=5e-2)
