"""Statistics over token records (paper §3.2, Table 1, Fig. 2b, Fig. 6; docs/inspector.md).

Token classes follow paper Table 1 in its row order; class 7 (low H, low p, A > 0) is the spurious one, and
tokens with A = 0 get no class (-1). The gradient-norm proxy is Lemma A.1 at the old policy,
``A² (1 − 2p + Σ_v π(v)²)``. Thresholds are each record's own (``τ_h`` is a per-mini-batch quantile).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from stapo.inspect.records import TokenRecord, load_records

SPURIOUS_CLASS = 7
CLASS_NAMES: tuple[str, ...] = (
    "high H, high p, A<0", "high H, high p, A>0", "high H, low p, A<0", "high H, low p, A>0",
    "low H, high p, A<0", "low H, high p, A>0", "low H, low p, A<0", "low H, low p, A>0",
)


def token_classes(logprob: torch.Tensor, entropy: torch.Tensor, advantage: torch.Tensor,
                  tau_p: float, tau_h: float) -> torch.Tensor:
    """Table 1 class index per token, ``(N,)`` long in 0..7; -1 where A = 0.

    index = 4·[H < τ_h] + 2·[p < τ_p] + [A > 0]; p < τ_p is compared in log space as the masks do.
    """
    low_h = (entropy < tau_h).long()
    low_p = (logprob < math.log(tau_p)).long()
    pos = (advantage > 0).long()
    cls = 4 * low_h + 2 * low_p + pos  # (N,)
    return cls.masked_fill(advantage == 0, -1)


def grad_norm_proxy(logprob: torch.Tensor, collision: torch.Tensor,
                    advantage: torch.Tensor) -> torch.Tensor:
    """Lemma A.1 with ρ = 1: ``A² (1 − 2p + Σπ²)`` per token ``(N,)`` (≥ 0 up to rounding)."""
    p = logprob.exp()
    return advantage.square() * (1 - 2 * p + collision).clamp(min=0)


def spurious_mask(record: TokenRecord, tau_p: float | None = None,
                  tau_h: float | None = None) -> torch.Tensor:
    """STAPO's criterion ``A > 0 ∧ p < τ_p ∧ H < τ_h`` ``(N,)``, whatever mask was active."""
    tau_p = record.thresholds["tau_p"] if tau_p is None else tau_p
    tau_h = record.thresholds["tau_h"] if tau_h is None else tau_h
    return (record.advantage > 0) & (record.logprob < math.log(tau_p)) & (record.entropy < tau_h)


@dataclass(frozen=True)
class ClassStat:
    """One row of the gradient-norm table (paper Fig. 2b)."""

    index: int
    name: str
    count: int
    frac: float              # of tokens with A ≠ 0
    silenced: int            # how many the active mask silenced
    mean_grad_norm_sq: float  # mean A²(1 − 2p + Σπ²); NaN for an empty class
    mean_grad_norm: float     # mean of its square root, ‖∇_a J‖
    rel_to_baseline: float    # mean_grad_norm / that of "high H, high p" with the same A sign − 1


def grad_norm_by_class(records: Sequence[TokenRecord]) -> list[ClassStat]:
    """Mean gradient-norm proxy per Table 1 class over all records (8 rows, Table 1 order)."""
    if not records:
        raise ValueError("grad_norm_by_class needs at least one token record")
    cls = torch.cat([token_classes(r.logprob, r.entropy, r.advantage, r.thresholds["tau_p"],
                                   r.thresholds["tau_h"]) for r in records])  # (N,)
    sq = torch.cat([grad_norm_proxy(r.logprob, r.collision, r.advantage) for r in records])
    silenced = torch.cat([r.silenced for r in records])
    signed = int((cls >= 0).sum())
    stats = []
    for c in range(8):
        sel = cls == c
        n = int(sel.sum())
        norm = float(sq[sel].double().sqrt().mean()) if n else math.nan
        base = norm if c < 2 else stats[c % 2].mean_grad_norm  # class 0 (A<0) or 1 (A>0): high H, high p
        stats.append(ClassStat(
            index=c, name=CLASS_NAMES[c], count=n, frac=n / signed if signed else math.nan,
            silenced=int((sel & silenced).sum()), mean_grad_norm_sq=float(sq[sel].double().mean()) if n else math.nan,
            mean_grad_norm=norm, rel_to_baseline=norm / base - 1 if base and not math.isnan(base) else math.nan))
    return stats


WEIGHT_CLASSES: tuple[str, ...] = ("up-weighted (w > 1)", "down-weighted (0 < w < 1)", "silenced (w = 0)",
                                    "rejected (off-policy correction)", "S2T: A>0, p<τ_p, H<τ_h")


@dataclass(frozen=True)
class WeightClassStat:
    """Where the active mask's re-weighted tokens sit, next to STAPO's S2T class (one table row)."""

    name: str
    count: int
    frac: float            # of all valid tokens
    s2t_overlap: int       # how many also meet the S2T criterion
    mean_weight: float
    median_prob: float
    mean_entropy: float
    positive_frac: float   # share with A > 0
    mean_grad_norm: float  # mean sqrt(A²(1 − 2p + Σπ²)), the Lemma A.1 proxy; NaN when empty


def weight_classes(records: Sequence[TokenRecord]) -> list[WeightClassStat]:
    """Up-weighted, down-weighted and silenced tokens of the active mask, the tokens the off-policy
    correction rejected (``loss.rollout_rs``: out of the loss whatever the mask decided) and the S2T
    class, over all records: their place on the probability–entropy plane and their gradient-norm proxy."""
    if not records:
        raise ValueError("weight_classes needs at least one token record")
    w = torch.cat([r.weight for r in records])
    s2t = torch.cat([spurious_mask(r) for r in records])
    rejected = torch.cat([r.rejected for r in records])
    cat = {name: torch.cat([getattr(r, name) for r in records]) for name in ("logprob", "entropy", "advantage")}
    norm = torch.cat([grad_norm_proxy(r.logprob, r.collision, r.advantage) for r in records]).double().sqrt()
    selections = (w > 1, (w > 0) & (w < 1), w == 0, rejected, s2t)
    out = []
    for name, sel in zip(WEIGHT_CLASSES, selections):
        n = int(sel.sum())
        mean = (lambda t: float(t[sel].double().mean()) if n else math.nan)  # noqa: E731
        out.append(WeightClassStat(
            name=name, count=n, frac=n / w.numel() if w.numel() else math.nan, s2t_overlap=int((sel & s2t).sum()),
            mean_weight=mean(w), median_prob=float(cat["logprob"][sel].exp().median()) if n else math.nan,
            mean_entropy=mean(cat["entropy"]), positive_frac=mean((cat["advantage"] > 0).float()),
            mean_grad_norm=mean(norm)))
    return out


def display_token(text: str) -> str:
    """A token as a visible word: surrounding whitespace stripped, whitespace-only made visible."""
    stripped = text.strip()
    if stripped:
        return stripped
    return text.replace("\n", "⏎").replace("\t", "⇥").replace(" ", "␣") or "∅"


def token_frequencies(records: Sequence[TokenRecord]) -> tuple[Counter, Counter]:
    """(silenced, kept) counts of :func:`display_token` texts over all records (paper Fig. 6b/c)."""
    silenced, kept = Counter(), Counter()
    for r in records:
        for text, s, k in zip(r.token_text, r.silenced.tolist(), r.kept.tolist()):
            if s:
                silenced[display_token(text)] += 1
            elif k:
                kept[display_token(text)] += 1
    return silenced, kept


def silenced_ratio_from_records(records: Sequence[TokenRecord]) -> list[tuple[int, float]]:
    """(step, silenced / valid tokens) summed over each step's recorded mini-batches."""
    acc: dict[int, list[int]] = {}
    for r in records:
        a = acc.setdefault(r.step, [0, 0])
        a[0] += int(r.silenced.sum())
        a[1] += r.num_tokens
    return [(s, n_sil / n if n else math.nan) for s, (n_sil, n) in sorted(acc.items())]


def silenced_ratio_over_training(run_dir: str | Path, records: Sequence[TokenRecord] | None = None
                                 ) -> list[tuple[int, float]]:
    """(step, silenced_frac) from ``metrics.jsonl`` (paper Fig. 6a); falls back to the (already loaded) records."""
    from stapo.plots import series
    from stapo.run_dir import METRICS_FILE, read_metrics

    path = Path(run_dir) / METRICS_FILE
    if path.exists():
        steps, values = series(read_metrics(path), "silenced_frac")
        if steps:
            return list(zip(steps, values))
    return silenced_ratio_from_records(records if records is not None else load_records(run_dir))
