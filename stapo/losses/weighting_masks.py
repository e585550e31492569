"""Weighting strategies next to STAPO: STARE and Clip-Cov (docs/losses.md, "Token weights": their formulas,
parameters and where Clip-Cov differs from verl). Both select over the whole mini-batch on all ranks
(:mod:`stapo.losses.selection`), so the update does not depend on the split.
"""

from __future__ import annotations

import math
from dataclasses import field
from typing import Any

import torch

from stapo.losses.masks import TokenMask, TokenStats, register_mask
from stapo.losses.reduce import all_reduce_sum_
from stapo.losses.selection import global_random_pick, global_top_k

__all__ = ["STAREMask", "ClipCovMask"]

STARE_VARIANTS = ("O1", "C2")


def _finite(name: str, value: float) -> None:
    if not (isinstance(value, (int, float)) and math.isfinite(value)):
        raise ValueError(f"{name} must be a finite number, got {value!r}")


@register_mask("stare")
class STAREMask(TokenMask):
    """STARE: weight W on the top-P surprisal A > 0 tokens (C2: M on A < 0 ones) while entropy < target."""

    variant: str = "O1"
    top_p_ratio: float = 0.1
    reweight_w: float = 1.1
    reweight_m: float = 0.9
    target_entropy: float = 0.3
    adaptive: bool = False
    alpha: float = 0.01
    w_max: float = 1.5
    m_min: float = 0.5
    # the controller's live state (checkpointed): weights after the adaptive schedule, gate, last entropy
    _w: float = field(init=False, repr=False, default=1.0)
    _m: float = field(init=False, repr=False, default=1.0)
    _gate_on: bool = field(init=False, repr=False, default=True)
    _entropy: float = field(init=False, repr=False, default=float("nan"))

    def __post_init__(self):
        if str(self.variant).upper() not in STARE_VARIANTS:
            raise ValueError(f"stare variant must be one of {', '.join(STARE_VARIANTS)}, got {self.variant!r}")
        self.variant = str(self.variant).upper()
        if not (isinstance(self.top_p_ratio, (int, float)) and 0.0 < self.top_p_ratio <= 1.0):
            raise ValueError(f"stare top_p_ratio must be in (0, 1], got {self.top_p_ratio!r}")
        for name in ("reweight_w", "reweight_m", "target_entropy", "alpha", "w_max", "m_min"):
            _finite(f"stare {name}", getattr(self, name))
        if self.reweight_w <= 0 or self.reweight_m < 0:
            raise ValueError(f"stare needs reweight_w > 0 and reweight_m >= 0, got {self.reweight_w}, {self.reweight_m}")
        if self.alpha < 0 or self.w_max < 1.0 or not 0.0 <= self.m_min <= 1.0:
            raise ValueError(f"stare needs alpha >= 0, w_max >= 1 and 0 <= m_min <= 1, got alpha={self.alpha}, "
                             f"w_max={self.w_max}, m_min={self.m_min}")
        if not isinstance(self.adaptive, bool):
            raise ValueError(f"stare adaptive must be true or false, got {self.adaptive!r}")
        self._w, self._m = float(self.reweight_w), float(self.reweight_m)

    def start_step(self, batch_entropy: float) -> None:
        """The released controller's update: gate, then (adaptive) one schedule step; a non-finite
        entropy leaves everything as it was."""
        if not math.isfinite(batch_entropy):
            return
        self._entropy = float(batch_entropy)
        self._gate_on = batch_entropy < self.target_entropy
        if self.adaptive and self.alpha != 0.0:
            sign = float((self.target_entropy > batch_entropy) - (self.target_entropy < batch_entropy))
            self._w = min(max(self._w + self.alpha * sign, 1.0), self.w_max)
            self._m = min(max(self._m - self.alpha * sign, self.m_min), 1.0)

    def state_dict(self) -> dict[str, Any]:
        return {"reweight_w": self._w, "reweight_m": self._m, "gate_on": self._gate_on, "entropy": self._entropy}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not state:  # a checkpoint of a run with a stateless mask: start the schedule afresh
            return
        self._w, self._m = float(state["reweight_w"]), float(state["reweight_m"])
        self._gate_on, self._entropy = bool(state["gate_on"]), float(state["entropy"])

    def gate(self, stats: TokenStats) -> bool:
        """On while the rollout batch's entropy is below the target (strict); the controller's last
        gate when ``stats.batch_entropy`` is missing or not finite."""
        h = stats.batch_entropy
        return h < self.target_entropy if h is not None and math.isfinite(h) else self._gate_on

    def weigh(self, stats: TokenStats):
        valid, adv = stats.response_mask, stats.advantages_bt
        surprisal = -stats.logprobs.detach().float()
        up = global_top_k(surprisal, valid & (adv > 0), self.top_p_ratio)
        down = global_top_k(surprisal, valid & (adv < 0), self.top_p_ratio) if self.variant == "C2" else None
        gate = self.gate(stats)
        weights = torch.ones_like(surprisal)
        if gate:
            weights = torch.where(up, torch.full_like(weights, self._w), weights)
            if down is not None:
                weights = torch.where(down, torch.full_like(weights, self._m), weights)
        return weights, {"gate": torch.tensor(float(gate)), "reweight_w": torch.tensor(self._w),
                         "reweight_m": torch.tensor(self._m)}


@register_mask("clip_cov")
class ClipCovMask(TokenMask):
    """Clip-Cov: zero a random max(1, int(ratio N)) of the unclipped tokens with lb < cov(A, log p) < ub."""

    ratio: float = 2e-4
    lb: float = 1.0
    ub: float = 5.0

    def __post_init__(self):
        for name in ("ratio", "lb", "ub"):
            _finite(f"clip_cov {name}", getattr(self, name))
        if not 0.0 < self.ratio <= 1.0:
            raise ValueError(f"clip_cov ratio must be in (0, 1], got {self.ratio}")
        if not self.lb < self.ub:
            raise ValueError(f"clip_cov needs lb < ub, got lb={self.lb}, ub={self.ub}")

    def weigh(self, stats: TokenStats):
        if stats.seed is None:
            raise ValueError("clip_cov draws its tokens at random: TokenStats.seed must be set (the trainer "
                             "passes its step seed)")
        valid = stats.response_mask
        cov = token_covariance(stats)
        band = valid & ~ratio_clipped(stats) & (cov > self.lb) & (cov < self.ub)
        total = all_reduce_sum_(valid.sum().to(torch.float64))
        count = max(int(self.ratio * float(total)), 1)
        zeroed = global_random_pick(band, count, stats.seed)
        return torch.where(zeroed, 0.0, 1.0), {"clip_cov_band": all_reduce_sum_(band.sum().to(torch.float64))}


def token_covariance(stats: TokenStats) -> torch.Tensor:
    """``(A - mean A)(log p - mean log p)`` per token (fp64), means over the valid tokens of all ranks."""
    valid = stats.response_mask
    adv = stats.advantages_bt.detach().to(torch.float64)
    logp = stats.logprobs.detach().to(torch.float64)
    zero = torch.zeros((), dtype=torch.float64, device=logp.device)
    sums = torch.stack([torch.where(valid, adv, zero).sum(), torch.where(valid, logp, zero).sum(),
                        valid.sum().to(torch.float64)])
    sum_a, sum_lp, n = all_reduce_sum_(sums).unbind()
    n = n.clamp(min=1.0)
    return (adv - sum_a / n) * (logp - sum_lp / n)


def ratio_clipped(stats: TokenStats) -> torch.Tensor:
    """Tokens whose clipped surrogate already differs from the unclipped one (verl's ``clip_by_origin``:
    ``-A clip(rho) > -A rho``); none without ``old_logprobs`` and ``clip_range`` (rho = 1)."""
    if stats.old_logprobs is None or stats.clip_range is None:
        return torch.zeros_like(stats.response_mask)
    low, high = stats.clip_range
    adv = stats.advantages_bt.float()
    ratio = (stats.logprobs.float() - stats.old_logprobs.float()).clamp(-20.0, 20.0).exp()
    return stats.response_mask & (-adv * ratio.clamp(1.0 - low, 1.0 + high) > -adv * ratio)
