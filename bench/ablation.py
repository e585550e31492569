"""Mask ablation on the tiny CPU task: the tiny-scale version of the paper's Fig. 3 / Fig. 5.

Trains the built-in tiny recipe once per mask — ``none`` (JustRL/DAPO), ``stapo``, ``entropy_top``
(20-Entropy), ``prob_only``, ``high_entropy_low_prob`` and any user-registered mask — on the same
seeds, each run in its own process, and writes a comparison table (held-out accuracy before/after,
entropy trajectory, silenced fraction) plus one PNG with the curves side by side.

A tiny synthetic arithmetic task does NOT reproduce the paper's numbers; it demonstrates the
mechanism (which tokens each rule silences and what that does to entropy and reward).

    python bench/ablation.py                                   # full: 5 masks x 1 seed, ~5 min per run
    python bench/ablation.py --seeds 0 1 2 --out runs/ablation
    python bench/ablation.py --import examples/custom_mask.py --extra-mask low_confidence_positive
    python bench/ablation.py --smoke                           # a few steps per mask (used by the tests)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from stapo.cli import builtin_recipe  # noqa: E402
from stapo.plots import plot_comparison  # noqa: E402
from stapo.run_dir import METRICS_FILE, read_metrics  # noqa: E402

from _train_runs import BUILTIN_MASKS, SMOKE, run_training, train_command  # noqa: E402  (bench/ is on sys.path)


def run_one(mask: str, seed: int, out: Path, recipe: Path, imports: list[str], extra: list[str]) -> dict:
    """One training run in a fresh process; returns its summary row."""
    run_dir = out / f"{mask}_seed{seed}"
    start = time.perf_counter()
    run_training(train_command(mask, seed, run_dir, recipe, imports=imports, extra=extra),
                 f"{mask} seed {seed}")
    rows = read_metrics(run_dir / METRICS_FILE)
    steps = [r for r in rows if "entropy_mean" in r]
    evals = [r for r in rows if "eval_accuracy" in r]
    entropy = [r["entropy_mean"] for r in steps]
    return {
        "mask": mask, "seed": seed, "run_dir": str(run_dir),
        "acc_before": evals[0]["eval_accuracy"] if evals else float("nan"),
        "acc_after": evals[-1]["eval_accuracy"] if evals else float("nan"),
        "reward_last": statistics.fmean(r["reward_mean"] for r in steps[-5:]),
        "entropy_first": entropy[0], "entropy_last": entropy[-1],
        "entropy_min": min(entropy), "entropy_max": max(entropy),
        "entropy_std": statistics.pstdev(entropy),
        "silenced_frac": statistics.fmean(r["silenced_frac"] for r in steps),
        "spurious_frac": statistics.fmean(r["spurious_frac"] for r in steps),
        "seconds": time.perf_counter() - start,
    }


def markdown_table(rows: list[dict]) -> str:
    lines = ["| mask | seed | acc. before | acc. after | Δ points | reward (last 5) | entropy first → last "
             "(min / max, std) | silenced % | spurious % | time (s) |",
             "|---|---:|---:|---:|---:|---:|---|---:|---:|---:|"]
    for r in rows:
        lines.append(
            f"| `{r['mask']}` | {r['seed']} | {100 * r['acc_before']:.1f} | {100 * r['acc_after']:.1f} | "
            f"{100 * (r['acc_after'] - r['acc_before']):+.1f} | {r['reward_last']:+.3f} | "
            f"{r['entropy_first']:.3f} → {r['entropy_last']:.3f} ({r['entropy_min']:.3f} / {r['entropy_max']:.3f}, "
            f"{r['entropy_std']:.3f}) | {100 * r['silenced_frac']:.3f} | {100 * r['spurious_frac']:.3f} | "
            f"{r['seconds']:.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", type=Path, default=builtin_recipe())
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--masks", nargs="+", default=list(BUILTIN_MASKS))
    parser.add_argument("--import", dest="imports", action="append", default=[], metavar="FILE")
    parser.add_argument("--extra-mask", action="append", default=[], help="a user-registered mask to add")
    parser.add_argument("--out", type=Path, default=ROOT / "outputs" / "ablation")
    parser.add_argument("--smoke", action="store_true", help="a few steps per mask (tests)")
    parser.add_argument("overrides", nargs="*", help="extra key=value overrides for every run")
    args = parser.parse_args(argv)
    extra = (SMOKE if args.smoke else []) + args.overrides
    masks = [*args.masks, *args.extra_mask]
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for seed in args.seeds:
        for mask in masks:
            print(f"[ablation] {mask} seed {seed} ...", file=sys.stderr, flush=True)
            rows.append(run_one(mask, seed, args.out, args.recipe, args.imports, extra))
            print(f"[ablation] {mask} seed {seed}: accuracy {100 * rows[-1]['acc_before']:.1f} -> "
                  f"{100 * rows[-1]['acc_after']:.1f} in {rows[-1]['seconds']:.0f} s",
                  file=sys.stderr, flush=True)
    table = markdown_table(rows)
    (args.out / "ablation.md").write_text(table + "\n", encoding="utf-8")
    (args.out / "ablation.json").write_text(json.dumps(rows, indent=2), encoding="utf-8")
    seed0 = args.seeds[0]
    plot_comparison({r["mask"]: Path(r["run_dir"]) / METRICS_FILE for r in rows if r["seed"] == seed0},
                    args.out / "ablation.png",
                    keys=("reward_mean", "entropy_mean", "silenced_frac", "response_length_mean"))
    print(table)  # stdout is the Markdown that bench/run_all.py puts into docs/benchmarks.md
    print(f"written: {args.out / 'ablation.md'}, {args.out / 'ablation.png'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
