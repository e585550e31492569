"""Training-health study on the tiny CPU task (docs/health.md, "Settings"): how early each monitor sees
the lr-2e-4 fall-back coming, how often it cries wolf at the stable lr 5e-5, and whether
``health.on_alarm: rollback`` ends runs better than no rollback.

Arm ``warn`` (monitors log, nothing acts): masks ``none`` and ``stapo`` x seeds 0-4 x lr 2e-4 and 5e-5,
seed-major. Arm ``rollback``: the lr-2e-4 runs again with ``health.on_alarm=rollback``. Training is
deterministic on one machine and the action only changes a run at its first alarm, so a rollback run
whose ``warn`` twin raised no alarm would repeat it step for step: it is not run, and its twin stands for
it; ``stapo`` seed 0 is run anyway, to check that claim. Each run is a fresh ``python -m stapo.cli train``
process (at most ``--parallel`` at once); finished runs are skipped, an interrupted one continues from
its checkpoint; the first run pins the commit in ``OUT/COMMIT`` and a checkout of another commit is
refused (warn and rollback runs of two code versions are not pairs). ``--report`` writes
docs/health/results.jsonl (one row per run), the generated block of docs/health.md and its figure. That record
outlives the run directories: a run recorded there (at the pinned commit) is not made again, and its row stays::

    nice -n 19 python bench/health.py --out /tmp/health_study          # the study (hours of CPU)
    python bench/health.py --report --out /tmp/health_study            # results.jsonl, tables, figure
    python bench/health.py --smoke --out /tmp/health_smoke             # 2 runs x 5 steps (the tests)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from stapo.cli import builtin_recipe  # noqa: E402
from stapo.run_dir import METRICS_FILE, read_metrics  # noqa: E402
from _health_report import BEGIN, END, plot_runs, render, same_as_twin_through, summarize_run  # noqa: E402
from _train_runs import SMOKE, replace_block  # noqa: E402
from stability import Run as StabilityRun, is_finished, read_timings, run_one  # noqa: E402

# ---- the study's fixed settings (docs/health.md, "Settings") -------------------------------------
MASKS = ("none", "stapo")
SEEDS = (0, 1, 2, 3, 4)
UNSTABLE_LR, STABLE_LR = 2e-4, 5e-5
VERIFY_TWIN = ("stapo", 0)  # the rollback run made even if its twin raised no alarm
FIXED = ["trainer.total_steps=100", "trainer.eval_every=10", "trainer.save_every=5", "trainer.keep_last=2",
         "trainer.export_hf=false", "logging.tensorboard=false", "inspect.record_every=0"]
#: 5 steps, and an alarm on the first step a monitor can judge (the 4th: 3 earlier values): the smoke's
#: rollback arm rolls back to step 2 and finishes
SMOKE_EXTRA = ["trainer.total_steps=5", "trainer.eval_every=1", "trainer.save_every=1", "health.warmup=0",
               "health.patience=1", "health.params={response_length: {z: 0.0}}"]
PIN_FILE = "COMMIT"  # the commit every run of a study comes from
DROP_POINTS = 5.0  # "collapse seen": the first evaluation this many points below the run's peak, after it
RESULTS = ROOT / "docs" / "health" / "results.jsonl"
DOC = ROOT / "docs" / "health.md"
FIGURE = ROOT / "docs" / "images" / "health_study.png"


@dataclass(frozen=True)
class Run(StabilityRun):
    arm: str = "warn"  # or "rollback"

    @property
    def name(self) -> str:
        return super().name + ("_rollback" if self.arm == "rollback" else "")

    def twin(self) -> "Run":
        return Run(self.mask, self.seed, self.lr, "warn")


def study_grid(seeds=SEEDS, masks=MASKS, lrs=(UNSTABLE_LR, STABLE_LR)) -> list[Run]:
    """The warn arm seed-major (both lrs of seed 0, then seed 1, ...), then the rollback arm."""
    warn = [Run(m, s, lr, "warn") for s in seeds for lr in lrs for m in masks]
    return warn + [Run(m, s, UNSTABLE_LR, "rollback") for s in seeds for m in masks]


def alarms_of(run_dir: Path) -> list[dict]:
    path = run_dir / METRICS_FILE
    return [r for r in read_metrics(path) if r.get("event") == "alarm"] if path.is_file() else []


def needs_running(run: Run, out: Path, verify=VERIFY_TWIN, recorded: dict[str, dict] | None = None) -> bool:
    """A rollback run is made when its twin raised an alarm (or it is the check of the claim above); the twin's
    alarms come from its directory, or from its recorded row when that directory is gone."""
    twin = (recorded or {}).get(run.twin().name)
    alarms = twin["alarms"] if twin is not None else alarms_of(out / run.twin().name)
    return run.arm == "warn" or (run.mask, run.seed) == verify or bool(alarms)


def checkout_commit(root: Path = ROOT) -> str:
    """The commit the runs are made from, ``+dirty`` when stapo/ or bench/ differ from it ("unknown" outside git)."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, check=True).stdout

    try:
        head = git("rev-parse", "HEAD").strip()
        return head + ("+dirty" if git("status", "--porcelain", "--", "stapo", "bench").strip() else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def pin_commit(out: Path, commit: str) -> None:
    """Every run of one study comes from one commit: a warn run and its rollback twin are the same run up to the
    alarm only then (docs/health.md, "Status"); the first run pins it in ``out/COMMIT``, a later one refuses
    another."""
    pin = out / PIN_FILE
    if not pin.is_file():
        pin.write_text(commit + "\n", encoding="utf-8")
        return
    pinned = pinned_commit(out)
    if pinned != commit or commit == "unknown":
        raise SystemExit(f"bench/health.py: the runs in {out} were made at {pinned}, this checkout is {commit}: "
                         f"runs of two code versions are not pairs; check out {pinned} or use another --out")


def pinned_commit(out: Path) -> str:
    pin = out / PIN_FILE
    return pin.read_text(encoding="utf-8").split()[0] if pin.is_file() else "unknown"


def recorded_rows(results: Path, commit: str) -> dict[str, dict]:
    """The finished runs of ``results``, by name: the study's record outlives its run directories (a machine's
    /tmp does not), so a run recorded there is not made again. Rows of another commit are refused: they and
    runs of this one would not be pairs."""
    rows = [json.loads(line) for line in results.read_text(encoding="utf-8").splitlines() if line.strip()] \
        if results.is_file() else []
    finished = {r["run"]: r for r in rows if r["status"] in ("done", "failed")}
    others = sorted({r.get("commit", "unknown") for r in finished.values()} - {commit})
    if others:
        raise SystemExit(f"bench/health.py: {results} records {len(finished)} finished runs made at "
                         f"{', '.join(others)}; these runs are at {commit}: runs of two code versions are not "
                         f"pairs; check out {others[0]} to go on with them, or pass --results NEW to start over")
    return finished


def run_study(grid: list[Run], out: Path, recipe: Path, extra: list[str], parallel: int, verify=VERIFY_TWIN,
              results: Path = RESULTS) -> None:
    """Warn runs first, in order, ``parallel`` at a time; each rollback run once its twin is done. A run
    finished here or recorded in ``results`` is not made again."""
    out.mkdir(parents=True, exist_ok=True)
    pin_commit(out, checkout_commit())
    recorded = recorded_rows(results, pinned_commit(out))
    lock, done = threading.Lock(), {}

    def log(message: str) -> None:
        with lock:
            print(f"[health {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)

    def one(run: Run) -> None:
        if run.arm == "rollback":
            done[run.twin()].wait()
            if not needs_running(run, out, verify, recorded):
                log(f"{run.name}: its twin raised no alarm, not run (the twin stands for it)")
                return
        if is_finished(out / run.name):
            log(f"{run.name}: finished earlier, not rerun")
            return
        if run.name in recorded:
            log(f"{run.name}: recorded in {results.name}, not rerun")
            return
        log(f"{run.name} ...")
        entry = run_one(run, out, recipe, [f"health.on_alarm={run.arm}", *extra])  # run_one sets optim.lr
        log(f"{run.name}: {'done' if entry['ok'] else 'FAILED'} in {entry['wall_s']:.0f} s wall, "
            f"{entry['cpu_s']:.0f} s CPU")

    for run in grid:
        done[run] = threading.Event()

    def task(run: Run) -> None:
        try:
            one(run)
        finally:
            done[run].set()

    log(f"grid: {len(grid)} runs ({sum(r.arm == 'warn' for r in grid)} warn, the rest rollback), {parallel} at a time")
    with ThreadPoolExecutor(parallel) as pool:  # warn runs are queued first: no rollback run waits on a later one
        for future in [pool.submit(task, run) for run in grid]:
            future.result()


def write_report(grid: list[Run], out: Path, results: Path, doc: Path, figure: Path, verify=VERIFY_TWIN) -> None:
    """Rows from the run directories in ``out``; a run without one keeps its row from ``results`` (made on an
    earlier machine, at the same commit)."""
    commit = pinned_commit(out)
    timings, recorded, by_run = read_timings(out), recorded_rows(results, commit), {}
    for run in grid:  # warn runs come first: a rollback run's row can look at its twin's
        row = {**summarize_run(run, out / run.name, timings.get(run.name, []), DROP_POINTS), "commit": commit}
        if row["status"] == "pending" and run.name in recorded:
            row = recorded[run.name]
        twin = by_run.get(run.twin()) if run.arm == "rollback" else None
        if row["status"] == "done" and twin is not None and (through := same_as_twin_through(twin, row)) is not None:
            row["same_as_twin_through"] = through
        if row["status"] == "pending" and twin is not None and twin["status"] == "done" and not twin["alarms"] \
                and (run.mask, run.seed) != verify:
            row["status"] = "twin"  # never made: it would repeat its twin, which stands for it
        by_run[run] = row
    rows = list(by_run.values())
    results.parent.mkdir(parents=True, exist_ok=True)
    results.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    plot_runs(rows, figure)
    link = {path: Path(os.path.relpath(path, doc.parent)).as_posix() for path in (results, figure)}
    replace_block(doc, BEGIN, END, render(rows, link[results], link[figure], DROP_POINTS))
    print(f"[health] {sum(r['status'] != 'pending' for r in rows)} of {len(rows)} runs reported; written "
          f"{results}, {doc}, {figure}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="the study's run directories (not committed)")
    parser.add_argument("--recipe", type=Path, default=builtin_recipe())
    parser.add_argument("--parallel", type=int, default=2, help="runs at once (default 2)")
    parser.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS),
                        help="the seeds to run (default 0-4; --report covers all)")
    parser.add_argument("--no-verify", action="store_true", help="skip the rollback run made only to check the twin claim")
    parser.add_argument("--smoke", action="store_true", help="seed 0, mask none: 2 runs x 5 steps (tests)")
    parser.add_argument("--report", action="store_true", help="write results, tables and figure; run nothing")
    parser.add_argument("--results", type=Path, default=None,
                        help="the study's record, one row per run (default docs/health/results.jsonl; "
                             "with --smoke, OUT/results.jsonl)")
    parser.add_argument("--doc", type=Path, default=DOC)
    parser.add_argument("--figure", type=Path, default=FIGURE)
    parser.add_argument("overrides", nargs="*", help="extra key=value overrides for every run")
    args = parser.parse_args(argv)
    grid = study_grid((0,), ("none",), (UNSTABLE_LR,)) if args.smoke else study_grid(tuple(args.seeds))
    verify = ("none", 0) if args.smoke else None if args.no_verify else VERIFY_TWIN
    results = args.results or (args.out / "results.jsonl" if args.smoke else RESULTS)
    if args.report:  # over the whole grid whatever --seeds says: the record keeps every run's row
        write_report(grid if args.smoke else study_grid(), args.out, results, args.doc, args.figure, verify)
        return 0
    extra = [*FIXED, *(SMOKE + SMOKE_EXTRA if args.smoke else []), *args.overrides]
    run_study(grid, args.out, args.recipe, extra, args.parallel, verify, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
