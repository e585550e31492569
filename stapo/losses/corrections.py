"""Off-policy corrections from the sampler's and theta_old's log-probs (docs/losses.md, "Off-policy corrections").

Importance weights (``rollout_is``) and rejection (``rollout_rs``) with the names and semantics of verl's
``rollout_corr_helper.py``. A weight multiplies its token's surrogate (a zero keeps it in the normalizer); a
rejected token leaves loss AND normalizer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Union

import torch

from stapo.losses.reduce import all_reduce_sum_, masked_mean, masked_sum
from stapo.registry import Registry

__all__ = ["RS_OPTIONS", "IS_LEVELS", "SAFETY_BOUND", "RejectionBound", "CorrectionResult", "RolloutCorrection",
           "log_ratio", "importance_weights", "normalize_weights", "rs_statistic", "rejected_tokens",
           "parse_rs_thresholds", "parse_is_threshold"]

SAFETY_BOUND = 20.0  # |log r| clamp before exp (verl's): exp(20) ~ 4.9e8 stays finite in fp32
IS_LEVELS = ("token", "sequence")
#: ``rollout_rs`` option -> statistic(log_r, mask): (B, T) per token or (B,) per row; filled below
RS_OPTIONS = Registry("rollout_rs option")
Threshold = Union[float, str]


def check_pair(name_a: str, a: torch.Tensor, name_b: str, b: torch.Tensor, mask: torch.Tensor) -> None:
    """Two log-prob tensors and their bool ``mask`` share one ``(B, T)`` shape, or a ValueError naming them."""
    if a.shape != b.shape or a.shape != mask.shape or a.dim() != 2:
        raise ValueError(f"{name_a} {tuple(a.shape)}, {name_b} {tuple(b.shape)} and mask {tuple(mask.shape)} "
                         "must have the same (B, T) shape")
    if mask.dtype != torch.bool:
        raise ValueError(f"mask must be a bool (B, T) tensor, got {mask.dtype}")


def log_ratio(old_logprobs: torch.Tensor, sampling_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``log pi_old - log pi_sampler`` (B, T) fp32, 0 where ``mask`` is false (padding may hold inf/NaN)."""
    check_pair("old_logprobs", old_logprobs, "sampling_logprobs", sampling_logprobs, mask)
    zero = torch.zeros((), dtype=torch.float32, device=mask.device)
    return torch.where(mask, old_logprobs.detach().float() - sampling_logprobs.detach().float(), zero)


def raw_weights(lr: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    """Untruncated ratios (B, T): ``exp(clamp(log r))`` per token or ``exp(clamp(sum log r))`` per row."""
    if level not in IS_LEVELS:
        raise ValueError(f"rollout_is must be one of {list(IS_LEVELS)} or null, got {level!r}")
    if level == "sequence":
        lr = masked_sum(lr, mask, dim=1)[:, None].expand_as(lr)
    return lr.clamp(-SAFETY_BOUND, SAFETY_BOUND).exp()


def importance_weights(lr: torch.Tensor, mask: torch.Tensor, level: str, upper: float,
                       lower: float | None = None) -> torch.Tensor:
    """IS weights (B, T) fp32, 0 where ``mask`` is false: ``min(raw, upper)`` (TIS), or with ``lower``
    ``raw`` inside ``[lower, upper]`` and 0 outside (IcePop). ``raw``: :func:`raw_weights`."""
    return _threshold(raw_weights(lr, mask, level), mask, upper, lower)


def _threshold(raw: torch.Tensor, mask: torch.Tensor, upper: float, lower: float | None) -> torch.Tensor:
    if lower is None:
        w = raw.clamp(max=upper)
    else:
        w = torch.where((raw >= lower) & (raw <= upper), raw, torch.zeros_like(raw))
    return torch.where(mask, w, torch.zeros_like(w))


def normalize_weights(weights: torch.Tensor, mask: torch.Tensor, level: str, group=None) -> torch.Tensor:
    """``weights / mean``: the mean over valid tokens (``token``) or over rows with a valid token
    (``sequence``, one weight per row) of every rank of ``group``; unchanged when that mean is <= 1e-8."""
    if level == "sequence":
        rows = mask.any(dim=1)  # (B,)
        first = torch.where(mask, weights, torch.zeros_like(weights)).amax(dim=1)  # the row's weight (>= 0)
        sums = torch.stack([first[rows].double().sum(), rows.sum().double()])
    else:
        sums = torch.stack([weights[mask].double().sum(), mask.sum().double()])
    total, count = all_reduce_sum_(sums, group).tolist()
    mean = total / count if count else 0.0
    return weights / mean if mean > 1e-8 else weights


def _divergence(lr: torch.Tensor, kind: str) -> torch.Tensor:
    lr = lr.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    if kind == "k1":
        return -lr
    if kind == "k2":
        return 0.5 * lr.square()
    return lr.exp() - 1.0 - lr  # k3 >= 0


def _register(scope: str, reduce, kinds: tuple[str, ...] = ("k1", "k2", "k3")) -> None:
    """Register the ``rollout_rs`` options ``{scope}_{kind}``: ``reduce(divergence per token, mask)``."""
    for kind in kinds:
        RS_OPTIONS.register(f"{scope}_{kind}")(lambda lr, mask, kind=kind: reduce(_divergence(lr, kind), mask))


def _row_max(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    top = torch.where(mask, x, torch.tensor(float("-inf"), device=x.device)).amax(dim=1)
    return torch.where(mask.any(dim=1), top, torch.zeros_like(top))  # 0 for a row without valid tokens


_register("token", lambda x, mask: x)
_register("seq_sum", lambda x, mask: masked_sum(x, mask, dim=1))
_register("seq_mean", lambda x, mask: masked_mean(x, mask, dim=1))
_register("seq_max", _row_max, kinds=("k2", "k3"))  # k1 = -log r takes both signs: a max would hide a low ratio


def rs_statistic(option: str, lr: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The divergence statistic of ``option``: (B, T) for ``token_*``, (B,) for ``seq_*`` (0 for a
    row without valid tokens)."""
    return RS_OPTIONS.lookup(option)(lr, mask)


@dataclass(frozen=True)
class RejectionBound:
    """One ``rollout_rs`` option and its bounds: k1 statistics pass inside ``[log lower, log upper]``
    (``lower``/``upper`` are ratio bounds), k2/k3 ones at or below ``upper``."""

    option: str
    upper: float
    lower: float | None = None  # k1 options only

    def passes(self, stat: torch.Tensor) -> torch.Tensor:
        if self.lower is None:
            return stat <= self.upper
        return (stat >= math.log(self.lower)) & (stat <= math.log(self.upper))


def _number(text: str, what: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{what}: {text!r} is not a number") from None
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{what}: thresholds must be finite and > 0, got {text!r}")
    return value


def _band(spec: str, what: str) -> tuple[float, float]:
    lo, hi = (_number(part, what) for part in spec.split("_", 1))
    if lo > hi:
        raise ValueError(f"{what}: the band {spec!r} has lower > upper (write both ends with a decimal point, "
                         "e.g. 0.5_2.0: YAML reads 0.5_2 as the number 0.52)")
    return lo, hi


def parse_is_threshold(spec: Threshold) -> tuple[float | None, float]:
    """``(lower, upper)`` of ``rollout_is_threshold``: a number is a truncation cap (``lower`` None),
    ``"lo_hi"`` a band (IcePop)."""
    what = "rollout_is_threshold"
    if isinstance(spec, str) and "_" in spec:
        return _band(spec, what)
    if isinstance(spec, bool) or not isinstance(spec, (int, float, str)):
        raise ValueError(f"{what}: expected a number or 'lower_upper', got {spec!r}")
    return None, _number(str(spec), what)


def parse_rs_thresholds(options: str, spec: Threshold | None) -> tuple[RejectionBound, ...]:
    """The bounds of ``rollout_rs`` (comma-separated options, duplicates dropped) from
    ``rollout_rs_threshold``: one entry per option, or one shared by all (verl's format)."""
    names = list(dict.fromkeys(o.strip() for o in str(options).split(",") if o.strip()))
    unknown = [o for o in names if o not in RS_OPTIONS]
    if not names or unknown:
        raise ValueError(f"rollout_rs: unknown option {(unknown or [options])[0]!r}; "
                         f"available: {', '.join(RS_OPTIONS)}")
    if spec is None:
        raise ValueError(f"rollout_rs={options} needs rollout_rs_threshold (one value per option)")
    specs = [s.strip() for s in str(spec).split(",") if s.strip()]
    if len(specs) not in (1, len(names)):
        raise ValueError(f"rollout_rs_threshold {spec!r}: give one threshold for all options or one per option "
                         f"({len(names)}: {', '.join(names)})")
    bounds = []
    for name, text in zip(names, specs * len(names) if len(specs) == 1 else specs):
        what = f"rollout_rs_threshold of {name}"
        if name.endswith("k1"):
            lo, hi = _band(text, what) if "_" in text else (1.0 / _number(text, what), _number(text, what))
            if lo > hi:
                raise ValueError(f"{what}: {text} < 1 gives the band [{lo:g}, {hi:g}], empty (a single k1 "
                                 "threshold is the upper ratio bound, the lower one is its reciprocal)")
            bounds.append(RejectionBound(name, hi, lo))
        elif "_" in text:
            raise ValueError(f"{what}: k2/k3 statistics take one upper bound, got {text!r}")
        else:
            bounds.append(RejectionBound(name, _number(text, what)))
    return tuple(bounds)


def rejected_tokens(lr: torch.Tensor, mask: torch.Tensor, bounds: tuple[RejectionBound, ...]) -> torch.Tensor:
    """(B, T) bool: valid tokens that fail any bound (a ``seq_*`` failure rejects the whole row)."""
    passed = torch.ones_like(mask)
    for bound in bounds:
        ok = bound.passes(rs_statistic(bound.option, lr, mask))
        passed &= ok if ok.dim() == 2 else ok[:, None]
    return mask & ~passed


@dataclass(frozen=True)
class CorrectionResult:
    """A mini-batch's correction: ``weights`` (B, T) fp32 IS weights or None, ``rejected`` (B, T) bool
    (valid tokens out of the loss), ``sums``: this rank's diagnostics as 0-dim sums (``*_max``: maxima)."""

    weights: torch.Tensor | None
    rejected: torch.Tensor
    sums: dict[str, torch.Tensor] = field(default_factory=dict)


def _is_sums(raw: torch.Tensor, weights: torch.Tensor, mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """verl's IS diagnostics as sums over valid tokens: the untruncated ratios' sum and max, the applied
    weights' sum and sum of squares (ESS = (sum w)^2 / (n sum w^2)) and how many the threshold changed."""
    zero = torch.zeros((), dtype=torch.float32, device=mask.device)
    return {
        "rollout_is_raw_sum": torch.where(mask, raw, zero).sum(),
        "rollout_is_max": torch.where(mask, raw, zero).amax() if mask.any() else zero,
        "rollout_is_weight_sum": weights[mask].double().sum(),  # fp64: the ESS is a ratio of near-equal sums
        "rollout_is_weight_sq_sum": weights[mask].double().square().sum(),
        "rollout_is_clipped": (mask & (weights != raw)).sum().float(),
    }


@dataclass(frozen=True)
class RolloutCorrection:
    """verl's rollout-correction settings (flat, as ``loss.rollout_*``); calling it corrects one
    mini-batch. Invalid settings raise ValueError naming the setting. All off: a no-op."""

    rollout_is: str | None = None  # "token" | "sequence" | None
    rollout_is_threshold: Threshold = 2.0  # truncation cap, or "lo_hi": zero outside the band
    rollout_is_batch_normalize: bool = False
    rollout_rs: str | None = None  # comma-separated RS_OPTIONS
    rollout_rs_threshold: Threshold | None = None  # one per option, or one for all

    def __post_init__(self) -> None:
        if self.rollout_is is not None and self.rollout_is not in IS_LEVELS:
            raise ValueError(f"rollout_is must be one of {list(IS_LEVELS)} or null, got {self.rollout_is!r}")
        parse_is_threshold(self.rollout_is_threshold)
        if self.rollout_is_batch_normalize and self.rollout_is is None:
            raise ValueError("rollout_is_batch_normalize normalizes importance weights, but rollout_is is off "
                             "(null, or auto in lock-step): set rollout_is to token or sequence")
        if self.rollout_rs is not None:
            parse_rs_thresholds(self.rollout_rs, self.rollout_rs_threshold)
        elif self.rollout_rs_threshold is not None:
            raise ValueError("rollout_rs_threshold is set but rollout_rs is not: name the statistics it bounds")

    @property
    def enabled(self) -> bool:
        return self.rollout_is is not None or self.rollout_rs is not None

    @property
    def bounds(self) -> tuple[RejectionBound, ...]:
        return parse_rs_thresholds(self.rollout_rs, self.rollout_rs_threshold) if self.rollout_rs else ()

    @torch.no_grad()
    def __call__(self, sampling_logprobs: torch.Tensor | None, old_logprobs: torch.Tensor, mask: torch.Tensor,
                 group=None) -> CorrectionResult:
        """Correct the valid tokens of ``mask`` (B, T) of a whole mini-batch on this rank (full rows:
        sequence statistics need them); ``group``: the ranks that share the mini-batch (batch norm)."""
        if self.enabled and sampling_logprobs is None:
            raise ValueError("an off-policy correction needs the sampler's log-probs (sampling_logprobs), "
                             "and this batch has none")
        lr = log_ratio(old_logprobs, sampling_logprobs, mask) if self.enabled else None
        rejected = rejected_tokens(lr, mask, self.bounds) if self.rollout_rs else torch.zeros_like(mask)
        sums = {"correction_tokens": mask.sum().float(), "correction_seqs": mask.any(dim=1).sum().float(),
                "rejected_tokens": rejected.sum().float(), "rejected_seqs": rejected.any(dim=1).sum().float()}
        weights = None
        if self.rollout_is is not None:
            lower, upper = parse_is_threshold(self.rollout_is_threshold)
            raw = raw_weights(lr, mask, self.rollout_is)
            weights = _threshold(raw, mask, upper, lower)
            sums.update(_is_sums(raw, weights, mask))
            if self.rollout_is_batch_normalize:
                weights = normalize_weights(weights, mask, self.rollout_is, group)
        return CorrectionResult(weights, rejected, sums)

    def describe(self) -> str:
        """One line: what is corrected and how (the dry run and the trainer's log print it)."""
        parts = []
        if self.rollout_is is not None:
            lower, upper = parse_is_threshold(self.rollout_is_threshold)
            how = f"truncated at {upper:g}" if lower is None else f"zero outside [{lower:g}, {upper:g}]"
            norm = ", batch-normalized" if self.rollout_is_batch_normalize else ""
            parts.append(f"{self.rollout_is}-level importance weights pi_old/pi_sampler, {how}{norm}")
        for b in self.bounds:
            test = (f"exp({b.option}) in [{b.lower:g}, {b.upper:g}]" if b.lower is not None
                    else f"{b.option} <= {b.upper:g}")
            parts.append(f"reject {'sequences' if b.option.startswith('seq') else 'tokens'} unless {test}")
        return "; ".join(parts) or "none"
