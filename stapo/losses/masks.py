"""Token masks: which response tokens contribute to the loss (paper §3.3, Algorithm 1 lines 7-10).

One meaning of mask everywhere: ``keep`` is True where a token contributes. A mask strategy is a
small dataclass (its fields are its parameters) that implements ONE method: either
``silence(stats)``, returning a bool ``(B, T)`` tensor of tokens to silence, or ``weigh(stats)``,
returning float ``(B, T)`` token weights (each optionally with a dict of the thresholds it used).
The base class turns that into ``keep``, ``silenced`` and ``weights`` (float, 0 on padding and on
silenced tokens, 1 on the kept tokens of a plain mask), so no strategy can ever keep padding. The
loss multiplies each token's clipped surrogate by its weight and divides by the number of tokens
with ``weight > 0`` (docs/losses.md, "Token weights"): a plain mask's losses are bit-identical.

A strategy with state across steps (STARE's adaptive weights) overrides ``start_step`` (called once
per step with the rollout batch's mean entropy) and ``state_dict`` / ``load_state_dict`` (saved in
the trainer's checkpoint, so a resumed run continues exactly).

One registry (a dict + decorator + getter; unknown names list the valid ones) makes a strategy available to
``build_mask``, configs and ``stapo masks``. Adding your own takes ~10 lines::

    import math
    from dataclasses import dataclass
    from stapo.losses import TokenMask, TokenStats, register_mask, build_mask

    @register_mask("neg_low_prob")
    @dataclass
    class NegLowProb(TokenMask):
        \"\"\"Silence negative-advantage tokens with p < tau_p.\"\"\"
        tau_p: float = 1e-3

        def silence(self, stats: TokenStats):
            return (stats.advantages_bt < 0) & (stats.logprobs < math.log(self.tau_p))

    keep = build_mask("neg_low_prob", tau_p=1e-4)(stats)  # (B, T) bool

The built-ins (``none``, ``stapo``, ``prob_only``, ``high_entropy_low_prob``, ``entropy_top``)
live in ``builtin_masks.py``; the weighting ones (``stare``, ``clip_cov``) in ``weighting_masks.py``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import torch

__all__ = [
    "TokenStats",
    "MaskResult",
    "TokenMask",
    "MaskInfo",
    "register_mask",
    "build_mask",
    "available_masks",
    "mask_params",
    "mask_class",
    "describe_masks",
    "registered_name",
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
        for name in ("entropy", "response_mask"):
            if getattr(self, name).shape != shape:
                raise ValueError(
                    f"TokenStats.{name} shape {tuple(getattr(self, name).shape)} != logprobs shape {tuple(shape)}"
                )
        if self.response_mask.dtype != torch.bool:
            raise ValueError(f"TokenStats.response_mask must be torch.bool, got {self.response_mask.dtype}")
        if self.advantages.shape not in (shape[:1], shape):
            raise ValueError(
                f"TokenStats.advantages must be (B,) = ({shape[0]},) or (B, T) = {tuple(shape)}, "
                f"got {tuple(self.advantages.shape)}"
            )
        if self.old_logprobs is not None and self.old_logprobs.shape != shape:
            raise ValueError(
                f"TokenStats.old_logprobs shape {tuple(self.old_logprobs.shape)} != logprobs shape {tuple(shape)}"
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
    """Base class of mask strategies. Subclasses implement ``silence`` OR ``weigh``.

    ``silence(stats)`` returns a bool ``(B, T)`` tensor (or one that broadcasts to it, e.g. a
    ``(T,)`` positional rule), True = silence this token, or a pair
    ``(silenced, thresholds)``. ``weigh(stats)`` returns a float tensor of finite weights ``>= 0``
    that broadcasts to ``(B, T)`` (0 = silence, 1 = as GRPO, 1.1 = up-weight), or a pair
    ``(weights, thresholds)``. Values on padding do not matter: the base class intersects with
    ``stats.response_mask``. Quantile thresholds and top-k selections should be global over ranks
    (``stapo.losses.masked_quantile``) so that the update does not depend on the data split.
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
        out = self.silence(stats)
        raw, thresholds = out if isinstance(out, tuple) else (out, {})
        raw = _broadcast(raw, stats, lambda t: t.dtype == torch.bool, f"{type(self).__name__}.silence", "a bool")
        valid = stats.response_mask
        silenced = valid & raw
        return MaskResult(keep=valid & ~raw, silenced=silenced, thresholds=dict(thresholds))

    def _apply_weights(self, stats: TokenStats) -> MaskResult:
        out = self.weigh(stats)
        raw, thresholds = out if isinstance(out, tuple) else (out, {})
        raw = _broadcast(raw, stats, lambda t: t.is_floating_point(), f"{type(self).__name__}.weigh", "a float")
        valid = stats.response_mask
        weights = torch.where(valid, raw.detach().float(), torch.zeros((), device=raw.device))
        bad = valid & ~(torch.isfinite(weights) & (weights >= 0))
        if bad.any():
            raise ValueError(f"{type(self).__name__}.weigh returned {int(bad.sum())} weight(s) that are negative "
                             f"or not finite, e.g. {weights[bad][0].item()}; weights must be finite and >= 0")
        keep = weights > 0
        return MaskResult(keep=keep, silenced=valid & ~keep, thresholds=dict(thresholds), weights=weights)

    def mask(self, stats: TokenStats) -> torch.Tensor:
        """Bool ``(B, T)`` keep tensor, never True on padding."""
        return self.apply(stats).keep

    __call__ = mask


def _broadcast(raw, stats: TokenStats, dtype_ok, what: str, kind: str) -> torch.Tensor:
    """``raw`` broadcast to ``(B, T)``, or a TypeError naming what ``what`` returned."""
    shape = stats.logprobs.shape
    ok = isinstance(raw, torch.Tensor) and dtype_ok(raw)
    try:
        raw = torch.broadcast_to(raw, shape) if ok else raw
    except RuntimeError:
        ok = False
    if not ok:
        got = f"{raw.dtype} {tuple(raw.shape)}" if isinstance(raw, torch.Tensor) else type(raw).__name__
        raise TypeError(f"{what} must return {kind} tensor broadcastable to {tuple(shape)}, got {got}")
    return raw


_REGISTRY: dict[str, type[TokenMask]] = {}


def register_mask(name: str):
    """Class decorator: make a ``TokenMask`` subclass buildable as ``build_mask(name, ...)``.

    The class is turned into a dataclass if it is not one already. Registering a different class
    under a taken name raises ``ValueError``; re-registering the same class (same object, or the
    same module + qualified name, as when a notebook cell is re-run) replaces it silently.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"mask name must be a non-empty string, got {name!r}")

    def decorate(cls):
        if not (isinstance(cls, type) and issubclass(cls, TokenMask)):
            raise TypeError(f"@register_mask({name!r}) needs a TokenMask subclass, got {cls!r}")
        if "__dataclass_fields__" not in cls.__dict__:
            cls = dataclass(cls)
        old = _REGISTRY.get(name)
        if old is not None and old is not cls and (old.__module__, old.__qualname__) != (cls.__module__, cls.__qualname__):
            raise ValueError(
                f"mask name {name!r} is already registered to {old.__module__}.{old.__qualname__}; "
                f"pick another name for {cls.__module__}.{cls.__qualname__}"
            )
        _REGISTRY[name] = cls
        return cls

    return decorate


def available_masks() -> list[str]:
    """Sorted names accepted by ``build_mask``."""
    return sorted(_REGISTRY)


def registered_name(mask: TokenMask | type[TokenMask]) -> str | None:
    """The name ``mask`` (an instance or class) is registered under, or None."""
    cls = mask if isinstance(mask, type) else type(mask)
    return next((name for name, registered in _REGISTRY.items() if registered is cls), None)


def _listing() -> str:
    """The registry's names, the silencing masks first, then the token-weighting ones."""
    weighing = [n for n in available_masks() if _REGISTRY[n].weigh is not TokenMask.weigh]
    silencing = ", ".join(n for n in available_masks() if n not in weighing)
    return f"{silencing}; token-weighting masks: {', '.join(weighing)}" if weighing else silencing


def mask_class(name: str) -> type[TokenMask]:
    """The class registered as mask ``name`` (ValueError listing the masks when there is none)."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown mask {name!r}; available masks: {_listing()}")
    return _REGISTRY[name]


def mask_params(name: str) -> dict[str, Any]:
    """Parameters of mask ``name`` with their defaults (``dataclasses.MISSING`` if required)."""
    out = {}
    for f in dataclasses.fields(mask_class(name)):
        if not f.init:
            continue
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        out[f.name] = default
    return out


@dataclass(frozen=True)
class MaskInfo:
    """One registry entry, for listings such as ``stapo masks``."""

    name: str
    summary: str  # first line of the class docstring
    params: dict[str, Any]  # name -> default (dataclasses.MISSING if required)


def describe_masks() -> list[MaskInfo]:
    """Every registered mask with its one-line summary and parameters, sorted by name."""
    infos = []
    for name in available_masks():
        doc = (_REGISTRY[name].__doc__ or "").strip()
        infos.append(MaskInfo(name, doc.splitlines()[0] if doc else "", mask_params(name)))
    return infos


def build_mask(name: str, **params: Any) -> TokenMask:
    """Instantiate the mask registered as ``name`` with ``params`` (validated by the mask)."""
    cls = mask_class(name)
    valid = mask_params(name)
    unknown = sorted(set(params) - set(valid))
    if unknown:
        listed = ", ".join(f"{k}={v!r}" for k, v in valid.items()) or "(none)"
        raise ValueError(f"unknown parameter(s) {unknown} for mask {name!r}; valid parameters: {listed}")
    return cls(**params)
