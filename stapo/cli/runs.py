"""Reading a run directory: ``stapo status`` (where a run is and how to go on), ``stapo inspect`` and
``stapo health``."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import yaml

from stapo.cli.common import UserError
from stapo.run_dir import (CONFIG_FILE, FINAL_DIR, INSPECT_DIR, METRICS_FILE, complete_checkpoints, latest_checkpoint,
                           read_metrics, step_of)

_HEADLINE_METRICS = ("reward_mean", "accuracy", "silenced_frac", "entropy_mean", "eval_accuracy")


def _run_dir(path: str) -> Path:
    run_dir = Path(path)
    if not run_dir.is_dir():
        raise UserError(f"no such run directory: {run_dir}")
    return run_dir


def _ago(path: Path) -> str:
    minutes = (time.time() - path.stat().st_mtime) / 60
    return f"{minutes:.0f} min ago" if minutes < 120 else f"{minutes / 60:.1f} h ago"


def status_lines(run_dir: Path) -> list[str]:
    """``stapo status RUN_DIR``: config, last step and metrics, newest checkpoint, the command that continues it."""
    config_file = run_dir / CONFIG_FILE
    if not config_file.is_file():
        raise UserError(f"{run_dir} holds no {CONFIG_FILE}: not the output_dir of a stapo run")
    cfg = yaml.safe_load(config_file.read_text(encoding="utf-8")) or {}
    total = cfg.get("trainer", {}).get("total_steps")
    rows = read_metrics(run_dir) if (run_dir / METRICS_FILE).is_file() else []
    steps = [r for r in rows if "loss" in r]
    lines = [f"run: {run_dir}  (model {cfg.get('model', {}).get('path')}, mask {cfg.get('mask', {}).get('name')}, "
             f"{total} steps)"]
    if steps:
        last = steps[-1]
        shown = ", ".join(f"{k} {last[k]:.4g}" for k in _HEADLINE_METRICS if isinstance(last.get(k), (int, float)))
        lines.append(f"progress: step {last['step']} of {total}, logged {_ago(run_dir / METRICS_FILE)}: {shown}")
    else:
        lines.append(f"progress: no training step logged yet (of {total})")
    evals = [r for r in rows if "eval_accuracy" in r]
    if evals:
        lines.append(f"held-out accuracy: {evals[0]['eval_accuracy']:.4g} at step {evals[0]['step']} -> "
                     f"{evals[-1]['eval_accuracy']:.4g} at step {evals[-1]['step']}")
    checkpoint = latest_checkpoint(run_dir)
    how = cfg.get("trainer", {}).get("resume")
    resume = f"stapo train {config_file}" + ("" if how == "auto" else " trainer.resume=auto")
    if checkpoint is None:
        return lines + ["last checkpoint: none (a restart starts anew; the run's files move to previous_runs/)",
                        f"start again: {resume}"]
    meta_file = checkpoint / "meta.json"
    ranks = json.loads(meta_file.read_text(encoding="utf-8")).get("world_size") if meta_file.is_file() else None
    kept = len(complete_checkpoints(run_dir))
    lines.append(f"last checkpoint: {checkpoint} (step {step_of(checkpoint)}, saved {_ago(checkpoint)}; "
                 f"{kept} kept)" + (f", {ranks} rank(s)" if ranks else ""))
    on_ranks = f" on {ranks} ranks (a launcher with the same count)" if ranks and ranks > 1 else ""
    if total is not None and step_of(checkpoint) >= total:
        final = run_dir / FINAL_DIR
        return lines + [f"finished{f': final model in {final}' if final.is_dir() else ''}; to train further: "
                        f"{resume} trainer.total_steps=N (N > {total}){on_ranks}"]
    return lines + [f"resume (once stopped): {resume}{on_ranks} (trainer.resume=auto continues {checkpoint.name})"]


def cmd_status(args: argparse.Namespace) -> int:
    print("\n".join(status_lines(_run_dir(args.run_dir))))
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    """The report's files, and its headline numbers (the summary at the top of its index.md) on the console."""
    from stapo.inspect import inspect_run

    run_dir = _run_dir(args.run_dir)
    out = inspect_run(run_dir, Path(args.out) if args.out else None)
    headline = [line[2:] for line in (out / "index.md").read_text(encoding="utf-8").splitlines()
                if line.startswith("- ")]
    print("\n".join([*headline, f"inspector report: {out} (index.md, report.html)"]))
    return 0


def cmd_health(args: argparse.Namespace) -> int:
    """The run's health timeline (docs/health.md): a table on stdout, the figure beside it."""
    from stapo.health.timeline import read_timeline, render_timeline
    from stapo.plots import plot_health
    from stapo.run_dir import HEALTH_FILE

    run_dir = _run_dir(args.run_dir)
    if args.every < 1:
        raise UserError(f"--every must be >= 1, got {args.every}")
    timeline = read_timeline(run_dir)
    print(render_timeline(timeline, every=args.every))
    print(f"\nfigure: {plot_health(timeline, Path(args.out) if args.out else run_dir / HEALTH_FILE)}")
    return 0


def add_run_parsers(sub) -> None:
    status = sub.add_parser("status", help="where a run is: its last step and metrics, last checkpoint, and the "
                                           "command that resumes it")
    status.add_argument("run_dir", help="the run's output_dir")
    status.set_defaults(func=cmd_status)

    inspect = sub.add_parser("inspect", help="spurious-token report of a run (needs inspect.record_every)")
    inspect.add_argument("run_dir", help="the run's output_dir")
    inspect.add_argument("--out", help=f"report directory (default: RUN_DIR/{INSPECT_DIR})")
    inspect.set_defaults(func=cmd_inspect)

    health = sub.add_parser("health", help="a run's health timeline: accuracy, entropy, each monitor, alarms and "
                                           "rollbacks (a table, and a PNG beside it); works on a running run")
    health.add_argument("run_dir", help="the run's output_dir")
    health.add_argument("--every", type=int, default=10, metavar="N", help="a table row every N steps (default 10) "
                        "and at every evaluation and event")
    health.add_argument("--out", help="the figure's path (default: RUN_DIR/health.png)")
    health.set_defaults(func=cmd_health)
