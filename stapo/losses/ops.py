"""Per-token log-probabilities and entropies without materializing ``(tokens x vocab)`` logits.

Qwen3's 151,936-token vocabulary makes full logits tens of GB on long responses; docs/losses.md, "Token
log-probabilities and entropy", has the chunked forward, the recomputing backward, the formulas and costs.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = [
    "token_logprobs_and_entropy",
    "logprobs_and_entropy_from_logits",
    "token_topk",
    "TokenTopK",
]

DEFAULT_CHUNK_SIZE = 128  # tuned in bench/token_stats.py (docs/losses.md has the figures)


def _exact_16bit_gemm(hidden, weight) -> bool:
    """True where the logits GEMM can run on 16-bit tensor cores with no loss: bf16/fp16 inputs on CUDA.

    A product of two 16-bit floats is exact in fp32 and cuBLAS accumulates such a GEMM in fp32 (``out_dtype``),
    so the logits equal the fp32 GEMM's to summation order, at tensor-core speed (the fp32 GEMM ran at ~35
    TFLOP/s on an H200: the head took 38-55% of an update). Only the logits: the products with probabilities
    (``p @ W``, the weight gradient) stay fp32, since ``W_y - p @ W`` cancels when ``p_y`` is near 1."""
    return hidden.is_cuda and hidden.dtype == weight.dtype and hidden.dtype in (torch.bfloat16, torch.float16)


def _fp32_weight(hidden, weight, needed_for_products: bool):
    """The ``(V, H)`` fp32 weight, or None where nothing reads it: on the 16-bit GEMM path a no-grad pass needs
    no fp32 copy (V x H x 4 bytes, 0.6-1.2 GB at Qwen3's vocabulary, made per micro-batch)."""
    if needed_for_products or not _exact_16bit_gemm(hidden, weight):
        return weight.float()  # no copy when already fp32
    return None


def _scaled_logits(hidden, weight, w32, inv_t, out):
    """``hidden @ weight.T / T`` as fp32 into ``out`` (mm: matmul's out= copies); ``w32`` is read only off the
    16-bit GEMM path."""
    if _exact_16bit_gemm(hidden, weight):
        z = torch.mm(hidden, weight.t(), out_dtype=torch.float32, out=out)
        return z if inv_t == 1.0 else z.mul_(inv_t)
    return torch.mm(hidden.float() * inv_t, w32.t(), out=out)


def _chunk_stats(h, weight, w32, inv_t, y, buf, want_jac, want_ent_jac=False):
    """One chunk: ``(logprob, entropy, lse, jac | None, ent_jac | None)``, in ONE reused ``(n, V)`` buffer.

    On max-shifted logits ``z`` (no cancellation at large logits; ``e log e`` by ``xlogy``, 0 where ``e``
    underflowed). The entropy's ``dH / dh = -((e z) @ W / s - (sum e z / s) (e @ W) / s) / T``; the rest:
    docs/losses.md, "Token log-probabilities and entropy".
    """
    z = _scaled_logits(h, weight, w32, inv_t, buf)  # (n, V) logits / T
    m = z.amax(dim=-1)  # (n,)
    z.sub_(m[:, None])
    z_y = z.gather(1, y[:, None]).squeeze(1)  # (n,)
    e = z.exp_()  # (n, V) unnormalized probabilities, in place
    s = e.sum(dim=-1)  # (n,)
    log_s = s.log()
    p_w = (e @ w32) / s[:, None] if want_jac else None  # (n, H) softmax @ W
    jac = (w32[y] - p_w) if want_jac else None  # (n, H), times 1/T by caller
    e_z = e.xlogy_(e)  # (n, V) e z, in place (e is not needed after this)
    mean_z = e_z.sum(dim=-1) / s  # (n,) sum_v p_v z_v
    ent_jac = None
    if want_ent_jac:  # log p + H = z - mean_z, so dH/dh = -(sum_v p_v z_v W_v - mean_z p_w) / T
        ent_jac = (e_z @ w32).div_(s[:, None]).sub_(mean_z[:, None] * p_w).neg_()  # (n, H)
    return z_y - log_s, log_s - mean_z, m + log_s, jac, ent_jac


def _forward_chunks(hidden, weight, labels, temperature, chunk_size, want_jac, want_ent_jac=False):
    """Chunk loop of the forward pass; returns ``(logprobs, entropy, lse, jac | None, ent_jac | None)``."""
    n_tok, vocab = hidden.shape[0], weight.shape[0]
    inv_t = 1.0 / temperature
    w32 = _fp32_weight(hidden, weight, want_jac)  # (V, H) or None
    f32 = dict(dtype=torch.float32, device=hidden.device)
    logprobs, entropy, lse = (torch.empty(n_tok, **f32) for _ in range(3))
    jac = torch.empty(hidden.shape, **f32) if want_jac else None  # (N, H) d logprob / d hidden
    ent_jac = torch.empty(hidden.shape, **f32) if want_ent_jac else None  # (N, H) d entropy / d hidden
    buf = torch.empty(min(chunk_size, n_tok), vocab, **f32)
    for start in range(0, n_tok, chunk_size):
        sl = slice(start, start + chunk_size)
        n = labels[sl].numel()
        out = _chunk_stats(hidden[sl], weight, w32, inv_t, labels[sl], buf[:n], want_jac, want_ent_jac)
        logprobs[sl], entropy[sl], lse[sl] = out[:3]
        if want_jac:
            jac[sl] = out[3].mul_(inv_t)
        if want_ent_jac:
            ent_jac[sl] = out[4].mul_(inv_t)
    return logprobs, entropy, lse, jac, ent_jac


def _weight_grad(hidden, weight, labels, lse, g, inv_t, chunk_size, g_ent=None, entropy=None):
    """``grad_W = sum_i (g_i (onehot(y_i) - p_i) - g_ent_i p_i (log p_i + H_i))^T h_i / T``, recomputing p in
    vocabulary slices: each row of the ``(V, H)`` gradient is written once, not once per token chunk."""
    n_tok, vocab = hidden.shape[0], weight.shape[0]
    grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
    if n_tok == 0:
        return grad_w.to(weight.dtype)
    w32 = _fp32_weight(hidden, weight, False)  # the products below are with h, not W
    h32 = hidden.float()
    gh = (g * inv_t)[:, None] * h32  # (N, H)
    h_scaled = None if g_ent is None else h32 * inv_t
    # the entropy term needs p and log p at once: two slice buffers, so half the width
    width = max(1, min(vocab, chunk_size * vocab // n_tok // (1 if g_ent is None else 2)))
    flat = torch.empty(n_tok * width, dtype=torch.float32, device=weight.device)
    for start in range(0, vocab, width):
        vs = slice(start, start + width)
        n_ids = weight[vs].shape[0]
        w32_slice = None if w32 is None else w32[vs]
        z = _scaled_logits(hidden, weight[vs], w32_slice, inv_t, flat[: n_tok * n_ids].view(n_tok, n_ids))  # (N, v)
        if g_ent is None:
            p = z.sub_(lse[:, None]).exp_()  # softmax columns of this slice, recomputed
            torch.mm(p.t(), gh, out=grad_w[vs]).neg_()  # -p part
            continue
        log_p = z.sub_(lse[:, None])  # (N, v)
        p = log_p.exp()
        q = log_p.add_(entropy[:, None]).mul_(g_ent[:, None]).add_(g[:, None]).mul_(p)  # p (g + g_ent (log p + H))
        torch.mm(q.t(), h_scaled, out=grad_w[vs]).neg_()
    grad_w.index_add_(0, labels, gh)  # onehot part
    return grad_w.to(weight.dtype)


class _ChunkedTokenStats(torch.autograd.Function):
    """Chunked ``log softmax(hW^T/T)[y]`` + entropy; backward recomputes for ``grad_W``."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, temperature, chunk_size, entropy_grad):
        want_jac = ctx.needs_input_grad[0]
        logprobs, entropy, lse, jac, ent_jac = _forward_chunks(
            hidden, weight, labels, temperature, chunk_size, want_jac, want_jac and entropy_grad)
        if not entropy_grad:
            ctx.mark_non_differentiable(entropy)
        ctx.save_for_backward(hidden, weight, labels, lse, jac, ent_jac, entropy if entropy_grad else None)
        ctx.inv_t, ctx.chunk_size, ctx.entropy_grad = 1.0 / temperature, chunk_size, entropy_grad
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        hidden, weight, labels, lse, jac, ent_jac, entropy = ctx.saved_tensors
        g = grad_logprobs.float()  # (N,)
        g_ent = grad_entropy.float() if ctx.entropy_grad and grad_entropy is not None else None  # (N,)
        grad_h = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_h = g[:, None] * jac
            if g_ent is not None:
                grad_h = grad_h.add_(g_ent[:, None] * ent_jac)
            grad_h = grad_h.to(hidden.dtype)
        if ctx.needs_input_grad[1]:
            grad_w = _weight_grad(hidden, weight, labels, lse, g, ctx.inv_t, ctx.chunk_size, g_ent, entropy)
        return grad_h, grad_w, None, None, None, None


def _check_token_inputs(hidden, weight, labels, temperature, chunk_size):
    if hidden.dim() != 2 or weight.dim() != 2:
        raise ValueError(
            f"hidden must be (N, H) and lm_head_weight (V, H); got {tuple(hidden.shape)} and "
            f"{tuple(weight.shape)} (flatten batch and time first)"
        )
    if hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden size mismatch: hidden {tuple(hidden.shape)} vs weight {tuple(weight.shape)}")
    if labels.shape != hidden.shape[:1]:
        raise ValueError(f"labels must be (N,) = ({hidden.shape[0]},), got {tuple(labels.shape)}")
    if labels.dtype != torch.long:
        raise ValueError(f"labels must be torch.long token ids, got {labels.dtype}")
    if not hidden.is_floating_point() or not weight.is_floating_point():
        raise ValueError("hidden and lm_head_weight must be floating point")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")


def token_logprobs_and_entropy(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    labels: torch.Tensor,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    entropy_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logprobs, entropy)``, both ``(N,)`` fp32, of ``labels`` under ``softmax(hidden @ W.T / T)``.

    ``entropy`` is detached unless ``entropy_grad`` (the entropy bonus: one more Jacobian and matmul per chunk).
    """
    _check_token_inputs(hidden, lm_head_weight, labels, temperature, chunk_size)
    if torch.is_grad_enabled() and (hidden.requires_grad or lm_head_weight.requires_grad):
        return _ChunkedTokenStats.apply(hidden, lm_head_weight, labels, float(temperature), chunk_size,
                                        bool(entropy_grad))
    logprobs, entropy, *_ = _forward_chunks(hidden, lm_head_weight, labels, temperature, chunk_size, False)
    return logprobs, entropy


def logprobs_and_entropy_from_logits(
    logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0, entropy_grad: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same from logits ``(..., V)`` a caller already holds (small models, tests)."""
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"labels shape {tuple(labels.shape)} must equal logits.shape[:-1] {tuple(logits.shape[:-1])}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)  # (..., V)
    logprobs = logp.gather(-1, labels.long().unsqueeze(-1)).squeeze(-1)
    if entropy_grad:
        return logprobs, -(logp.exp() * logp).sum(dim=-1)
    with torch.no_grad():
        entropy = torch.linalg.vecdot(logp.exp(), logp).neg_()
    return logprobs, entropy


class TokenTopK(NamedTuple):
    """Top-k alternatives per token and the collision probability ``sum_v pi(v)^2``."""

    probs: torch.Tensor  # (N, k) fp32, descending
    ids: torch.Tensor  # (N, k) long
    collision: torch.Tensor  # (N,) fp32


@torch.no_grad()
def token_topk(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    k: int = 5,
    temperature: float = 1.0,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
) -> TokenTopK:
    """Chunked top-``k`` of ``softmax(hidden @ W.T / T)`` and ``sum_v pi(v)^2``, for the inspector's top-5
    tables (Appendix C) and Lemma A.1's logit-gradient norm without a backward pass."""
    if not 1 <= k <= lm_head_weight.shape[0]:
        raise ValueError(f"k must be in [1, V={lm_head_weight.shape[0]}], got {k}")
    dummy = torch.zeros(hidden.shape[0], dtype=torch.long, device=hidden.device)
    _check_token_inputs(hidden, lm_head_weight, dummy, temperature, chunk_size)
    w32, inv_t = lm_head_weight.float(), 1.0 / temperature
    n_tok = hidden.shape[0]
    f32 = dict(dtype=torch.float32, device=hidden.device)
    probs = torch.empty(n_tok, k, **f32)
    ids = torch.empty(n_tok, k, dtype=torch.long, device=hidden.device)
    collision = torch.empty(n_tok, **f32)
    rows = min(chunk_size, n_tok)
    buf = torch.empty(rows, w32.shape[0], **f32)
    for start in range(0, n_tok, chunk_size):
        sl = slice(start, start + chunk_size)
        z = torch.mm(hidden[sl].float() * inv_t, w32.t(), out=buf[: hidden[sl].shape[0]])  # (n, V)
        p = z.sub_(z.amax(dim=-1, keepdim=True)).exp_()
        p.div_(p.sum(dim=-1, keepdim=True))  # softmax, in place
        top = p.topk(k, dim=-1)
        probs[sl], ids[sl] = top.values, top.indices
        collision[sl] = torch.linalg.vector_norm(p, dim=-1).square_()  # sum_v p^2, no temp
    return TokenTopK(probs, ids, collision)
