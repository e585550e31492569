"""Token masks: which response tokens contribute to the loss (paper §3.3, Algorithm 1 lines 7-10).

The base class intersects a strategy's ``silence``/``weigh`` output with the response mask, so no strategy can
keep padding (docs/losses.md, "Token masks" and "Your own mask").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Union

import torch

from stapo.losses.reduce import check_like_logprobs
from stapo.registry import Registry

__all__ = [
    "TokenStats",
    "MaskResult",
    "TokenMask",
    "MASKS",
    "register_mask",
    "build_mask",
    "available_masks",
    "mask_params",
    "describe_masks",
    "registered_name",
    "mask_class",
]


@dataclass
class TokenStats:
    """What a mask may look at, for the current policy on one mini-batch (Algorithm 1 lines 7-10; docs/losses.md)."""

    logprobs: torch.Tensor  # (B, T) log pi_theta(y_t), fp32
    entropy: torch.Tensor  # (B, T) entropy of pi_theta(. | y_<t)
    advantages: torch.Tensor  # (B,) per response, or (B, T) per token
    response_mask: torch.Tensor  # (B, T) bool, True on real response tokens
    # Optional, filled by the trainer (docs/losses.md, "Token weights"); each strategy documents what it
    # does without one (clip_cov: rho = 1 without old_logprobs, an error without seed).
    old_logprobs: Optional[torch.Tensor] = None  # (B, T) log pi_theta_old(y_t): the ratio (clip_cov)
    clip_range: Optional[tuple[float, float]] = None  # the loss's (clip_low, clip_high) (clip_cov)
    batch_entropy: Optional[float] = None  # token-mean entropy of the whole rollout batch, all ranks,
    #                                        from the step's no-grad pass before the update (stare's gate)
    seed: Optional[int] = None  # the trainer's seed for this step and mini-batch, same on every rank (clip_cov)

    def __post_init__(self):
        if self.logprobs.dim() != 2:
            raise ValueError(f"TokenStats.logprobs must be (B, T), got {tuple(self.logprobs.shape)}")
        shape = self.logprobs.shape
        check_like_logprobs(shape, "TokenStats.", entropy=self.entropy, response_mask=self.response_mask,
                            old_logprobs=self.old_logprobs)
        if self.response_mask.dtype != torch.bool:
            raise ValueError(f"TokenStats.response_mask must be torch.bool, got {self.response_mask.dtype}")
        if self.advantages.shape not in (shape[:1], shape):
            raise ValueError(
                f"TokenStats.advantages must be (B,) = ({shape[0]},) or (B, T) = {tuple(shape)}, "
                f"got {tuple(self.advantages.shape)}"
            )

    @property
    def advantages_bt(self) -> torch.Tensor:
        """Advantages broadcast to ``(B, T)`` (a view, no copy)."""
        if self.advantages.dim() == 1:
            return self.advantages[:, None].expand_as(self.logprobs)
        return self.advantages


@dataclass
class MaskResult:
    """Outcome of one mask application; all tensors ``(B, T)`` bool unless noted."""

    keep: torch.Tensor  # valid & ~silenced: tokens that contribute to the loss (weight > 0)
    silenced: torch.Tensor  # valid & not kept (weight 0)
    thresholds: dict[str, torch.Tensor] = field(default_factory=dict)  # 0-dim, e.g. {"tau_h": ..}
    weights: Optional[torch.Tensor] = None  # (B, T) float32: 0 off keep, 1 on keep for a plain mask
    upweighted: Optional[torch.Tensor] = None  # kept tokens with weight > 1
    downweighted: Optional[torch.Tensor] = None  # kept tokens with 0 < weight < 1

    def __post_init__(self):
        if self.weights is None:
            self.weights = self.keep.float()
        if self.upweighted is None:
            self.upweighted = self.keep & (self.weights > 1.0)
        if self.downweighted is None:
            self.downweighted = self.keep & (self.weights < 1.0)


SilenceOutput = Union[torch.Tensor, "tuple[torch.Tensor, dict[str, torch.Tensor]]"]
WeighOutput = SilenceOutput  # float weights instead of a bool tensor


@dataclass
class TokenMask:
    """Base class of mask strategies: implement ``silence`` (bool, True = silence) OR ``weigh`` (finite
    float weights ``>= 0``), each broadcastable to ``(B, T)``, optionally paired with a dict of thresholds.
    Thresholds should be global over ranks (``masked_quantile``) so the update does not depend on the split.
    """

    def silence(self, stats: TokenStats) -> SilenceOutput:
        raise NotImplementedError(f"{type(self).__name__} must implement silence(stats) or weigh(stats)")

    def weigh(self, stats: TokenStats) -> WeighOutput:
        raise NotImplementedError(f"{type(self).__name__} must implement silence(stats) or weigh(stats)")

    # ---- state across steps (no-ops for a stateless strategy) --------------------------------
    def start_step(self, batch_entropy: float) -> None:
        """Called by the trainer once per step, before its first mini-batch, with the rollout batch's
        token-mean entropy (all ranks): where a strategy's schedule advances."""

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint must hold for a resumed run to continue exactly (plain Python values)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state_dict()``'s output; ``{}`` (a checkpoint of a stateless mask) changes nothing."""

    # ---- application -------------------------------------------------------------------------
    @property
    def weighs(self) -> bool:
        """True for a strategy that implements ``weigh`` (rather than ``silence``)."""
        return type(self).weigh is not TokenMask.weigh

    def apply(self, stats: TokenStats) -> MaskResult:
        """Keep tensor, weights, what was silenced / re-weighted and the thresholds used."""
        if self.weighs:
            return self._apply_weights(stats)
        raw, thresholds = _output(self.silence(stats), stats, lambda t: t.dtype == torch.bool,
                                  f"{type(self).__name__}.silence", "a bool")
        valid = stats.response_mask
        return MaskResult(keep=valid & ~raw, silenced=valid & raw, thresholds=thresholds)

    def _apply_weights(self, stats: TokenStats) -> MaskResult:
        raw, thresholds = _output(self.weigh(stats), stats, lambda t: t.is_floating_point(),
                                  f"{type(self).__name__}.weigh", "a float")
        valid = stats.response_mask
        weights = torch.where(valid, raw.detach().float(), torch.zeros((), device=raw.device))
        bad = valid & ~(torch.isfinite(weights) & (weights >= 0))
        if bad.any():
            raise ValueError(f"{type(self).__name__}.weigh returned {int(bad.sum())} weight(s) that are negative "
                             f"or not finite, e.g. {weights[bad][0].item()}; weights must be finite and >= 0")
        keep = weights > 0
        return MaskResult(keep=keep, silenced=valid & ~keep, thresholds=thresholds, weights=weights)

    def mask(self, stats: TokenStats) -> torch.Tensor:
        """Bool ``(B, T)`` keep tensor, never True on padding."""
        return self.apply(stats).keep

    __call__ = mask


def _output(out, stats: TokenStats, dtype_ok, what: str, kind: str) -> tuple[torch.Tensor, dict]:
    """``what``'s output as ``(tensor broadcast to (B, T), thresholds)``, or a TypeError naming what it returned."""
    raw, thresholds = out if isinstance(out, tuple) else (out, {})
    shape = stats.logprobs.shape
    ok = isinstance(raw, torch.Tensor) and dtype_ok(raw)
    try:
        raw = torch.broadcast_to(raw, shape) if ok else raw
    except RuntimeError:
        ok = False
    if not ok:
        got = f"{raw.dtype} {tuple(raw.shape)}" if isinstance(raw, torch.Tensor) else type(raw).__name__
        raise TypeError(f"{what} must return {kind} tensor broadcastable to {tuple(shape)}, got {got}")
    return raw, dict(thresholds)


def _listing(registry) -> str:
    """The masks' names, the silencing ones first, then the token-weighting ones."""
    weighing = [n for n in registry.names() if registry[n].weigh is not TokenMask.weigh]
    silencing = ", ".join(n for n in registry.names() if n not in weighing)
    return f"available masks: {silencing}" + (f"; token-weighting masks: {', '.join(weighing)}" if weighing else "")


MASKS = Registry("mask", base=TokenMask, listing=_listing)
register_mask = MASKS.register  # class decorator: a TokenMask subclass (made a dataclass) under a name
available_masks = MASKS.names  # sorted names accepted by build_mask
mask_params = MASKS.params  # parameters with their defaults (dataclasses.MISSING if required)
describe_masks = MASKS.describe  # RegistryEntry(name, summary, params, obj) per mask, for `stapo masks`
build_mask = MASKS.build  # an instance; an unknown parameter is an error naming the valid ones
registered_name = MASKS.name_of  # the name a mask (instance or class) is registered under, or None
mask_class = MASKS.lookup  # the class registered under a name (an error listing the masks when none is)
