"""``stapo train``: a run, its ``--dry-run`` (every check that needs no weights) and the end-of-run summary."""

from __future__ import annotations

import argparse
import sys

from stapo.cli.common import UserError, load_config, load_user_modules
from stapo.config import STAPOConfig
from stapo.run_dir import written_artifacts


def cmd_train(args: argparse.Namespace) -> int:
    load_user_modules(args.imports)
    cfg = load_config(args.config, args.overrides)
    if args.world_size is not None and not args.dry_run:
        raise UserError("--world-size applies to --dry-run only (a launch takes its ranks from the launcher)")
    if args.summary and not args.dry_run:
        raise UserError("--summary applies to --dry-run only")
    if args.dry_run:
        return dry_run(cfg, args.world_size, with_config=not args.summary)
    from stapo.trainer import STAPOTrainer
    from stapo.trainer.interrupt import RunInterrupted

    trainer = STAPOTrainer(cfg)
    try:
        summary = trainer.train()
    except RunInterrupted as stop:
        if trainer.dist.is_main:
            print(f"stapo train: stopped by {stop}", file=sys.stderr)
        return stop.exit_status
    if trainer.dist.is_main:
        print_summary(cfg, summary)
    return 0


def dry_run(cfg: STAPOConfig, world_size: int | None, *, with_config: bool = True) -> int:
    """Every check ``train`` makes before loading weights (``stapo.trainer.preflight``), the run's shape and
    settings, then the resolved config."""
    from stapo.distributed.process_group import launcher_world_size
    from stapo.trainer.components import build_scorer
    from stapo.trainer.preflight import plan_run, summary_lines

    plan = plan_run(cfg, world_size if world_size is not None else launcher_world_size())
    _, close = build_scorer(cfg, None)  # reward.function: imported and its signature checked
    close()
    print("\n".join(["stapo train --dry-run: the config is valid (nothing was loaded or trained)",
                     *("  " + line for line in summary_lines(cfg, plan))]))
    if with_config:
        print("\nthe resolved config (--summary leaves it out):\n" + cfg.to_yaml(), end="")
    return 0


def print_summary(cfg: STAPOConfig, summary: dict) -> None:
    before, after = summary["accuracy_before"], summary["accuracy_after"]
    session, steps = summary.get("session_steps", summary["steps"]), summary["steps"]
    resumed = f" (resumed at step {steps - session}; now at step {steps})" if session != steps else ""
    lines = [
        "",
        f"stapo: {session} steps in {summary['seconds'] / 60:.1f} min{resumed}  (mask: {cfg.mask.name})",
    ]
    if before == before and after == after:  # not NaN: a held-out set was evaluated
        lines.append(f"  held-out accuracy (greedy): {100 * before:.1f}% -> {100 * after:.1f}% "
                     f"({100 * (after - before):+.1f} points)")
    lines += [
        f"  silenced tokens: {100 * summary['silenced_frac_mean']:.3f}% of response tokens "
        f"(spurious by S2T criterion: {100 * summary['spurious_frac_mean']:.3f}%)",
        f"  outputs: {cfg.trainer.output_dir}/ ({', '.join(written_artifacts(cfg.trainer.output_dir))})",
    ]
    print("\n".join(lines))


def add_train_parser(sub) -> None:
    train = sub.add_parser("train", help="train a policy (no CONFIG: the built-in tiny CPU demo)",
                           description="Train with STAPO or a baseline. CONFIG is a YAML recipe or a recipe's "
                                       "name (stapo recipes); overrides are dotted key=value pairs, e.g. "
                                       "optim.lr=2e-6.")
    train.add_argument("config", nargs="?", help="YAML recipe or recipe name (default: the built-in tiny CPU recipe)")
    train.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.total_steps=10")
    train.add_argument("--import", dest="imports", action="append", default=[], metavar="FILE",
                       help="Python file to import first (registers user masks)")
    train.add_argument("--dry-run", action="store_true",
                       help="check the config, overrides, mask, reward, engine, batch shares and output_dir, "
                            "print the run's size and settings, then the resolved config, and exit without "
                            "loading the model")
    train.add_argument("--summary", action="store_true", help="with --dry-run: the summary only, not the config")
    train.add_argument("--world-size", type=int, default=None, metavar="N",
                       help="ranks the dry run plans for (default: the launcher's WORLD_SIZE, else 1)")
    # the deepspeed launcher appends --local_rank=N; ranks are read from the environment instead
    train.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    train.set_defaults(func=cmd_train)
