"""stapo's ``STAPOTrainer`` vs TRL's ``GRPOTrainer``, side by side on one CPU (docs/vs_trl.md).

    python bench/vs_trl.py                 # 8 prompts x G=8, 48 new tokens, 5 iterations, 3 reps
    python bench/vs_trl.py --smoke         # seconds-scale sizes (tests/test_bench_vs_trl.py)

Same warm-started tiny Qwen3 directory, same arithmetic prompts (chat template over
``question + " " + PAPER_INSTRUCTION``), same reward (``stapo.rewards.math_reward``), G, max new
tokens, lr, clip range [0.8, 1.28] and DAPO token-mean loss, same optimizer steps per rollout.
Two variants: ``dapo`` (stapo mask ``none`` vs TRL without entropy selection) and ``entropy``
(20-Entropy: stapo ``entropy_top`` vs TRL ``top_entropy_quantile=0.2``). Every run is a fresh
single-threaded-or-``--threads`` process (``_stapo_run.py`` / ``_trl_run.py``), ALTERNATING
stapo, trl, stapo, trl, ... so slow drifts of machine load hit both. Printed: a Markdown table
(median per-iteration wall time over runs, ratio, peak RSS, final reward), the 20-Entropy
selection-rule table on identical entropies, and the path of the reward-curve PNG.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
_LAUNCHER_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
VARIANTS = {"dapo": 1.0, "entropy": 0.2}  # variant -> top_entropy_quantile (fraction of tokens kept)


@dataclass
class RunSpec:
    """Everything both runners read; one optimizer step = ``prompts_per_update x G`` completions."""

    model_dir: str
    top_entropy_quantile: float = 1.0  # 1.0: DAPO; 0.2: 20-Entropy
    prompts: int = 8  # per iteration (= the whole prompt pool: both see the same prompts each step)
    group_size: int = 8
    max_new_tokens: int = 48
    iterations: int = 5
    updates_per_iteration: int = 2  # optimizer steps per rollout (stapo mini-batches)
    micro_batch: int = 8  # sequences per forward/backward
    lr: float = 1e-4
    clip_low: float = 0.2
    clip_high: float = 0.28
    seed: int = 0
    data_seed: int = 7
    zero_stage: int | None = None  # stapo's trainer.zero_stage; None: the trainer's default
    record_path: str = ""  # stapo only: save the mask's entropies of the first step here
    stapo_overrides: list = field(default_factory=list)  # extra ``section.key=value`` for stapo only

    @property
    def prompts_per_update(self) -> int:
        return self.prompts // self.updates_per_iteration


@dataclass
class RunResult:
    trainer: str
    step_times: list[float]  # wall seconds per iteration (rollout + reward + updates + sync)
    cpu_times: list[float]  # CPU seconds of the process per iteration (robust to other load)
    rewards: list[float]  # mean reward of each iteration's rollout
    setup_s: float
    peak_rss_mb: float
    phases: list[dict] = field(default_factory=list)  # stapo's per-phase seconds, per iteration


def problems(spec: RunSpec):
    from stapo.tiny import arithmetic_problems

    return arithmetic_problems(spec.prompts, seed=spec.data_seed)


def user_message(question: str) -> str:
    from stapo.data import PAPER_INSTRUCTION, format_problem

    return format_problem(question, PAPER_INSTRUCTION)  # what stapo's data loader sends


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def read_spec(path) -> RunSpec:
    return RunSpec(**json.loads(Path(path).read_text()))


def write_result(result: RunResult, path) -> None:
    Path(path).write_text(json.dumps(dataclasses.asdict(result)))


# ---- orchestration ------------------------------------------------------------------------------

def run_one(trainer: str, spec: RunSpec, out: Path, tag: str, threads: int, timeout: float) -> RunResult:
    """Run one trainer in a fresh process with ``threads`` intra-op threads; its log goes to ``out``."""
    spec_path, result_path = out / f"{tag}.spec.json", out / f"{tag}.result.json"
    spec_path.write_text(json.dumps(dataclasses.asdict(spec)))
    # A plain single process: launcher variables of the caller (DeepSpeed sets LOCAL_RANK once it has
    # initialized a group in this process) would make TRL/accelerate expect a distributed launch.
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARS}
    env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false",
               PYTHONWARNINGS="ignore")
    script = HERE / f"_{trainer}_run.py"
    with open(out / f"{tag}.log", "w") as log:
        proc = subprocess.run([sys.executable, str(script), str(spec_path), str(result_path)],
                              stdout=log, stderr=subprocess.STDOUT, env=env, timeout=timeout)
    if proc.returncode != 0:
        tail = (out / f"{tag}.log").read_text()[-3000:]
        raise RuntimeError(f"{trainer} run {tag} failed (exit {proc.returncode}); log tail:\n{tail}")
    return RunResult(**json.loads(result_path.read_text()))


def steady_median(times: list[float]) -> float:
    """Median iteration time without the first iteration (warm-up) when there are more."""
    return statistics.median(times[1:] if len(times) > 1 else times)


def summary_rows(results: dict[str, dict[str, list[RunResult]]]) -> list[str]:
    lines = ["| variant | trainer | wall s / iteration (median of runs; each run) | CPU s / iteration "
             "| first iteration wall (s) | setup (s) | peak RSS (MiB) | final reward | TRL / stapo wall | "
             "TRL / stapo CPU |", "|---|---|---|---|---|---|---|---|---|---|"]
    for variant, by_trainer in results.items():
        wall = {t: statistics.median(steady_median(r.step_times) for r in runs) for t, runs in by_trainer.items()}
        cpu = {t: statistics.median(steady_median(r.cpu_times) for r in runs) for t, runs in by_trainer.items()}
        for t, runs in by_trainer.items():
            ratios = [f"{d['trl'] / d['stapo']:.2f}x" if t == "trl" else "" for d in (wall, cpu)]
            lines.append(
                f"| {variant} | {t} | {wall[t]:.2f} ({', '.join(f'{steady_median(r.step_times):.2f}' for r in runs)})"
                f" | {cpu[t]:.2f} | {statistics.median(r.step_times[0] for r in runs):.2f}"
                f" | {statistics.median(r.setup_s for r in runs):.1f}"
                f" | {statistics.median(r.peak_rss_mb for r in runs):.0f}"
                f" | {statistics.median(r.rewards[-1] for r in runs):+.3f} | {ratios[0]} | {ratios[1]} |")
    return lines


def phase_rows(results: dict[str, dict[str, list[RunResult]]]) -> list[str]:
    """Where stapo's iteration time goes (median over runs and steady iterations)."""
    lines = ["| variant | " + " | ".join(["rollout", "reward", "stats", "update", "sync"]) + " |",
             "|---|---|---|---|---|---|"]
    for variant, by_trainer in results.items():
        runs = by_trainer.get("stapo", [])
        cells = []
        for phase in ("rollout", "reward", "stats", "update", "sync"):
            per_run = [statistics.median([p[phase] for p in r.phases[1:] or r.phases]) for r in runs if r.phases]
            cells.append(f"{statistics.median(per_run):.2f}" if per_run else "-")
        lines.append(f"| {variant} | " + " | ".join(cells) + " |")
    return lines


def plot_rewards(results: dict[str, dict[str, list[RunResult]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, axes = plt.subplots(1, len(results), figsize=(5.5 * len(results), 3.8), squeeze=False)
    colors = {"stapo": "tab:blue", "trl": "tab:orange"}
    for ax, (variant, by_trainer) in zip(axes[0], results.items()):
        for trainer, runs in by_trainer.items():
            for i, r in enumerate(runs):
                ax.plot(range(1, len(r.rewards) + 1), r.rewards, color=colors[trainer], alpha=0.35, lw=1)
            n = min(len(r.rewards) for r in runs)
            med = [statistics.median(r.rewards[k] for r in runs) for k in range(n)]
            ax.plot(range(1, n + 1), med, color=colors[trainer], lw=2.5, label=f"{trainer} (median of {len(runs)})")
        ax.set_title(f"{variant}: mean reward per iteration")
        ax.set_xlabel("iteration (rollout)")
        ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
        ax.set_ylabel("reward (+1/-1)")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--iterations", type=int, default=5)
    p.add_argument("--updates", type=int, default=2, help="optimizer steps per rollout")
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of every run")
    p.add_argument("--zero-stage", type=int, default=None,
                   help="stapo's trainer.zero_stage (default: the trainer's own default, 3; 0 is the CPU fix)")
    p.add_argument("--stapo-set", action="append", default=[], metavar="KEY=VALUE",
                   help="extra stapo config override, e.g. mask.stats_source=old (repeatable)")
    p.add_argument("--variants", default="dapo,entropy")
    p.add_argument("--warm-start-steps", type=int, default=300)
    p.add_argument("--out", type=Path, default=HERE / "results" / "vs_trl")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per run")
    p.add_argument("--smoke", action="store_true", help="tiny sizes, 1 rep, no warm start")
    a = p.parse_args(argv)
    if a.smoke:
        a.prompts, a.group_size, a.max_new_tokens, a.iterations, a.micro_batch = 2, 4, 8, 2, 4
        a.reps, a.warm_start_steps = 1, 0
    a.out.mkdir(parents=True, exist_ok=True)
    from stapo.tiny import build_tiny_model, warm_start

    model_dir = build_tiny_model()
    if a.warm_start_steps:
        model_dir = warm_start(model_dir, steps=a.warm_start_steps, progress=False)
    base = RunSpec(model_dir=str(model_dir), prompts=a.prompts, group_size=a.group_size,
                   max_new_tokens=a.max_new_tokens, iterations=a.iterations, updates_per_iteration=a.updates,
                   micro_batch=a.micro_batch, lr=a.lr, zero_stage=a.zero_stage,
                   stapo_overrides=list(a.stapo_set))
    variants = [v.strip() for v in a.variants.split(",") if v.strip()]
    results: dict[str, dict[str, list[RunResult]]] = {v: {"stapo": [], "trl": []} for v in variants}
    record = a.out / "entropy_batch.pt"
    record.unlink(missing_ok=True)
    start = time.perf_counter()
    for rep in range(a.reps):
        for variant in variants:
            spec = dataclasses.replace(base, top_entropy_quantile=VARIANTS[variant])
            for trainer in ("stapo", "trl"):  # alternating
                run_spec = dataclasses.replace(spec, record_path=str(record)) \
                    if trainer == "stapo" and variant == "entropy" and rep == 0 else spec
                res = run_one(trainer, run_spec, a.out, f"{variant}-{trainer}-{rep}", a.threads, a.timeout)
                results[variant][trainer].append(res)
                print(f"[{time.perf_counter() - start:6.0f}s] {variant} {trainer} rep {rep}: "
                      f"{steady_median(res.step_times):.2f} s/iter, rewards {[round(x, 2) for x in res.rewards]}",
                      file=sys.stderr, flush=True)
    report = _report(a, base, results, record)
    (a.out / "results.json").write_text(json.dumps(
        {"spec": dataclasses.asdict(base), "threads": a.threads,
         "results": {v: {t: [dataclasses.asdict(r) for r in rs] for t, rs in bt.items()} for v, bt in results.items()}},
        indent=1))
    (a.out / "report.md").write_text(report)
    print(report)
    return {"results": results, "report": report, "out": a.out}


def _report(a, base: RunSpec, results, record: Path) -> str:
    from _vs_trl_selection import selection_tables

    png = a.out / "rewards.png"
    plot_rewards(results, png)
    lines = [f"stapo vs TRL GRPOTrainer: {base.prompts} prompts x G={base.group_size}, {base.max_new_tokens} new "
             f"tokens, {base.iterations} iterations x {base.updates_per_iteration} optimizer steps, lr {base.lr}, "
             f"OMP_NUM_THREADS={a.threads}, stapo zero_stage={'default' if base.zero_stage is None else base.zero_stage}"
             f"{''.join(' ' + o for o in base.stapo_overrides)}, "
             f"{a.reps} runs each (alternating)",
             "", *summary_rows(results), "", "stapo phase seconds per iteration:", "", *phase_rows(results), ""]
    if record.exists():
        lines += selection_tables(record, micro_batch=base.micro_batch, keep_fraction=VARIANTS["entropy"],
                                  updates_per_iteration=base.updates_per_iteration)
    lines += ["", f"reward curves: {png}"]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
