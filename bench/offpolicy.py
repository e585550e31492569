"""Off-policy correction study on the tiny task: lock-step vs asynchronous training through one vLLM server.

Every run trains the built-in tiny recipe (its lr 5e-5, its ``stapo`` mask) with ``rollout.mode=server``
against ONE real vLLM server (``stapo serve``; vLLM's CPU build on a CPU machine), in lock-step
(``rollout.max_staleness=0``) or asynchronously (``rollout.max_staleness=2``: rows sampled by a policy up
to two updates old), with no correction, token-level truncated IS (``loss.rollout_is=token``, cap 2) or
one rejection filter (verl's K3-RS preset: ``loss.rollout_rs=seq_mean_k3``, threshold 0.01), over seeds.
The settings are fixed below, before the runs (docs/offpolicy.md, "Settings").

Each run is a fresh ``python -m stapo.cli train`` process, one at a time, seed-major (every mode and
correction of seed 0, then seed 1, ...), so a study cut short stays balanced. Resumable like
``bench/stability.py`` (its run bookkeeping is reused): a finished run is not rerun, an interrupted one
continues from its last checkpoint. After every run the committed rows (docs/offpolicy/results.jsonl) and
the generated block of docs/offpolicy.md are rewritten, so a crash loses nothing already run.

    python bench/offpolicy.py --out /tmp/offpolicy                     # the study (starts one server)
    python bench/offpolicy.py --report --out /tmp/offpolicy            # results.jsonl and the doc's tables
    python bench/offpolicy.py --smoke --out /tmp/smoke                 # 2 runs x 2 steps at tiny sizes

Run it with the Python of an environment that has vLLM (the CPU lane's, ``STAPO_VLLM_CPU_VENV``);
``--server HOST:PORT`` reuses a running ``stapo serve`` of a tiny model instead of starting one.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from stapo.cli import builtin_recipe  # noqa: E402
from stapo.run_dir import METRICS_FILE, latest_checkpoint, read_metrics, step_of  # noqa: E402

from _stability_report import _mean_se, plot_curves  # noqa: E402  (bench/ is on sys.path)
from _train_runs import SMOKE, TrainingFailed, run_training, train_command  # noqa: E402
from stability import TIMINGS_FILE, _failed, children_cpu_seconds, is_finished, read_timings  # noqa: E402

# ---- the study's fixed settings (docs/offpolicy.md, "Settings") ----------------------------------
MODES = {"lockstep": ["rollout.max_staleness=0"], "async_k2": ["rollout.max_staleness=2"]}
CORRECTIONS = {
    "none": ["loss.rollout_is=null"],
    "token_is": ["loss.rollout_is=token", "loss.rollout_is_threshold=2.0"],
    "seq_mean_k3": ["loss.rollout_is=null", "loss.rollout_rs=seq_mean_k3", "loss.rollout_rs_threshold=0.01"],
}
SEEDS = (0, 1, 2)
#: Sized from a pilot (seed 0, k=2, token IS, 6 steps of 16 prompts): ~2.1 s per step and ~10 s per 200-problem
#: evaluation on a quiet machine, the server using < 10% of a core. At the recipe's 32 prompts x 8 a 60-step
#: run is ~6 min wall, the 18 runs ~2 h plus two new warm starts (~3 min each): within the ~6 CPU-hour budget
#: with room for a busy machine.
STEPS, EVAL_EVERY = 60, 10
FIXED = [f"trainer.total_steps={STEPS}", f"trainer.eval_every={EVAL_EVERY}", "trainer.save_every=10",
         "trainer.export_hf=false", "logging.tensorboard=false", "logging.plot=false", "inspect.record_every=0",
         "rollout.mode=server"]
SMOKE_EXTRA = ["trainer.eval_every=1"]
COLLAPSE_POINTS = 10.0
DOC = ROOT / "docs" / "offpolicy.md"
RESULTS = ROOT / "docs" / "offpolicy" / "results.jsonl"
FIGURE = ROOT / "docs" / "images" / "offpolicy_curves.png"
BEGIN, END = "<!-- BEGIN offpolicy -->", "<!-- END offpolicy -->"


@dataclass(frozen=True)
class Run:
    mode: str
    correction: str
    seed: int

    @property
    def name(self) -> str:
        return f"{self.mode}_{self.correction}_seed{self.seed}"

    @property
    def label(self) -> str:
        return f"{self.mode} / {self.correction}"


def study_grid(seeds=SEEDS, modes=tuple(MODES), corrections=tuple(CORRECTIONS)) -> list[Run]:
    return [Run(m, c, s) for s in seeds for m in modes for c in corrections]


# ---- the one vLLM server --------------------------------------------------------------------------

class Server:
    """``stapo serve`` of the tiny model on loopback, started once and restarted if it stops answering.
    Every run pushes its own policy into it at start (rollout.mode=server syncs before the first step)."""

    def __init__(self, out: Path, address: str | None):
        self.out, self.address, self.proc = out, address, None

    def healthy(self) -> bool:
        from stapo.servers.client import ServerClient, parse_address

        return self.address is not None and ServerClient(parse_address(self.address)).healthy(timeout_s=5.0)

    def ensure(self) -> str:
        if self.healthy():
            return self.address
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        from async_overlap import build_model, start_server

        self.proc, self.address = start_server(build_model(self.out, gpu=False), self.out, gpu=False)
        return self.address

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)


# ---- running ------------------------------------------------------------------------------------

def run_one(run: Run, out: Path, recipe: Path, extra: list[str], server: str) -> dict:
    """Train (or continue) one run in a fresh process; returns its timing entry (appended to timings.jsonl)."""
    run_dir = out / run.name
    checkpoint = latest_checkpoint(run_dir)
    overrides = [*extra, *MODES[run.mode], *CORRECTIONS[run.correction], f"rollout.server.addresses=[{server}]"]
    cmd = train_command("stapo", run.seed, run_dir, recipe, resume="auto", extra=overrides)
    wall, cpu = time.perf_counter(), children_cpu_seconds()
    entry = {"run": run.name, "resumed_from_step": step_of(checkpoint) if checkpoint else 0, "ok": True}
    try:
        run_training(cmd, run.name, log_path=out / "logs" / f"{run.name}.log")
    except TrainingFailed as err:
        entry.update(ok=False, interrupted=err.returncode < 0, error=str(err).splitlines()[-1][:300])
    entry.update(wall_s=round(time.perf_counter() - wall, 1), cpu_s=round(children_cpu_seconds() - cpu, 1))
    with open(out / TIMINGS_FILE, "a", encoding="utf-8") as f:
        f.write(json.dumps(entry) + "\n")
    return entry


def run_study(grid: list[Run], out: Path, recipe: Path, extra: list[str], server: Server, report) -> None:
    out.mkdir(parents=True, exist_ok=True)
    for i, run in enumerate(grid, 1):
        done = is_finished(out / run.name)
        if done or _failed(read_timings(out).get(run.name)):
            print(f"[offpolicy] {i}/{len(grid)} {run.name}: {'finished' if done else 'failed'} earlier, not rerun",
                  file=sys.stderr, flush=True)
            continue
        address = server.ensure()
        print(f"[offpolicy] {i}/{len(grid)} {run.name} ... ({time.strftime('%H:%M:%S')}, server {address})",
              file=sys.stderr, flush=True)
        entry = run_one(run, out, recipe, extra, address)
        outcome = "done" if entry["ok"] else "interrupted" if entry["interrupted"] else "FAILED"
        print(f"[offpolicy] {i}/{len(grid)} {run.name}: {outcome} in {entry['wall_s']:.0f} s wall, "
              f"{entry['cpu_s']:.0f} s CPU (trainer; the server's CPU is not counted)", file=sys.stderr, flush=True)
        report()


# ---- per-run summary rows ------------------------------------------------------------------------

def _mean(steps: list[dict], key: str) -> float | None:
    values = [r[key] for r in steps if key in r and math.isfinite(r[key])]
    return statistics.fmean(values) if values else None


def summarize_run(run: Run, out: Path, attempts: list[dict]) -> dict:
    """The committed row of one run: status, eval curve, peak / final, mismatch and what was corrected."""
    run_dir = out / run.name
    row = {"run": run.name, "mode": run.mode, "correction": run.correction, "seed": run.seed}
    rows = read_metrics(run_dir / METRICS_FILE) if (run_dir / METRICS_FILE).is_file() else []
    steps = [r for r in rows if "loss" in r]
    if is_finished(run_dir):
        row["status"] = "done"
    elif _failed(attempts):
        row.update(status="failed", error=attempts[-1].get("error", ""))
    else:
        return {**row, "status": "pending", "steps_done": len(steps)}
    curve = sorted({int(r["step"]): r["eval_accuracy"] for r in rows if "eval_accuracy" in r}.items())
    if not curve or not steps:
        return {**row, "steps_done": len(steps)}
    peak_step, peak = max(curve, key=lambda c: (c[1], -c[0]))
    row.update(
        steps_done=len(steps), eval_curve=[[s, a] for s, a in curve], peak_acc=peak, peak_step=peak_step,
        final_acc=curve[-1][1], drop=peak - curve[-1][1], collapsed=100 * (peak - curve[-1][1]) >= COLLAPSE_POINTS,
        staleness=_mean(steps, "policy_staleness"), mismatch_kl=_mean(steps, "mismatch_kl"),
        mismatch_kl_k1=_mean(steps, "mismatch_kl_k1"),
        mismatch_abs_max=max(r["mismatch_logp_abs_max"] for r in steps),
        rejected_frac=_mean(steps, "rejected_frac"), rejected_seq_frac=_mean(steps, "rejected_seq_frac"),
        is_clipped_frac=_mean(steps, "rollout_is_clipped_frac"), is_ess=_mean(steps, "rollout_is_eff_sample_size"),
        is_max=max((r["rollout_is_max"] for r in steps if "rollout_is_max" in r), default=None),
        silenced_frac=_mean(steps, "silenced_frac"), skipped_steps=int(steps[-1]["skipped_steps"]),
        wall_s=round(sum(a["wall_s"] for a in attempts), 1), cpu_s=round(sum(a["cpu_s"] for a in attempts), 1))
    return row


def _fmt(value: float | None, scale: float = 1.0, spec: str = ".3g") -> str:
    return "–" if value is None else format(scale * value, spec)


def summary_table(rows: list[dict]) -> str:
    lines = ["| mode | correction | seeds | start acc. | peak acc. | final acc. | drop from peak | collapsed "
             "| mismatch_kl (k3) | mismatch_kl_k1 | rejected tokens % | rejected responses % | IS clipped % "
             "| IS ESS |", "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    balanced = {s for s in dict.fromkeys(r["seed"] for r in rows)  # seeds whose runs all finished
                if all("eval_curve" in r for r in rows if r["seed"] == s)}
    for mode, correction in dict.fromkeys((r["mode"], r["correction"]) for r in rows):
        group = [r for r in rows if (r["mode"], r["correction"]) == (mode, correction)]
        done = [r for r in group if "eval_curve" in r and r["seed"] in balanced]

        def mean_se(key, scale=100.0, digits=1):
            return _mean_se([r[key] for r in done if r.get(key) is not None], scale, digits)

        lines.append(
            f"| {mode} | `{correction}` | {', '.join(str(r['seed']) for r in done) or 'none yet'} (of {len(group)}) "
            f"| {_mean_se([r['eval_curve'][0][1] for r in done])} | {mean_se('peak_acc')} | {mean_se('final_acc')} "
            f"| {mean_se('drop')} | {sum(r['collapsed'] for r in done)} / {len(done)} "
            f"| {_fmt(_avg(done, 'mismatch_kl'))} | {_fmt(_avg(done, 'mismatch_kl_k1'))} "
            f"| {mean_se('rejected_frac', 100.0, 2)} | {mean_se('rejected_seq_frac', 100.0, 2)} "
            f"| {mean_se('is_clipped_frac', 100.0, 3)} | {_fmt(_avg(done, 'is_ess'), 1.0, '.4f')} |")
    return "\n".join(lines)


def _avg(rows: list[dict], key: str) -> float | None:
    values = [r[key] for r in rows if r.get(key) is not None]
    return statistics.fmean(values) if values else None


def runs_table(rows: list[dict]) -> str:
    lines = ["| mode | correction | seed | status | held-out accuracy at each eval | peak (step) | final | staleness "
             "| mismatch_kl | max abs mismatch | rejected % (responses %) | IS clipped % / ESS / max | wall min |",
             "|---|---|---:|---|---|---:|---:|---:|---:|---:|---|---|---:|"]
    for r in rows:
        head = f"| {r['mode']} | `{r['correction']}` | {r['seed']} |"
        if "eval_curve" not in r:
            lines.append(f"{head} {r['status']} ({r.get('steps_done', 0)} steps) |" + " |" * 9)
            continue
        curve = " ".join(f"{100 * a:.0f}" for _, a in r["eval_curve"])
        status = "**collapsed**" if r["collapsed"] else r["status"]
        is_cols = "–" if r["is_ess"] is None else \
            f"{100 * r['is_clipped_frac']:.3f} / {r['is_ess']:.4f} / {r['is_max']:.3g}"
        lines.append(
            f"{head} {status} | {curve} | {100 * r['peak_acc']:.1f} ({r['peak_step']}) | {100 * r['final_acc']:.1f} "
            f"| {_fmt(r['staleness'], 1.0, '.2f')} | {_fmt(r['mismatch_kl'])} | {_fmt(r['mismatch_abs_max'])} "
            f"| {100 * r['rejected_frac']:.2f} ({100 * r['rejected_seq_frac']:.2f}) | {is_cols} "
            f"| {r['wall_s'] / 60:.1f} |")
    return "\n".join(lines)


def render(rows: list[dict], results_link: str, figure_link: str) -> str:
    done = sum(r["status"] != "pending" for r in rows)
    return "\n".join([
        BEGIN,
        f"_Generated by `python bench/offpolicy.py --report` from [{Path(results_link).name}]({results_link}): "
        f"{done} of {len(rows)} runs finished. Summary: mean ± standard error over the seeds whose six runs all "
        f"finished; accuracies in points; mismatch_kl is the mean over steps and seeds of the per-step k3 "
        f"estimate of KL(π_sampler ‖ π_old); collapsed = final ≥ {COLLAPSE_POINTS:g} points below peak._",
        "", summary_table(rows), "", "Every run:", "", runs_table(rows), "",
        f"![held-out accuracy curves per mode and correction, every seed and their mean]({figure_link})", END])


def write_report(grid: list[Run], out: Path, results: Path, doc: Path, figure: Path) -> None:
    timings = read_timings(out)
    rows = [summarize_run(run, out, timings.get(run.name, [])) for run in grid]
    results.parent.mkdir(parents=True, exist_ok=True)
    results.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    # the stability report's figure: one panel per "mask" (here: mode / correction), lr as the row
    plot_curves([{**r, "mask": f"{r['mode']}/{r['correction']}", "lr": 5e-5} for r in rows], figure)
    link = {p: Path(os.path.relpath(p, doc.parent)).as_posix() for p in (results, figure)}
    text = doc.read_text(encoding="utf-8") if doc.is_file() else f"{BEGIN}\n{END}\n"
    head, rest = text.split(BEGIN, 1)
    doc.write_text(head + render(rows, link[results], link[figure]) + rest.split(END, 1)[1], encoding="utf-8")
    print(f"[offpolicy] {sum(r['status'] != 'pending' for r in rows)} of {len(rows)} runs finished; written "
          f"{results}, {doc}, {figure}", file=sys.stderr, flush=True)


# ---- command line -------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="the study's run directories (not committed)")
    parser.add_argument("--recipe", type=Path, default=builtin_recipe())
    parser.add_argument("--server", help="host:port of a running `stapo serve` of a tiny model (else one is started)")
    parser.add_argument("--smoke", action="store_true", help="2 runs x 2 steps at tiny sizes (the lane's check)")
    parser.add_argument("--report", action="store_true", help="write results.jsonl, the doc's tables; run nothing")
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--doc", type=Path, default=DOC)
    parser.add_argument("--figure", type=Path, default=FIGURE)
    args = parser.parse_args(argv)
    grid = study_grid((0,), ("async_k2",), ("none", "seq_mean_k3")) if args.smoke else study_grid()

    def report() -> None:
        write_report(grid, args.out, args.results, args.doc, args.figure)

    if args.report:
        report()
        return 0
    extra = [*FIXED, *(SMOKE + SMOKE_EXTRA if args.smoke else [])]
    server = Server(args.out, args.server)
    try:  # the committed rows follow every finished run of the study (not of a smoke run: --report writes those)
        run_study(grid, args.out, args.recipe, extra, server, (lambda: None) if args.smoke else report)
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
