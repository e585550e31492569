"""Clipped policy-gradient surrogate and its aggregation (paper Eq. 1; docs/losses.md, "Clipped surrogate").

Per token, with ``rho = exp(clamp(logprobs - old_logprobs, +-log_ratio_clamp))``::

    l_t = -min(rho A, clip(rho, 1 - clip_low, 1 + clip_high) A)          (PPO / clip-higher)
    l_t = min(l_t, -clip_c A)   if clip_c is set and A < 0              (dual-clip, verl / DAPO)
    l_t = w_t * l_t             if token weights are given              (mask weight x IS weight)

Inputs are selected with ``torch.where(keep, x, 0)`` before any arithmetic, so silenced tokens get exactly zero
gradient even with inf/NaN logprobs.
"""

from __future__ import annotations

from typing import Optional, Union

import torch

from stapo.losses.reduce import check_like_logprobs

__all__ = ["clipped_surrogate_loss", "aggregate_loss", "AGG_MODES"]

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")
Number = Union[int, float, torch.Tensor]


def _denominator(value: Number, like: torch.Tensor) -> torch.Tensor:
    """0-dim fp32 divisor; a zero (or negative) count becomes 1 so that ``0 / 0`` reads 0."""
    d = torch.as_tensor(value, dtype=torch.float32, device=like.device).detach()
    if d.dim() != 0:
        raise ValueError(f"normalizer must be a scalar, got shape {tuple(d.shape)}")
    return torch.where(d > 0, d, torch.ones_like(d))


def aggregate_loss(
    per_token: torch.Tensor,
    keep: torch.Tensor,
    agg: str = "token-mean",
    normalizer: Optional[Number] = None,
    max_response_length: Optional[int] = None,
) -> torch.Tensor:
    """Reduce a ``(B, T)`` per-token loss over kept tokens to a 0-dim loss (modes: docs/losses.md)."""
    if agg not in AGG_MODES:
        raise ValueError(f"agg must be one of {AGG_MODES}, got {agg!r}")
    x = torch.where(keep, per_token, torch.zeros((), dtype=per_token.dtype, device=per_token.device))
    if agg == "token-mean":
        return x.sum() / _denominator(keep.sum() if normalizer is None else normalizer, x)
    if agg == "seq-mean-token-mean":
        rows = x.sum(dim=1) / keep.sum(dim=1).clamp(min=1).to(x.dtype)  # (B,)
    else:
        length = per_token.shape[1] if max_response_length is None else max_response_length
        if not length > 0:
            raise ValueError(f"max_response_length must be > 0, got {length}")
        rows = x.sum(dim=1) / float(length)  # (B,)
    return rows.sum() / _denominator(per_token.shape[0] if normalizer is None else normalizer, x)


def _check_inputs(logprobs, old_logprobs, advantages, keep, ref_logprobs, clip_low, clip_high, clip_c, kl_coef,
                  entropy, weights):
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be (B, T), got {tuple(logprobs.shape)}")
    shape = logprobs.shape
    check_like_logprobs(shape, old_logprobs=old_logprobs, keep=keep, ref_logprobs=ref_logprobs, entropy=entropy,
                        weights=weights)
    if keep.dtype != torch.bool:
        raise ValueError(f"keep must be a bool (B, T) tensor, got {keep.dtype}")
    if advantages.shape not in (shape[:1], shape):
        raise ValueError(f"advantages must be (B,) or (B, T) for logprobs {tuple(shape)}, got {tuple(advantages.shape)}")
    if not (0.0 <= clip_low < 1.0 and clip_high >= 0.0):
        raise ValueError(f"need 0 <= clip_low < 1 and clip_high >= 0, got clip_low={clip_low}, clip_high={clip_high}")
    if clip_c is not None and not clip_c > 1.0:
        raise ValueError(f"clip_c (dual-clip) must be > 1 or None, got {clip_c}")
    if kl_coef < 0:
        raise ValueError(f"kl_coef must be >= 0, got {kl_coef}")


def clipped_surrogate_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    keep: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    clip_c: Optional[float] = None,
    agg: str = "token-mean",
    normalizer: Optional[Number] = None,
    max_response_length: Optional[int] = None,
    ref_logprobs: Optional[torch.Tensor] = None,
    kl_coef: float = 0.0,
    log_ratio_clamp: float = 20.0,
    entropy: Optional[torch.Tensor] = None,
    entropy_coef: float = 0.0,
    weights: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``(loss, metrics)``: the negative clipped surrogate over kept tokens (Eq. 1 with ``token-mean``).

    ``weights`` (detached) multiply the numerator only: the denominator counts kept tokens. ``metrics``: sums and
    counts that add across micro-batches and ranks (docs/losses.md, "Clipped surrogate and aggregation").
    """
    _check_inputs(logprobs, old_logprobs, advantages, keep, ref_logprobs, clip_low, clip_high, clip_c, kl_coef,
                  entropy, weights)
    zero = torch.zeros((), dtype=torch.float32, device=logprobs.device)
    adv = advantages.float()
    adv = torch.where(keep, adv[:, None] if adv.dim() == 1 else adv, zero)  # (B, T)
    # where BEFORE exp: a silenced inf/NaN logprob gets grad where(keep, g, 0) = 0, not 0 * NaN
    log_ratio = torch.where(keep, logprobs.float() - old_logprobs.float(), zero)  # (B, T)
    log_ratio = log_ratio.clamp(-log_ratio_clamp, log_ratio_clamp)
    ratio = log_ratio.exp()  # (B, T)
    pg_unclipped = -adv * ratio
    pg_clipped = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    pg = torch.maximum(pg_unclipped, pg_clipped)  # = -min(rho A, clip(rho) A)
    dual = torch.zeros_like(keep)
    if clip_c is not None:
        cap = -clip_c * adv  # > 0 where A < 0
        dual = keep & (adv < 0) & (pg > cap)
        pg = torch.where(adv < 0, torch.minimum(pg, cap), pg)
    if weights is not None:  # constant factors, numerator only (x * 1.0 == x, so {0, 1} weights are exact)
        pg = pg * torch.where(keep, weights.detach().float(), zero)
    loss = aggregate_loss(pg, keep, agg, normalizer, max_response_length)

    with torch.no_grad():
        neg_log_ratio = -log_ratio.detach()  # old - new (clamped)
        metrics = {
            "pg_loss_sum": torch.where(keep, pg.detach(), zero).sum(),
            "kept_tokens": keep.sum(),
            "clip_low_count": (keep & (adv < 0) & (ratio < 1.0 - clip_low)).sum(),
            "clip_high_count": (keep & (adv > 0) & (ratio > 1.0 + clip_high)).sum(),
            "dual_clip_count": dual.sum(),
            "approx_kl_sum": torch.where(keep, neg_log_ratio.exp() - neg_log_ratio - 1.0, zero).sum(),
            "ratio_sum": torch.where(keep, ratio.detach(), zero).sum(),
        }
    if ref_logprobs is not None:
        delta = torch.where(keep, ref_logprobs.float() - logprobs.float(), zero)
        delta = delta.clamp(-log_ratio_clamp, log_ratio_clamp)
        k3 = delta.exp() - delta - 1.0  # (B, T), >= 0
        if kl_coef != 0.0:
            loss = loss + kl_coef * aggregate_loss(k3, keep, agg, normalizer, max_response_length)
        metrics["kl_sum"] = torch.where(keep, k3.detach(), zero).sum()
    if entropy is not None:
        ent = torch.where(keep, entropy.float(), zero)  # (B, T); where, not *, as for logprobs
        if entropy_coef != 0.0:
            loss = loss - entropy_coef * aggregate_loss(ent, keep, agg, normalizer, max_response_length)
        metrics["entropy_bonus_sum"] = ent.detach().sum()
    return loss, metrics
