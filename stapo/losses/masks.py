"""Token masks: which response tokens contribute to the loss (paper §3.3, Algorithm 1 lines 7-10).

One meaning of mask everywhere: ``keep`` is True where a token contributes. A mask strategy is a
small dataclass (its fields are its parameters) that implements ONE method, ``silence(stats)``,
returning a bool ``(B, T)`` tensor of tokens to silence (optionally with a dict of the thresholds
it used). The base class turns that into ``keep = response_mask & ~silenced``, so no mask can ever
keep padding, and ``apply`` reports what was silenced without storing state on the mask.

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
live in ``builtin_masks.py``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Union

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

    @property
    def advantages_bt(self) -> torch.Tensor:
        """Advantages broadcast to ``(B, T)`` (a view, no copy)."""
        if self.advantages.dim() == 1:
            return self.advantages[:, None].expand_as(self.logprobs)
        return self.advantages


@dataclass
class MaskResult:
    """Outcome of one mask application; all tensors ``(B, T)`` bool unless noted."""

    keep: torch.Tensor  # valid & ~silenced: tokens that contribute to the loss
    silenced: torch.Tensor  # valid & not kept
    thresholds: dict[str, torch.Tensor] = field(default_factory=dict)  # 0-dim, e.g. {"tau_h": ..}


SilenceOutput = Union[torch.Tensor, "tuple[torch.Tensor, dict[str, torch.Tensor]]"]


@dataclass
class TokenMask:
    """Base class of mask strategies. Subclasses implement ``silence`` only.

    ``silence(stats)`` returns a bool ``(B, T)`` tensor (or one that broadcasts to it, e.g. a
    ``(T,)`` positional rule), True = silence this token, or a pair
    ``(silenced, thresholds)``. Its value on padding does not matter: the base class intersects
    with ``stats.response_mask``. Quantile thresholds should use
    ``stapo.losses.masked_quantile`` so that they are global over ranks when distributed.
    """

    def silence(self, stats: TokenStats) -> SilenceOutput:
        raise NotImplementedError(f"{type(self).__name__} must implement silence(stats)")

    def apply(self, stats: TokenStats) -> MaskResult:
        """Keep tensor plus what was silenced and the thresholds used."""
        out = self.silence(stats)
        raw, thresholds = out if isinstance(out, tuple) else (out, {})
        shape = stats.logprobs.shape
        ok = isinstance(raw, torch.Tensor) and raw.dtype == torch.bool
        try:
            raw = torch.broadcast_to(raw, shape) if ok else raw
        except RuntimeError:
            ok = False
        if not ok:
            got = f"{raw.dtype} {tuple(raw.shape)}" if isinstance(raw, torch.Tensor) else type(raw).__name__
            raise TypeError(
                f"{type(self).__name__}.silence must return a bool tensor broadcastable to "
                f"{tuple(shape)}, got {got}"
            )
        valid = stats.response_mask
        silenced = valid & raw
        return MaskResult(keep=valid & ~raw, silenced=silenced, thresholds=dict(thresholds))

    def mask(self, stats: TokenStats) -> torch.Tensor:
        """Bool ``(B, T)`` keep tensor, never True on padding."""
        return self.apply(stats).keep

    __call__ = mask


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


def _lookup(name: str) -> type[TokenMask]:
    if name not in _REGISTRY:
        raise ValueError(f"unknown mask {name!r}; available masks: {', '.join(available_masks())}")
    return _REGISTRY[name]


def mask_params(name: str) -> dict[str, Any]:
    """Parameters of mask ``name`` with their defaults (``dataclasses.MISSING`` if required)."""
    out = {}
    for f in dataclasses.fields(_lookup(name)):
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
    cls = _lookup(name)
    valid = mask_params(name)
    unknown = sorted(set(params) - set(valid))
    if unknown:
        listed = ", ".join(f"{k}={v!r}" for k, v in valid.items()) or "(none)"
        raise ValueError(f"unknown parameter(s) {unknown} for mask {name!r}; valid parameters: {listed}")
    return cls(**params)
