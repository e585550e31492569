"""The training-health study's report (docs/health.md), from its per-run rows alone (docs/health/results.jsonl).

``summarize_run`` turns a run directory into its row: the held-out curve, peak, final, the first evaluation
``DROP_POINTS`` below the peak (after it), the alarms and rollbacks the run logged, and for the warn arm the
first alarm of every monitor when its logged statistic is replayed under other thresholds and patiences
(exact: the statistics do not depend on them). ``render`` gives the generated block of docs/health.md,
``plot_runs`` its figure. Accuracies are fractions in the rows, points in the tables.
"""

from __future__ import annotations

import math
import statistics
from pathlib import Path

from stapo.health.timeline import read_timeline

BEGIN, END = "<!-- BEGIN health -->", "<!-- END health -->"
#: A looser threshold per threshold parameter, for the replay (the defaults are the shipped ones)
LOOSE = {"z": 4.0, "ratio": 0.7, "drop": 0.05, "level": 0.7}
PATIENCES = (1, 2, 3)


def _replay(values: list[tuple[int, float]], threshold: float, fires: str, patience: int) -> list[int] | None:
    """``[alarm step, onset]`` of the first streak of ``patience`` steps past ``threshold``, None if none."""
    streak, onset = 0, None
    for step, value in values:
        past = value > threshold if fires == "above" else value < threshold
        streak, onset = (streak + 1, onset if streak else step) if past else (0, None)
        if streak >= patience:
            return [step, onset]
    return None


def _variants(spec: dict) -> dict[str, float]:
    loose = LOOSE.get(spec.get("param", ""), None)
    return {"default": spec["threshold"], **({"loose": loose} if loose is not None else {})}


def summarize_run(run, run_dir: Path, attempts: list[dict], drop_points: float) -> dict:
    row = {"run": run.name, "arm": run.arm, "mask": run.mask, "seed": run.seed, "lr": run.lr}
    try:
        timeline = read_timeline(run_dir)
    except ValueError:  # not started (a rollback run may never be: bench/health.py marks those "twin")
        return {**row, "status": "pending"}
    curve = timeline.evals
    finished = bool(curve) and bool(timeline.steps) and curve[-1][0] == run_total(run_dir) and \
        int(timeline.steps[-1]["step"]) == curve[-1][0]
    row["status"] = "done" if finished else ("failed" if attempts and not attempts[-1]["ok"] else "pending")
    if not curve:
        return row
    peak_step, peak = max(curve, key=lambda c: (c[1], -c[0]))
    after = [(s, a) for s, a in curve if s > peak_step and 100 * (peak - a) >= drop_points]
    row.update(eval_curve=[[s, a] for s, a in curve], peak_acc=peak, peak_step=peak_step, final_acc=curve[-1][1],
               drop_step=after[0][0] if after else None, steps_done=len(timeline.steps),
               alarms=[{k: e[k] for k in ("step", "monitor", "onset", "action")} for e in timeline.alarms()],
               rollbacks=[{k: e[k] for k in ("step", "restored_step", "onset", "lr")} for e in timeline.rollbacks()],
               wall_s=round(sum(a["wall_s"] for a in attempts), 1), cpu_s=round(sum(a["cpu_s"] for a in attempts), 1),
               trace=step_trace(timeline.steps))
    if run.arm == "warn":  # replays are exact only where no action changed the run; [alarm step, onset] if any
        replays = {f"{name}|{variant}|{p}": _replay(timeline.series(name), threshold, spec["fires"], p)
                   for name, spec in timeline.monitors.items() if timeline.series(name)
                   for variant, threshold in _variants({**spec, "param": _param(name)}).items() for p in PATIENCES}
        row["judged"] = [name for name in timeline.monitors if timeline.series(name)]
        row["replay"] = {key: hit for key, hit in replays.items() if hit is not None}
    return row


#: What a step leaves that a different run could hardly repeat: its loss, its gradient norm (exact functions of
#: the weights and the batch) and the entropy of its rollouts (of the weights and the sampler's state)
TRACE_KEYS = ("loss", "grad_norm", "entropy_mean")


def step_trace(steps: list[dict]) -> list[list[float]]:
    """``TRACE_KEYS`` of steps 1, 2, ... as first logged (a step redone after a rollback or a resume counts once):
    what the twin check compares, kept in the row because run directories do not outlive the machine."""
    first: dict[int, list[float]] = {}
    for r in steps:
        first.setdefault(int(r["step"]), [r.get(k) for k in TRACE_KEYS])
    trace: list[list[float]] = []
    while len(trace) + 1 in first:  # steps 1..n without a gap
        trace.append(first[len(trace) + 1])
    return trace


def same_as_twin_through(warn: dict, rollback: dict) -> int | None:
    """The last step through which a rollback run's trace equals its warn twin's exactly, from step 1 on (the twin
    rule: they are one run up to the rollback run's first alarm); None where a row has no trace."""
    a, b = warn.get("trace"), rollback.get("trace")
    if not a or not b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def run_total(run_dir: Path) -> int:
    import yaml

    return int(yaml.safe_load((run_dir / "config.yaml").read_text(encoding="utf-8"))["trainer"]["total_steps"])


def _param(monitor: str) -> str:
    from stapo.health import MONITORS

    return MONITORS[monitor].threshold_param if monitor in MONITORS else ""


# ---- tables -------------------------------------------------------------------------------------

def _pts(value) -> str:
    return "–" if value is None else f"{100 * value:.1f}"


def _mean_se(values: list[float]) -> str:
    if not values:
        return "–"
    mean = 100 * statistics.fmean(values)
    se = 100 * statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else float("nan")
    return f"{mean:+.1f} ± {se:.1f}" if len(values) > 1 else f"{mean:+.1f}"


def _done(rows: list[dict], arm: str, lr: float) -> list[dict]:
    return [r for r in rows if r["arm"] == arm and r["lr"] == lr and r["status"] == "done"]


def runs_table(rows: list[dict]) -> str:
    lines = ["| arm | lr | mask | seed | status | held-out accuracy at each eval | peak (step) | final "
             "| first 5-point drop | alarms (monitor @ step, onset) | rollbacks (step → restored, lr) | wall min |",
             "|---|---:|---|---:|---|---|---:|---:|---:|---|---|---:|"]
    for r in rows:
        if "eval_curve" not in r:
            why = "not run: its warn twin raised no alarm, so it is that run" if r["status"] == "twin" else r["status"]
            lines.append(f"| {r['arm']} | {r['lr']:g} | `{r['mask']}` | {r['seed']} | {why} | | | | | | | |")
            continue
        curve = " ".join(f"{100 * a:.0f}" for _, a in r["eval_curve"])
        alarms = ", ".join(f"{a['monitor']} @ {a['step']} ({a['onset']})" for a in r["alarms"]) or "none"
        rollbacks = ", ".join(f"{b['step']} → {b['restored_step']}, {b['lr']:.2g}" for b in r["rollbacks"]) or "–"
        lines.append(f"| {r['arm']} | {r['lr']:g} | `{r['mask']}` | {r['seed']} | {r['status']} | {curve} | "
                     f"{_pts(r['peak_acc'])} ({r['peak_step']}) | {_pts(r['final_acc'])} | {r['drop_step'] or '–'} | "
                     f"{alarms} | {rollbacks} | {r['wall_s'] / 60:.1f} |")
    return "\n".join(lines)


def _first(row: dict, monitor: str, variant: str, patience: int) -> int | None:
    hit = row.get("replay", {}).get(f"{monitor}|{variant}|{patience}")
    return None if hit is None else hit[0]


def _monitors(rows: list[dict]) -> list[str]:
    """The monitors that judged in any of ``rows`` (those whose metrics the runs log)."""
    return list(dict.fromkeys(name for r in rows for name in r.get("judged", [])))


def _lead_cell(unstable: list[dict], stable: list[dict], monitor: str, variant: str, patience: int) -> str:
    """``k/n (median lead; p before the peak) · a · f/m``: first alarm before the drop in k of the n runs
    with a drop, p of those even before the run's peak; a at or after the drop; f of m stable runs alarmed."""
    dropped = [r for r in unstable if r["drop_step"] is not None]
    firsts = [(r, s) for r in dropped if (s := _first(r, monitor, variant, patience)) is not None]
    early = [(r, s) for r, s in firsts if s < r["drop_step"]]
    lead = f"median {statistics.median(r['drop_step'] - s for r, s in early):g}; " if early else ""
    before_peak = sum(s < r["peak_step"] for r, s in early)
    detail = f" ({lead}{before_peak} before the peak)" if early else ""
    false = sum(_first(r, monitor, variant, patience) is not None for r in stable)
    return f"{len(early)}/{len(dropped)}{detail} · {len(firsts) - len(early)} · {false}/{len(stable)}"


def lead_table(rows: list[dict], unstable_lr: float, stable_lr: float) -> str:
    unstable, stable = _done(rows, "warn", unstable_lr), _done(rows, "warn", stable_lr)
    monitors = _monitors(unstable + stable)
    variants = [("default", 3), ("default", 1), ("loose", 3), ("loose", 1)]
    head = " | ".join(f"{v} thr., patience {p}" for v, p in variants)
    lines = [f"| monitor | {head} |", "|---|" + "---|" * len(variants)]
    for m in monitors:
        cells = [_lead_cell(unstable, stable, m, v, p) if v == "default" or _param(m) in LOOSE else "–"
                 for v, p in variants]
        lines.append(f"| `{m}` | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def rollback_table(rows: list[dict], unstable_lr: float) -> tuple[str, list[float], list[float]]:
    twins = {(r["mask"], r["seed"]): r for r in _done(rows, "warn", unstable_lr)}
    lines = ["| mask | seed | no rollback: final / best | rollback: final / best | rollbacks | Δ final | Δ best "
             "| same steps as the twin (first alarm) |",
             "|---|---:|---:|---:|---:|---:|---:|---|"]
    d_final, d_best = [], []
    for r in [r for r in rows if r["arm"] == "rollback" and r["lr"] == unstable_lr]:
        twin = twins.get((r["mask"], r["seed"]))
        if twin is None or r["status"] not in ("done", "twin"):
            continue
        other = twin if r["status"] == "twin" else r
        d_final.append(other["final_acc"] - twin["final_acc"])
        d_best.append(other["peak_acc"] - twin["peak_acc"])
        made = "none (twin)" if r["status"] == "twin" else str(len(r["rollbacks"]))
        lines.append(f"| `{r['mask']}` | {r['seed']} | {_pts(twin['final_acc'])} / {_pts(twin['peak_acc'])} | "
                     f"{_pts(other['final_acc'])} / {_pts(other['peak_acc'])} | {made} | "
                     f"{100 * d_final[-1]:+.1f} | {100 * d_best[-1]:+.1f} | {_twin_cell(r)} |")
    return "\n".join(lines), d_final, d_best


def _twin_cell(row: dict) -> str:
    """Steps 1..k with the twin's trace to the last digit, against the first alarm (the twin rule wants k >= it)."""
    if row["status"] == "twin":
        return "is its twin"
    through, first = row.get("same_as_twin_through"), min((a["step"] for a in row["alarms"]), default=None)
    if through is None:
        return "–"
    alarm = f" (alarm {first})" if first is not None else " (no alarm)"
    broken = first is not None and through < first or first is None and through < row["steps_done"]
    return f"**differs from step {through + 1}**{alarm}" if broken else f"steps 1–{through}{alarm}"


def render(rows: list[dict], results_link: str, figure_link: str, drop_points: float,
           unstable_lr: float = 2e-4, stable_lr: float = 5e-5) -> str:
    table, d_final, d_best = rollback_table(rows, unstable_lr)
    spread = (lambda xs: f"{100 * min(xs):+.1f} … {100 * max(xs):+.1f}" if xs else "–")
    wall = sum(r.get("wall_s", 0.0) for r in rows) / 3600
    cpu = sum(r.get("cpu_s", 0.0) for r in rows) / 3600
    finished = sum(r["status"] in ("done", "twin", "failed") for r in rows)
    return "\n".join([
        BEGIN,
        f"_Generated by `python bench/health.py --report` from [results.jsonl]({results_link}): {finished} of "
        f"{len(rows)} runs finished; {wall:.1f} h of run wall time ({cpu:.1f} CPU-hours, runs 2 at a time on a "
        f"shared 2-core machine). Accuracies in points._",
        "",
        f"**Lead times and false alarms** (warn arm; replays of the logged statistics). Per cell: lr "
        f"{unstable_lr:g} runs whose first alarm came before their first {drop_points:g}-point drop, out of those "
        f"with a drop (median lead in steps; how many of these alarms came even before the run's peak) · runs "
        f"whose first alarm came at or after the drop · lr {stable_lr:g} (stable) runs with any alarm. Loose "
        f"thresholds: z 4, ratio 0.7, drop 0.05, level 0.7.",
        "",
        lead_table(rows, unstable_lr, stable_lr),
        "",
        f"**Rollback vs no rollback** (lr {unstable_lr:g}, paired by mask and seed): Δ final "
        f"{_mean_se(d_final)} points (range {spread(d_final)}), Δ best {_mean_se(d_best)} points "
        f"(range {spread(d_best)}), mean ± standard error over {len(d_final)} pairs.",
        "",
        table,
        "",
        f"![held-out accuracy of every run, alarms and rollbacks]({figure_link})",
        "",
        "Every run:",
        "",
        runs_table(rows),
        END,
    ])


def plot_runs(rows: list[dict], out_png: Path, unstable_lr: float = 2e-4) -> Path:
    """One panel per (mask, seed): held-out accuracy without and with rollback at the unstable lr and at the
    stable lr; the warn run's alarms as red ticks, rollbacks as purple lines."""
    from matplotlib.ticker import PercentFormatter

    from stapo.plots import new_figure, save_figure

    keys = list(dict.fromkeys((r["mask"], r["seed"]) for r in rows))
    fig, axes = new_figure(max(len(keys), 1), panel_size=(3.6, 2.6), max_cols=5)
    for ax, (mask, seed) in zip(axes, keys):
        for r in (r for r in rows if (r["mask"], r["seed"]) == (mask, seed) and "eval_curve" in r):
            style = {"warn": "-", "rollback": "--"}[r["arm"]]
            color = "tab:blue" if r["lr"] == unstable_lr else "tab:gray"
            label = f"lr {r['lr']:g}" + (" + rollback" if r["arm"] == "rollback" else "")
            ax.plot(*zip(*r["eval_curve"]), style, color=color if r["arm"] == "warn" else "tab:orange",
                    marker="o", markersize=2.5, linewidth=1.0, label=label)
            if r["arm"] == "warn" and r["lr"] == unstable_lr:
                for a in r["alarms"]:
                    ax.axvline(a["step"], color="tab:red", linewidth=0.7, linestyle=":")
            for b in r["rollbacks"]:
                ax.axvline(b["step"], color="tab:purple", linewidth=0.9)
        ax.set_title(f"{mask}, seed {seed}: held-out accuracy", fontsize=9)
        ax.yaxis.set_major_formatter(PercentFormatter(xmax=1.0))
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:  # a pending run's panel has nothing to name
            ax.legend(fontsize=6)
        else:
            ax.text(0.5, 0.5, "pending", ha="center", va="center", transform=ax.transAxes, color="gray")
    return save_figure(fig, out_png)
