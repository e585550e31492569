"""Built-in mask strategies: STAPO's S2T mask, its ablations and the baselines (docs/losses.md).

``tau_p`` is absolute (Remark 3.5) and compared in log space; ``tau_h`` is the ``entropy_quantile`` (q) quantile
of the mini-batch's valid-token entropy on all ranks: the paper's "tau_h = 20%" (§5.3) is q = 0.8.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from stapo.losses.masks import TokenMask, TokenStats, build_mask, register_mask
from stapo.losses.reduce import masked_quantile

__all__ = ["NoMask", "STAPOMask", "ProbOnlyMask", "HighEntropyLowProbMask", "EntropyTopMask", "spurious_probe"]

DEFAULT_TAU_P = 2e-3
DEFAULT_ENTROPY_QUANTILE = 0.8


def _low_prob_positive(stats: TokenStats, tau_p: float) -> torch.Tensor:
    """``A > 0 and p < tau_p`` as a bool ``(B, T)`` tensor."""
    return (stats.advantages_bt > 0) & (stats.logprobs < math.log(tau_p))


def _entropy_threshold(stats: TokenStats, q: float) -> torch.Tensor:
    """``tau_h``: the q-quantile of entropy over valid tokens (all ranks), 0-dim."""
    return masked_quantile(stats.entropy, stats.response_mask, q)


@register_mask("none")
class NoMask(TokenMask):
    """Keep every valid token (GRPO / JustRL / DAPO baselines)."""

    def silence(self, stats: TokenStats) -> torch.Tensor:
        return torch.zeros_like(stats.response_mask)


class _ThresholdMask(TokenMask):
    """Checks the thresholds a subclass declares: ``tau_p`` and ``entropy_quantile``."""

    def __post_init__(self):
        tau_p, q = getattr(self, "tau_p", 1.0), getattr(self, "entropy_quantile", 0.0)
        if not 0.0 < tau_p <= 1.0:
            raise ValueError(f"tau_p must be in (0, 1] (an absolute probability), got {tau_p}")
        if not 0.0 <= q <= 1.0:
            raise ValueError(f"entropy_quantile must be in [0, 1], got {q}")


@dataclass
class _LowProbEntropyMask(_ThresholdMask):
    """The parameters of the masks that split ``A > 0 and p < tau_p`` by ``tau_h``."""

    tau_p: float = DEFAULT_TAU_P
    entropy_quantile: float = DEFAULT_ENTROPY_QUANTILE


@register_mask("stapo")
class STAPOMask(_LowProbEntropyMask):
    """S2T: silence spurious tokens, A > 0 and p < tau_p and H < tau_h (Algorithm 1 line 10)."""

    def silence(self, stats: TokenStats):
        tau_h = _entropy_threshold(stats, self.entropy_quantile)
        return _low_prob_positive(stats, self.tau_p) & (stats.entropy < tau_h), {"tau_h": tau_h}


@register_mask("prob_only")
class ProbOnlyMask(_ThresholdMask):
    """Ablation: silence A > 0 and p < tau_p, whatever the entropy (Fig. 5)."""

    tau_p: float = DEFAULT_TAU_P

    def silence(self, stats: TokenStats) -> torch.Tensor:
        return _low_prob_positive(stats, self.tau_p)


@register_mask("high_entropy_low_prob")
class HighEntropyLowProbMask(_LowProbEntropyMask):
    """Ablation: silence A > 0 and p < tau_p and H >= tau_h (Fig. 5)."""

    def silence(self, stats: TokenStats):
        tau_h = _entropy_threshold(stats, self.entropy_quantile)
        return _low_prob_positive(stats, self.tau_p) & (stats.entropy >= tau_h), {"tau_h": tau_h}


@register_mask("entropy_top")
class EntropyTopMask(_ThresholdMask):
    """20-Entropy: silence every token with H < tau_h, keeping the top 1 - q by entropy (q = 0.8: 20%)."""

    entropy_quantile: float = DEFAULT_ENTROPY_QUANTILE

    def silence(self, stats: TokenStats):
        tau_h = _entropy_threshold(stats, self.entropy_quantile)
        return stats.entropy < tau_h, {"tau_h": tau_h}


def spurious_probe(mask: TokenMask) -> TokenMask:
    """The S2T criterion (``stapo`` mask) at the active mask's ``tau_p`` / ``entropy_quantile`` where it
    has them, the paper's defaults otherwise: ``spurious_frac`` then follows a tau_p / tau_h sweep."""
    params = {name: getattr(mask, name) for name in ("tau_p", "entropy_quantile") if hasattr(mask, name)}
    return build_mask("stapo", **params)
