"""The stability study's report, from its per-run rows alone (docs/stability/results.jsonl).

``render`` gives the generated block of docs/stability.md (per-mask summary with mean ± standard error
over seeds, every run's row), ``plot_curves`` its figure. Rows are those of ``bench/stability.py``:
accuracies and fractions as fractions, ``status`` done / failed / pending; pending rows, and failed ones
that stopped before their first iteration, have no ``eval_curve`` and no summaries.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path

BEGIN, END = "<!-- BEGIN stability -->", "<!-- END stability -->"


def _mean_se(values: list[float], scale: float = 100.0, digits: int = 1) -> str:
    if not values:
        return "–"
    mean = scale * statistics.fmean(values)
    if len(values) < 2:
        return f"{mean:.{digits}f}"
    return f"{mean:.{digits}f} ± {scale * statistics.stdev(values) / math.sqrt(len(values)):.{digits}f}"


def _groups(rows: list[dict]) -> list[tuple[float, str, list[dict]]]:
    """(lr, mask, rows) in first-appearance order."""
    keys = list(dict.fromkeys((r["lr"], r["mask"]) for r in rows))
    return [(lr, mask, [r for r in rows if (r["lr"], r["mask"]) == (lr, mask)]) for lr, mask in keys]


def balanced_seeds(rows: list[dict]) -> dict[float, list[int]]:
    """Per lr, the seeds every mask has finished (done or failed): the summary's paired, balanced set.
    A mask with no finished run at that lr yet (one just added to the study) does not empty the set."""
    out = {}
    for lr in dict.fromkeys(r["lr"] for r in rows):
        at_lr = [r for r in rows if r["lr"] == lr]
        masks = set(r["mask"] for r in at_lr if "eval_curve" in r)
        seeds = dict.fromkeys(r["seed"] for r in at_lr)
        out[lr] = [s for s in seeds if all(any(r["mask"] == m and r["seed"] == s and "eval_curve" in r
                                               for r in at_lr) for m in masks)]
    return out


def _top_grad_hits(counts: list[dict]) -> str:
    """``hits / top tokens (share of S2T tokens among all recorded tokens with A != 0)``, summed over records."""
    counts = [c for c in counts if c.get("records")]
    if not counts:
        return "–"
    top, hits = sum(c["top_tokens"] for c in counts), sum(c["top_s2t"] for c in counts)
    share = sum(c["s2t_tokens"] for c in counts) / max(sum(c["signed_tokens"] for c in counts), 1)
    return f"{hits} / {top} (all: {100 * share:.3f}%)"


def summary_table(rows: list[dict]) -> str:
    lines = ["| lr | mask | seeds | start acc. | peak acc. | final acc. | final − start | drop from peak | collapsed "
             "| max grad norm | silenced % | spurious % | S2T among the top-1% grad tokens (among all) |",
             "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    balanced = balanced_seeds(rows)
    for lr, mask, group in _groups(rows):
        done = [r for r in group if r["seed"] in balanced[lr] and "eval_curve" in r]
        hits = _top_grad_hits([r["top_grad"] for r in done])
        seeds = ", ".join(str(r["seed"]) for r in done) or "none yet"
        lines.append(
            f"| {lr:g} | `{mask}` | {seeds} (of {len(group)}) | {_mean_se([_start(r) for r in done])} "
            f"| {_mean_se([r['peak_acc'] for r in done])} | {_mean_se([r['final_acc'] for r in done])} "
            f"| {_mean_se([r['final_acc'] - _start(r) for r in done])} | {_mean_se([r['drop'] for r in done])} "
            f"| {sum(r['collapsed'] for r in done)} / {len(done)} "
            f"| {_mean_se([r['grad_norm_max'] for r in done], 1.0, 2)} "
            f"| {_mean_se([r['silenced_frac'] for r in done], 100.0, 4)} "
            f"| {_mean_se([r['spurious_frac'] for r in done], 100.0, 4)} | {hits} |")
    return "\n".join(lines)


def _start(row: dict) -> float:
    """Held-out accuracy of the run's warm-started model (the evaluation before iteration 1)."""
    return row["eval_curve"][0][1]


def runs_table(rows: list[dict]) -> str:
    lines = ["| lr | mask | seed | status | held-out accuracy at each eval | peak (step) | final "
             "| drop | max / p95 grad norm | entropy first → last | silenced % | up / down-weighted %, gate on % "
             "| spurious % | S2T in top-grad | wall min |",
             "|---:|---|---:|---|---|---:|---:|---:|---:|---|---:|---|---:|---:|---:|"]
    for r in rows:
        head = f"| {r['lr']:g} | `{r['mask']}` | {r['seed']} |"
        if "eval_curve" not in r:
            lines.append(f"{head} {r['status']} ({r['steps_done']} steps) |" + " |" * 11)
            continue
        curve = " ".join(f"{100 * a:.0f}" for _, a in r["eval_curve"])
        ent = r["entropy_curve"]
        hits = _top_grad_hits([r["top_grad"]])
        status = "**collapsed**" if r["collapsed"] else r["status"]
        if r["status"] == "failed":
            status = f"failed at step {r['steps_done']}"
        lines.append(
            f"{head} {status} | {curve} | {100 * r['peak_acc']:.1f} ({r['peak_step']}) | {100 * r['final_acc']:.1f} "
            f"| {100 * r['drop']:.1f} | {r['grad_norm_max']:.2f} / {r['grad_norm_p95']:.2f} "
            f"| {ent[0][1]:.3f} → {ent[-1][1]:.3f} | {100 * r['silenced_frac']:.3f} | {_weighting(r)} "
            f"| {100 * r['spurious_frac']:.3f} "
            f"| {hits} | {r['wall_s'] / 60:.1f} |")
    return "\n".join(lines)


def _weighting(row: dict) -> str:
    """``up / down, gate`` in percent for a run of a weighting mask; – otherwise."""
    if row.get("gate_on_frac") is None and not row.get("upweighted_frac") and not row.get("downweighted_frac"):
        return "–"
    gate = row.get("gate_on_frac")
    on = f", gate on {100 * gate:.0f}%" if gate is not None else ""
    return f"{100 * row['upweighted_frac']:.3f} / {100 * row['downweighted_frac']:.3f}{on}"


def _mean_curve(done: list[dict]) -> tuple[list[int], list[float], list[float]]:
    """Steps every run evaluated at, the mean accuracy there and its standard error (points)."""
    curves = [dict(map(tuple, r["eval_curve"])) for r in done]
    steps = sorted(set.intersection(*(set(c) for c in curves))) if curves else []
    mean = [100 * statistics.fmean(c[s] for c in curves) for s in steps]
    se = [100 * statistics.stdev(c[s] for c in curves) / math.sqrt(len(curves)) if len(curves) > 1 else 0.0
          for s in steps]
    return steps, mean, se


def plot_curves(rows: list[dict], out_png: Path) -> Path:
    """Per lr: one panel per mask (every finished seed thin; the mean over the balanced seeds, as in the
    summary table, thick), then the masks' means side by side. Learning rates with no finished run yet
    are left out (the tables list them as pending)."""
    from stapo.plots import new_figure, save_figure

    groups = _groups(rows)
    lrs = list(dict.fromkeys(lr for lr, _, group in groups if any("eval_curve" in r for r in group)))
    lrs = lrs or [groups[0][0]]
    masks = list(dict.fromkeys(mask for _, mask, _ in groups))
    balanced = balanced_seeds(rows)
    fig, axes = new_figure(len(lrs) * (len(masks) + 1), max_cols=len(masks) + 1)
    for i, lr in enumerate(lrs):
        means_ax = axes[i * (len(masks) + 1) + len(masks)]
        for j, mask in enumerate(masks):
            ax = axes[i * (len(masks) + 1) + j]
            group = [r for r in rows if (r["lr"], r["mask"]) == (lr, mask)]
            done = [r for r in group if "eval_curve" in r]
            for r in done:
                steps, accs = zip(*r["eval_curve"])
                ax.plot(steps, [100 * a for a in accs], linewidth=0.9, alpha=0.6, label=f"seed {r['seed']}")
            paired = [r for r in done if r["seed"] in balanced[lr]]
            steps, mean, se = _mean_curve(paired)
            if steps:
                ax.plot(steps, mean, color="black", linewidth=2.2, label=f"mean of {len(paired)}")
                line, = means_ax.plot(steps, mean, linewidth=2, label=f"{mask} ({len(paired)})")
                means_ax.fill_between(steps, [m - e for m, e in zip(mean, se)], [m + e for m, e in zip(mean, se)],
                                      color=line.get_color(), alpha=0.15)
            if done:
                ax.legend(fontsize=7)
            ax.set_title(f"{mask}, lr {lr:g} ({len(done)}/{len(group)} runs)", fontsize=10)
        means_ax.set_title(f"mean ± s.e. over seeds, lr {lr:g}", fontsize=10)
        if means_ax.lines:
            means_ax.legend(fontsize=7)
    for ax in axes:
        ax.set_xlabel("step")
        ax.set_ylabel("held-out accuracy (%)")
        ax.grid(alpha=0.3)
    if any(ax.lines for ax in axes):
        low = min(ax.get_ylim()[0] for ax in axes if ax.lines)
        high = max(ax.get_ylim()[1] for ax in axes if ax.lines)
        for ax in axes:
            ax.set_ylim(low, high)
    return save_figure(fig, out_png)


def render(rows: list[dict], results_link: str, figure_link: str, collapse_points: float) -> str:
    done = sum(r["status"] != "pending" for r in rows)
    return "\n".join([
        BEGIN,
        f"_Generated by `python bench/stability.py --report` from [{Path(results_link).name}]({results_link}): "
        f"{done} of {len(rows)} runs finished. Summary: mean ± standard error over the seeds every mask has "
        f"finished at that lr (balanced; paired by seed where the start accuracies agree: the warm start is "
        f"rebuilt on each machine and its sums follow the CPU); accuracies in points; "
        f"collapsed = final ≥ {collapse_points:g} points below peak._",
        "", summary_table(rows), "", "Every run:", "", runs_table(rows), "",
        f"![held-out accuracy curves per mask, every seed and their mean]({figure_link})", END])
