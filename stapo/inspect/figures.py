"""The inspector's PNGs (paper Fig. 2a, 2b, 6a, 6b/c), drawn with matplotlib's object API."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import torch
from matplotlib.patches import Rectangle

from stapo.inspect.analysis import SPURIOUS_CLASS, ClassStat
from stapo.inspect.records import TokenRecord
from stapo.plots import finish_axes, new_figure, save_figure

_SIGN_COLORS = ((1, "tab:green", "A > 0"), (-1, "tab:red", "A < 0"), (0, "0.6", "A = 0"))


def plot_prob_entropy_plane(records: Sequence[TokenRecord], out_png: str | Path, *,
                            max_points: int = 20_000, seed: int = 0) -> Path:
    """Probability (log x) vs entropy scatter coloured by advantage sign (paper Fig. 2a), the silenced region
    shaded; silenced and re-weighted tokens always drawn, the others subsampled to ``max_points`` (``seed``)."""
    if not records:
        raise ValueError("plot_prob_entropy_plane needs at least one token record")
    p = torch.cat([r.logprob for r in records]).exp().clamp(min=1e-12)  # (N,)
    h = torch.cat([r.entropy for r in records])
    a = torch.cat([r.advantage for r in records])
    silenced = torch.cat([r.silenced for r in records])
    w = torch.cat([r.weight for r in records])
    reweighted = (w > 0) & (w != 1)  # a weighting mask's tokens: drawn always, as the silenced ones
    others = (~silenced & ~reweighted).nonzero(as_tuple=True)[0]
    if others.numel() > max_points:
        g = torch.Generator().manual_seed(seed)
        others = others[torch.randperm(others.numel(), generator=g)[:max_points]]
    fig, (ax,) = new_figure(1, panel_size=(6.5, 4.8))
    for sign, color, label in _SIGN_COLORS:
        sel = others[torch.sign(a[others]) == sign]
        if sel.numel():
            ax.scatter(p[sel], h[sel], s=4, alpha=0.35, color=color, label=label, linewidths=0)
    tau_p = records[0].thresholds["tau_p"]
    tau_hs = [r.thresholds["tau_h"] for r in records]
    tau_h = sum(tau_hs) / len(tau_hs)
    lo = min(float(p.min()) if p.numel() else tau_p, tau_p) / 2
    ax.add_patch(Rectangle((lo, 0), tau_p - lo, tau_h, color="tab:orange", alpha=0.15,
                           label=f"silenced region (A>0): p<{tau_p:g}, H<τ_h"))
    ax.axvline(tau_p, color="tab:orange", linestyle="--", linewidth=1)
    ax.axhline(tau_h, color="tab:orange", linestyle="--", linewidth=1)
    if silenced.any():
        ax.scatter(p[silenced], h[silenced], s=18, marker="x", color="black",
                   label=f"silenced ({int(silenced.sum())})")
    for sel, marker, label in ((w > 1, "^", "up-weighted"), (reweighted & (w < 1), "v", "down-weighted")):
        if sel.any():
            ax.scatter(p[sel], h[sel], s=14, marker=marker, facecolors="none", edgecolors="tab:blue",
                       linewidths=0.8, label=f"{label} ({int(sel.sum())})")
    ax.set_xscale("log")
    ax.set_xlim(lo, 1.5)
    ax.set_ylim(bottom=0)
    span = f"mean {tau_h:.3f}" if len(set(tau_hs)) == 1 else \
        f"mean {tau_h:.3f}, range {min(tau_hs):.3f}–{max(tau_hs):.3f}"
    ax.set_title(f"token probability vs entropy (τ_h {span})", fontsize=10)
    ax.set_xlabel("probability of the sampled token")
    ax.set_ylabel("entropy (nats)")
    ax.legend(fontsize=7, markerscale=2, loc="upper left")
    return save_figure(fig, out_png)


def plot_grad_norm_by_class(stats: Sequence[ClassStat], out_png: str | Path) -> Path:
    """Bar chart of the mean ‖∇_a J‖ per Table 1 class; the spurious class in red (Fig. 2b)."""
    fig, (ax,) = new_figure(1, panel_size=(8.0, 4.5))
    heights = [0.0 if math.isnan(s.mean_grad_norm) else s.mean_grad_norm for s in stats]
    colors = ["tab:red" if s.index == SPURIOUS_CLASS else "0.55" for s in stats]
    bars = ax.bar(range(len(stats)), heights, color=colors)
    for bar, s in zip(bars, stats):
        note = f"n={s.count}" + ("" if math.isnan(s.rel_to_baseline)
                                 else f"\n{100 * s.rel_to_baseline:+.1f}%")
        ax.annotate(note, (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(stats)), [s.name.replace(", ", "\n") for s in stats], fontsize=7)
    ax.set_ylabel("mean |A|·sqrt(1 − 2p + Σπ²)")
    ax.set_title("gradient norm w.r.t. logits by token class (Lemma A.1, ρ = 1); "
                 "% vs high-H high-p of the same sign", fontsize=9)
    ax.margins(y=0.2)
    return save_figure(fig, out_png)


def plot_token_frequencies(silenced: Counter, kept: Counter, out_png: str | Path,
                           top: int = 20) -> Path:
    """Most frequent silenced vs kept tokens, two horizontal bar charts (paper Fig. 6b/c)."""
    fig, axes = new_figure(2, panel_size=(5.0, max(3.0, 0.25 * top + 1)))
    for ax, counts, title, color in ((axes[0], silenced, "silenced tokens", "tab:red"),
                                     (axes[1], kept, "kept tokens", "tab:blue")):
        items = counts.most_common(top)[::-1]  # largest on top
        total = sum(counts.values())
        if items:
            ax.barh([t for t, _ in items], [c for _, c in items], color=color)
        else:
            ax.text(0.5, 0.5, "none", ha="center", va="center", transform=ax.transAxes)
        ax.set_title(f"most frequent {title} (total {total})", fontsize=10)
        ax.set_xlabel("count")
        ax.tick_params(axis="y", labelsize=8)
    return save_figure(fig, out_png)


def plot_silenced_ratio(points: Sequence[tuple[int, float]], out_png: str | Path) -> Path:
    """Silenced-token ratio over training steps, percent axis (paper Fig. 6a)."""
    fig, (ax,) = new_figure(1, panel_size=(6.0, 3.6))
    pts = [(s, v) for s, v in points if not math.isnan(v)]
    if pts:
        ax.plot([s for s, _ in pts], [v for _, v in pts], marker="o" if len(pts) < 30 else None,
                markersize=3, linewidth=1.2, color="tab:red")
    else:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
    finish_axes(ax, "silenced-token ratio over training", ("silenced_frac",))
    ax.set_ylim(bottom=0)
    ax.set_ylabel("silenced / valid tokens")
    return save_figure(fig, out_png)
