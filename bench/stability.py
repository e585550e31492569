"""Stability study on the tiny CPU task: masks x seeds x learning rates where plain training wobbles.

The tiny recipe learns steadily at its lr 5e-5; at 2e-4 held-out accuracy rises and then falls back.
This runs the grid (default: the study of docs/stability.md, in its fixed order), each run in a fresh
``python -m stapo.cli train`` process, and summarizes every run from its run directory: eval curve,
peak / final accuracy and drop from peak, max and 95th-percentile grad norm, entropy curve, silenced
and spurious fractions, and how often the S2T criterion flags the largest-gradient tokens of the
inspector's token records.

The study's masks are ``none``, ``stapo``, ``entropy_top`` and, added later (docs/stability.md,
"Settings"), the token-weighting ``stare`` and ``clip_cov``; the report keeps the committed rows of
runs made in another output directory, so the later rows can run on their own::

    python bench/stability.py --masks stare clip_cov --seeds 0 1 2 3 4 --lrs 2e-4 --out /tmp/study

Runs go seed-major (every mask of seed 0, then seed 1, ...) so a study cut short stays balanced. It is
resumable: a run whose metrics end with the final evaluation is not rerun; an interrupted one
continues from its last checkpoint (``trainer.resume=auto``). ``--report`` (re)writes the committed
per-run rows (docs/stability/results.jsonl) and, from that file alone, the generated part of
docs/stability.md and its figure; runs not finished yet are listed as pending.

    python bench/stability.py --out /tmp/study                 # the study (core grid, then extras)
    python bench/stability.py --report --out /tmp/study        # results.jsonl, the doc's tables, figure
    python bench/stability.py --masks none stapo --seeds 0 --lrs 1e-4 --out /tmp/one
    python bench/stability.py --smoke --out /tmp/smoke          # 2 runs x 2 steps (used by the tests)
    python bench/stability.py --inspect stapo_seed0_lr0.0002 --out /tmp/study   # the inspector's view

``--inspect RUN`` reruns one finished run recording every token the mask saw (every mini-batch of every
step: S2T tokens are ~0.003% here, and the study's records, one mini-batch every 10 steps, hold about
one in forty of them), checks that the rerun reproduced the run metric for metric, and writes
``stapo inspect``'s report into ``OUT/inspect_reruns/RUN/inspect/``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import yaml  # noqa: E402

from stapo.cli import builtin_recipe  # noqa: E402
from stapo.run_dir import CONFIG_FILE, METRICS_FILE, latest_checkpoint, read_metrics, step_of  # noqa: E402
from stapo.telemetry.metrics import training_metrics  # noqa: E402

from _stability_report import BEGIN, END, plot_curves, render  # noqa: E402  (bench/ is on sys.path)
from _train_runs import SMOKE, TrainingFailed, replace_block, run_training, train_command  # noqa: E402

# ---- the study's fixed settings (docs/stability.md, "Settings") ----------------------------------
MASKS = ("none", "stapo", "entropy_top", "stare", "clip_cov")  # the last two joined after the first 15 runs
CORE = [(2e-4, seed) for seed in (0, 1, 2)]
#: Run after the core grid, in this order, while time allows: two more seeds, then the lower lr.
EXTRAS = [(2e-4, 3), (2e-4, 4), (1e-4, 0), (1e-4, 1), (1e-4, 2)]
STEPS, EVAL_EVERY = 100, 10
FIXED = [f"trainer.total_steps={STEPS}", f"trainer.eval_every={EVAL_EVERY}", "trainer.export_hf=false",
         "logging.tensorboard=false"]
SMOKE_EXTRA = ["trainer.eval_every=1", "inspect.record_every=1"]
#: Wall minutes of one 100-step run while the 2 cores were otherwise quiet: the study's first run took
#: 3.4 s per iteration, evaluations included, over its first 40 iterations. Under a saturated machine
#: (load 8-10) the same iterations took 14-190 s, and each new seed's warm start (600 supervised steps,
#: cached per seed) took 37 min. The budget printout uses this until the output directory holds
#: timings of its own (then the mean of its finished runs, warm starts and contention included).
RUN_MINUTES_ESTIMATE = 6.0
COLLAPSE_POINTS = 10.0  # a run collapses when its final accuracy is this many points below its peak
TOP_GRAD_FRACTION = 0.01  # "largest-gradient tokens": the top 1% of a record's tokens with A != 0
TIMINGS_FILE = "timings.jsonl"
INSPECT_RERUNS = "inspect_reruns"
FULL_RECORDING = ["inspect.record_every=1", "inspect.record_minibatches=all"]
DOC = ROOT / "docs" / "stability.md"
RESULTS = ROOT / "docs" / "stability" / "results.jsonl"
FIGURE = ROOT / "docs" / "images" / "stability_curves.png"


@dataclass(frozen=True)
class Run:
    mask: str
    seed: int
    lr: float

    @property
    def name(self) -> str:
        return f"{self.mask}_seed{self.seed}_lr{self.lr:g}"


def study_grid(pairs: list[tuple[float, int]], masks) -> list[Run]:
    """Every mask of each (lr, seed) pair, pairs in the given order: seed-major within an lr."""
    return [Run(mask, seed, lr) for lr, seed in pairs for mask in masks]


# ---- running ------------------------------------------------------------------------------------

def is_finished(run_dir: Path) -> bool:
    """The run's metrics end with the final evaluation (an eval-only row at ``total_steps``)."""
    if not (run_dir / METRICS_FILE).is_file() or not (run_dir / CONFIG_FILE).is_file():
        return False
    total = yaml.safe_load((run_dir / CONFIG_FILE).read_text(encoding="utf-8"))["trainer"]["total_steps"]
    rows = read_metrics(run_dir / METRICS_FILE)
    last = rows[-1] if rows else {}
    return "eval_accuracy" in last and "entropy_mean" not in last and int(last["step"]) == total


def read_timings(out: Path) -> dict[str, list[dict]]:
    """Every attempt of every run (``out/timings.jsonl``), by run name."""
    found: dict[str, list[dict]] = {}
    path = out / TIMINGS_FILE
    if path.is_file():
        for line in path.read_text(encoding="utf-8").splitlines():
            if line.strip():
                entry = json.loads(line)
                found.setdefault(entry["run"], []).append(entry)
    return found


def children_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def run_one(run: Run, out: Path, recipe: Path, extra: list[str]) -> dict:
    """Train (or continue) one run in a fresh process; returns its timing entry."""
    run_dir = out / run.name
    checkpoint = latest_checkpoint(run_dir)
    cmd = train_command(run.mask, run.seed, run_dir, recipe, resume="auto",
                        extra=[f"optim.lr={run.lr:g}", *extra])
    wall, cpu = time.perf_counter(), children_cpu_seconds()
    entry = {"run": run.name, "resumed_from_step": step_of(checkpoint) if checkpoint else 0, "ok": True}
    try:
        run_training(cmd, run.name, log_path=out / "logs" / f"{run.name}.log")
    except TrainingFailed as err:  # killed by a signal: interrupted, continued next time; else failed
        entry.update(ok=False, interrupted=err.returncode < 0, error=str(err).splitlines()[-1][:300])
    entry.update(wall_s=round(time.perf_counter() - wall, 1), cpu_s=round(children_cpu_seconds() - cpu, 1))
    with open(out / TIMINGS_FILE, "a", encoding="utf-8") as f:
        f.write(json.dumps(entry) + "\n")
    return entry


def budget(grid: list[Run], out: Path, smoke: bool) -> str:
    """The CPU-time estimate printed before the study starts."""
    timings = read_timings(out)
    todo = [r for r in grid if not is_finished(out / r.name) and not _failed(timings.get(r.name))]
    done = [t for runs in timings.values() for t in runs if t["ok"] and t["resumed_from_step"] == 0]
    if done:
        wall = statistics.fmean(t["wall_s"] for t in done) / 60
        cpu = statistics.fmean(t["cpu_s"] for t in done) / 60
        source = f"mean of {len(done)} finished run(s) in {out}"
    else:
        wall = 0.2 if smoke else RUN_MINUTES_ESTIMATE
        cpu, source = 2 * wall, "quiet-machine estimate, 2 threads; a new seed's warm start and a busy machine add more"
    return (f"[stability] grid: {len(grid)} runs, {len(grid) - len(todo)} already finished, {len(todo)} to run; "
            f"per run ≈ {wall:.1f} min wall, {cpu:.1f} CPU-min ({source}) → "
            f"≈ {len(todo) * wall / 60:.1f} h wall, {len(todo) * cpu / 60:.1f} CPU-hours")


def _failed(attempts: list[dict] | None) -> bool:
    """The last attempt exited with an error (e.g. aborted on non-finite gradients): not retried.
    One killed by a signal was interrupted, not failed: the next invocation continues it."""
    return bool(attempts) and not attempts[-1]["ok"] and not attempts[-1].get("interrupted", False)


def run_study(grid: list[Run], out: Path, recipe: Path, extra: list[str], smoke: bool) -> None:
    out.mkdir(parents=True, exist_ok=True)
    print(budget(grid, out, smoke), file=sys.stderr, flush=True)
    for i, run in enumerate(grid, 1):
        if is_finished(out / run.name):
            print(f"[stability] {i}/{len(grid)} {run.name}: finished earlier, not rerun", file=sys.stderr, flush=True)
            continue
        if _failed(read_timings(out).get(run.name)):
            print(f"[stability] {i}/{len(grid)} {run.name}: failed earlier, not retried", file=sys.stderr, flush=True)
            continue
        print(f"[stability] {i}/{len(grid)} {run.name} ... ({time.strftime('%H:%M:%S')})", file=sys.stderr, flush=True)
        entry = run_one(run, out, recipe, extra)
        outcome = "done" if entry["ok"] else "interrupted" if entry["interrupted"] else "FAILED"
        print(f"[stability] {i}/{len(grid)} {run.name}: {outcome} in "
              f"{entry['wall_s']:.0f} s wall, {entry['cpu_s']:.0f} s CPU", file=sys.stderr, flush=True)


# ---- the inspector's view of one run --------------------------------------------------------------

def training_rows(run_dir: Path) -> list[dict]:
    """The run's metrics without its timings: what two runs of the same training share exactly."""
    return [training_metrics(row) for row in read_metrics(run_dir / METRICS_FILE)]


def inspect_rerun(run: Run, out: Path, recipe: Path, extra: list[str]) -> Path:
    """Rerun a finished run with every mini-batch recorded, check it reproduced the run, inspect it."""
    from stapo.inspect import inspect_run

    source, rerun = out / run.name, out / INSPECT_RERUNS / run.name
    if not is_finished(source):
        raise SystemExit(f"{source} is not a finished run of this study: run the study first")
    if not is_finished(rerun):
        print(f"[stability] rerunning {run.name} with every mini-batch recorded ... ({time.strftime('%H:%M:%S')})",
              file=sys.stderr, flush=True)
        cmd = train_command(run.mask, run.seed, rerun, recipe, resume="auto",
                            extra=[f"optim.lr={run.lr:g}", *extra, *FULL_RECORDING])
        run_training(cmd, f"{run.name} (inspect rerun)", log_path=out / "logs" / f"{run.name}_inspect.log")
    want, got = training_rows(source), training_rows(rerun)
    differ = [a.get("step") for a, b in zip(want, got) if a != b]
    if differ or len(want) != len(got):
        raise SystemExit(f"the rerun {rerun} does not reproduce {source} (metrics differ at steps "
                         f"{differ[:5] or 'after ' + str(min(len(want), len(got)))}): its records would "
                         f"not describe the study's run")
    report = inspect_run(rerun)
    print(f"[stability] {run.name}: the rerun reproduced all {len(want)} metric rows; inspector report: {report}",
          file=sys.stderr)
    return report


# ---- per-run summary rows ------------------------------------------------------------------------

def _percentile(values: list[float], q: float) -> float:
    """Linear-interpolation percentile (numpy's default) of a non-empty list."""
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def top_grad_s2t(run_dir: Path) -> dict:
    """How often the S2T criterion flags the largest-gradient tokens of the run's token records.

    Per record (the first mini-batch of every ``inspect.record_every``-th step, before its update),
    the tokens with A != 0 are ranked by the inspector's gradient-norm proxy (Lemma A.1 at rho = 1,
    the norm of the gradient w.r.t. the logits) and the top ``TOP_GRAD_FRACTION`` of them (at least
    one) are checked against ``A > 0 and p < tau_p and H < tau_h`` with the record's thresholds.
    """
    from stapo.inspect.analysis import grad_norm_proxy, spurious_mask
    from stapo.inspect.records import load_records
    from stapo.run_dir import token_record_paths

    if not token_record_paths(run_dir):
        return {"records": 0}
    counts = {"records": 0, "signed_tokens": 0, "s2t_tokens": 0, "top_tokens": 0, "top_s2t": 0}
    for record in load_records(run_dir):
        signed = record.advantage != 0
        proxy = grad_norm_proxy(record.logprob, record.collision, record.advantage)[signed]
        spurious = spurious_mask(record)[signed]
        k = math.ceil(TOP_GRAD_FRACTION * len(proxy)) if len(proxy) else 0  # at least one token when any
        counts["records"] += 1
        counts["signed_tokens"] += len(proxy)
        counts["s2t_tokens"] += int(spurious.sum())
        counts["top_tokens"] += k
        counts["top_s2t"] += int(spurious[proxy.topk(k).indices].sum()) if k else 0
    return counts


def summarize_run(run: Run, out: Path, attempts: list[dict]) -> dict:
    """The committed row of one run: status, curves and the scalar summaries (accuracies as fractions)."""
    run_dir = out / run.name
    row = {"run": run.name, "mask": run.mask, "seed": run.seed, "lr": run.lr}
    rows = read_metrics(run_dir / METRICS_FILE) if (run_dir / METRICS_FILE).is_file() else []
    steps = [r for r in rows if "entropy_mean" in r]
    if is_finished(run_dir):
        row["status"] = "done"
    elif _failed(attempts):
        row["status"] = "failed"
        row["error"] = attempts[-1].get("error", "")
    else:
        return {**row, "status": "pending", "steps_done": len(steps)}
    evals = {int(r["step"]): r["eval_accuracy"] for r in rows if "eval_accuracy" in r}  # the final eval repeats
    curve = sorted(evals.items())                                                        # the last in-loop one
    if not curve or not steps:  # failed before its first iteration: nothing to summarize
        return {**row, "steps_done": len(steps)}
    peak_step, peak = max(curve, key=lambda c: (c[1], -c[0]))
    final = curve[-1][1]
    grad = [r["grad_norm"] for r in steps if math.isfinite(r["grad_norm"])]
    row.update(
        steps_done=len(steps),
        eval_curve=[[s, a] for s, a in curve],
        peak_acc=peak, peak_step=peak_step, final_acc=final, drop=peak - final,
        collapsed=100 * (peak - final) >= COLLAPSE_POINTS,
        grad_norm_max=max(grad), grad_norm_p95=_percentile(grad, 0.95),
        entropy_curve=[[int(r["step"]), round(r["entropy_mean"], 5)] for r in steps],
        silenced_frac=statistics.fmean(r["silenced_frac"] for r in steps),
        **_weight_summaries(steps),
        spurious_frac=statistics.fmean(r["spurious_frac"] for r in steps),
        skipped_steps=int(steps[-1]["skipped_steps"]),
        top_grad=top_grad_s2t(run_dir),
        wall_s=round(sum(a["wall_s"] for a in attempts), 1), cpu_s=round(sum(a["cpu_s"] for a in attempts), 1),
        attempts=len(attempts),
    )
    return row


def _weight_summaries(steps: list[dict]) -> dict:
    """A weighting mask's per-step means (runs logged before the weight metrics existed have none)."""
    if not all("weight_mean" in r for r in steps):
        return {}
    gates = [r["mask_gate"] for r in steps if math.isfinite(r.get("mask_gate", math.nan))]
    return {"upweighted_frac": statistics.fmean(r["upweighted_frac"] for r in steps),
            "downweighted_frac": statistics.fmean(r["downweighted_frac"] for r in steps),
            "weight_mean": statistics.fmean(r["weight_mean"] for r in steps),
            "gate_on_frac": statistics.fmean(gates) if gates else None}


def collect_rows(grid: list[Run], out: Path, earlier: dict[str, dict] | None = None) -> list[dict]:
    """Every run's row from ``out``; a run ``out`` has no directory for keeps its ``earlier`` row (the
    committed results of runs made in another output directory, e.g. the study's first 15 runs)."""
    timings, earlier = read_timings(out), earlier or {}
    rows = []
    for run in grid:
        kept = earlier.get(run.name)
        fresh = kept is None or kept["status"] == "pending" or (out / run.name).is_dir()
        rows.append(summarize_run(run, out, timings.get(run.name, [])) if fresh else kept)
    return rows


def read_results(results: Path) -> dict[str, dict]:
    """The committed rows by run name ({} without a file)."""
    if not results.is_file():
        return {}
    rows = [json.loads(line) for line in results.read_text(encoding="utf-8").splitlines() if line.strip()]
    return {row["run"]: row for row in rows}


def write_report(grid: list[Run], out: Path, results: Path, doc: Path, figure: Path) -> None:
    results.parent.mkdir(parents=True, exist_ok=True)
    rows = collect_rows(grid, out, read_results(results))
    results.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    rows = [json.loads(line) for line in results.read_text(encoding="utf-8").splitlines() if line.strip()]
    plot_curves(rows, figure)
    link = {path: Path(os.path.relpath(path, doc.parent)).as_posix() for path in (results, figure)}
    replace_block(doc, BEGIN, END, render(rows, link[results], link[figure], COLLAPSE_POINTS))
    print(f"[stability] {sum(r['status'] != 'pending' for r in rows)} of {len(rows)} runs finished; "
          f"written {results}, {doc}, {figure}", file=sys.stderr)


# ---- command line -------------------------------------------------------------------------------

def build_grid(args) -> list[Run]:
    if args.smoke:
        return study_grid([(2e-4, 0)], ("none", "stapo"))
    if args.seeds or args.lrs or args.masks:
        pairs = [(lr, seed) for lr in (args.lrs or [CORE[0][0]]) for seed in (args.seeds or [0, 1, 2])]
        return study_grid(pairs, args.masks or MASKS)
    return study_grid(CORE + EXTRAS, MASKS)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="the study's run directories (not committed)")
    parser.add_argument("--recipe", type=Path, default=builtin_recipe())
    parser.add_argument("--masks", nargs="+", help=f"default: {' '.join(MASKS)}")
    parser.add_argument("--seeds", type=int, nargs="+", help="with --masks/--lrs: a custom grid (default 0 1 2)")
    parser.add_argument("--lrs", type=float, nargs="+", help="with --masks/--seeds: a custom grid (default 2e-4)")
    parser.add_argument("--smoke", action="store_true", help="2 runs x 2 steps at tiny sizes (tests)")
    parser.add_argument("--report", action="store_true", help="write results, tables and figure; run nothing")
    parser.add_argument("--inspect", metavar="RUN", help="rerun the finished RUN (e.g. stapo_seed0_lr0.0002) "
                        "recording every mini-batch, check it reproduced, write the inspector's report")
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--doc", type=Path, default=DOC)
    parser.add_argument("--figure", type=Path, default=FIGURE)
    parser.add_argument("overrides", nargs="*", help="extra key=value overrides for every run")
    args = parser.parse_args(argv)
    grid = build_grid(args)
    if args.report:
        write_report(grid, args.out, args.results, args.doc, args.figure)
        return 0
    extra = [*FIXED, *(SMOKE + SMOKE_EXTRA if args.smoke else []), *args.overrides]
    if args.inspect:
        runs = {run.name: run for run in grid}
        if args.inspect not in runs:
            parser.error(f"--inspect {args.inspect}: not a run of this grid ({', '.join(runs)})")
        inspect_rerun(runs[args.inspect], args.out, args.recipe, extra)
        return 0
    run_study(grid, args.out, args.recipe, extra, args.smoke)
    return 0


if __name__ == "__main__":
    sys.exit(main())
