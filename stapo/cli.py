"""stapo command line: train, list masks and tools, evaluate, inspect spurious tokens.

    stapo train                          # the built-in tiny CPU recipe (demo)
    stapo train recipe.yaml optim.lr=2e-6 trainer.output_dir=runs/x
    stapo train recipe.yaml --dry-run --world-size 64   # check a recipe and its batch shares; loads nothing
    stapo masks                          # registered token masks and their parameters
    stapo tools                          # registered tools, their limits, this machine's sandbox, parsers
    stapo eval MODEL_DIR --benchmark math500
    stapo inspect RUN_DIR                # spurious-token report of a run recorded with inspect.record_every
    stapo health RUN_DIR                 # the run's health timeline: monitors, alarms, rollbacks (docs/health.md)

User mistakes (missing file, unknown key, bad value, unreadable data or checkpoint) print one line,
not a traceback. Ctrl-C / SIGTERM during training save a checkpoint and exit with 130 / 143; a health alarm
with ``health.on_alarm=stop`` saves one and exits with 3 (docs/health.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.resources
import logging
import os
import re
import sys
from pathlib import Path

from stapo.config import ConfigError, STAPOConfig
from stapo.run_dir import written_artifacts

TINY_RECIPE = "tiny_cpu.yaml"
_DOTTED_KEY = re.compile(r"^[A-Za-z_][\w-]*(\.[A-Za-z_][\w-]*)+$")  # section.key, not a file name


class UserError(Exception):
    """A mistake in what the user asked for; printed as one line."""


def builtin_recipe(name: str = TINY_RECIPE) -> Path:
    return Path(str(importlib.resources.files("stapo") / "recipes" / name))


def _load_user_modules(paths: list[str]) -> None:
    """``--import my_masks.py`` registers user masks before the config is resolved."""
    import importlib.util

    for path in paths:
        file = Path(path)
        if not file.is_file():
            raise UserError(f"--import: no such file: {file}")
        spec = importlib.util.spec_from_file_location(file.stem, file)
        module = importlib.util.module_from_spec(spec)
        sys.modules[file.stem] = module
        spec.loader.exec_module(module)


def cmd_train(args: argparse.Namespace) -> int:
    _load_user_modules(args.imports)
    config, overrides = args.config, list(args.overrides)
    if config and "=" in config and not Path(config).exists():  # `stapo train key=value ...`
        config, overrides = None, [config, *overrides]
    if config and not Path(config).exists() and _DOTTED_KEY.match(config) and \
            Path(config).suffix not in (".yaml", ".yml"):  # `stapo train trainer.total_steps`
        raise UserError(f"{config!r} is neither a config file nor an override: an override needs a value, "
                        f"e.g. {config}=VALUE")
    cfg = STAPOConfig.from_yaml(Path(config) if config else builtin_recipe(), overrides=overrides)
    if args.world_size is not None and not args.dry_run:
        raise UserError("--world-size applies to --dry-run only (a launch takes its ranks from the launcher)")
    if args.dry_run:
        return _dry_run(cfg, args.world_size)
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
        _print_summary(cfg, summary)
    return 0


def _dry_run(cfg: STAPOConfig, world_size: int | None) -> int:
    """Every check ``train`` makes before loading weights (``stapo.trainer.preflight``), then the
    resolved config and the run's shape; a missing engine package or uncached model is reported,
    not an error: the recipe is usually meant for another machine."""
    from stapo.trainer.components import build_scorer
    from stapo.distributed.process_group import launcher_world_size
    from stapo.trainer.preflight import plan_run, summary_lines

    plan = plan_run(cfg, world_size if world_size is not None else launcher_world_size())
    _, close = build_scorer(cfg, None)  # reward.function: imported and its signature checked
    close()
    print(cfg.to_yaml(), end="")
    print("\n".join(["", "stapo train --dry-run: the config is valid (nothing was loaded or trained)",
                     *("  " + line for line in summary_lines(cfg, plan))]))
    return 0


def _print_summary(cfg: STAPOConfig, summary: dict) -> None:
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


def cmd_masks(args: argparse.Namespace) -> int:
    _load_user_modules(args.imports)
    from stapo.losses import describe_masks

    for info in describe_masks():
        params = ", ".join(
            f"{k}={'<required>' if v is dataclasses.MISSING else repr(v)}" for k, v in info.params.items()
        )
        print(f"{info.name:<24} {info.summary}")
        print(f"{'':<24} params: {params or '(none)'}")
    return 0


def cmd_tools(args: argparse.Namespace) -> int:
    _load_user_modules(args.imports)
    from stapo.tools import build_tool, describe_tool_parsers, describe_tools
    from stapo.tools.sandbox import Sandbox, SandboxStartError, isolation_summary

    for info in describe_tools():
        arguments = ", ".join(f"{k} ({v.get('type', 'any')}{', required' if k in info.arguments.get('required', ()) else ''})"
                              for k, v in info.arguments.get("properties", {}).items())
        params = ", ".join(f"{k}={'<required>' if v is dataclasses.MISSING else repr(v)}" for k, v in info.params.items())
        print(f"{info.name:<16} {info.summary}")
        print(f"{'':<16} arguments: {arguments or '(none)'}")
        print(f"{'':<16} params: {params or '(none)'}")
    try:  # what the python tool's sandbox gets on this machine
        with Sandbox(build_tool("python").limits) as sandbox:
            sandbox.start()
            print(f"\npython sandbox on this machine: {isolation_summary(sandbox.isolation)}")
    except SandboxStartError as exc:
        print(f"\npython sandbox on this machine: cannot start ({exc})")
    print("\ntool-call parsers:")
    for name, summary, stop in describe_tool_parsers():
        print(f"{name:<16} {summary}")
        print(f"{'':<16} stop: {', '.join(map(repr, stop)) or '(none)'}")
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    try:
        from stapo.evaluation import run_cli as run_eval
    except ImportError:
        raise UserError("stapo eval is not available in this build") from None
    return run_eval(args)


def cmd_inspect(args: argparse.Namespace) -> int:
    from stapo.inspect import inspect_run

    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():
        raise UserError(f"no such run directory: {run_dir}")
    out = inspect_run(run_dir, Path(args.out) if args.out else None)
    print(f"inspector report: {out}")
    return 0


def cmd_health(args: argparse.Namespace) -> int:
    """The run's health timeline (docs/health.md): a table on stdout, the figure beside it."""
    from stapo.health.timeline import read_timeline, render_timeline
    from stapo.plots import plot_health
    from stapo.run_dir import HEALTH_FILE

    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():
        raise UserError(f"no such run directory: {run_dir}")
    if args.every < 1:
        raise UserError(f"--every must be >= 1, got {args.every}")
    timeline = read_timeline(run_dir)
    print(render_timeline(timeline, every=args.every))
    print(f"\nfigure: {plot_health(timeline, Path(args.out) if args.out else run_dir / HEALTH_FILE)}")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    """Replace this process with vLLM's server, set up for ``rollout.mode: server`` (docs/rollout.md)."""
    import torch

    from stapo.rollout.serve import serve_command

    dry_run = "--dry-run" in args.vllm_args
    vllm_args = [a for a in args.vllm_args if a != "--dry-run"]
    argv, env = serve_command(args.model, vllm_args, sys.executable, os.environ, on_cpu=not torch.cuda.is_available())
    added = " ".join(f"{k}={v}" for k, v in env.items() if os.environ.get(k) != v)
    print(f"stapo serve: {added} {' '.join(argv)}", file=sys.stderr, flush=True)
    if dry_run:
        return 0
    os.execve(sys.executable, argv, env)
    return 0  # not reached


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="stapo", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="train a policy (no CONFIG: the built-in tiny CPU demo)",
                           description="Train with STAPO or a baseline. CONFIG is a YAML recipe; "
                                       "overrides are dotted key=value pairs, e.g. optim.lr=2e-6.")
    train.add_argument("config", nargs="?", help="YAML recipe (default: the built-in tiny CPU recipe)")
    train.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.total_steps=10")
    train.add_argument("--import", dest="imports", action="append", default=[], metavar="FILE",
                       help="Python file to import first (registers user masks)")
    train.add_argument("--dry-run", action="store_true",
                       help="check the config, overrides, mask, reward, engine, batch shares and output_dir, "
                            "print the resolved config and the run's size, and exit without loading the model")
    train.add_argument("--world-size", type=int, default=None, metavar="N",
                       help="ranks the dry run plans for (default: the launcher's WORLD_SIZE, else 1)")
    # the deepspeed launcher appends --local_rank=N; ranks are read from the environment instead
    train.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    train.set_defaults(func=cmd_train)

    masks = sub.add_parser("masks", help="list registered token masks and their parameters")
    masks.add_argument("--import", dest="imports", action="append", default=[], metavar="FILE",
                       help="Python file to import first (registers user masks)")
    masks.set_defaults(func=cmd_masks)

    tools = sub.add_parser("tools", help="list registered tools (their parameters and limits), what the python "
                                         "sandbox gets on this machine, and the tool-call parsers")
    tools.add_argument("--import", dest="imports", action="append", default=[], metavar="FILE",
                       help="Python file to import first (registers user tools)")
    tools.set_defaults(func=cmd_tools)

    evaluate = sub.add_parser("eval", help="avg@N / pass@k accuracy of a model on math benchmarks")
    _add_eval_arguments(evaluate)
    evaluate.set_defaults(func=cmd_eval)

    inspect = sub.add_parser("inspect", help="spurious-token report of a run (needs inspect.record_every)")
    inspect.add_argument("run_dir", help="the run's output_dir")
    inspect.add_argument("--out", help="report directory (default: RUN_DIR/inspect)")
    inspect.set_defaults(func=cmd_inspect)

    health = sub.add_parser("health", help="a run's health timeline: accuracy, entropy, each monitor, alarms and "
                                           "rollbacks (a table, and a PNG beside it); works on a running run")
    health.add_argument("run_dir", help="the run's output_dir")
    health.add_argument("--every", type=int, default=10, metavar="N", help="a table row every N steps (default 10) "
                        "and at every evaluation and event")
    health.add_argument("--out", help="the figure's path (default: RUN_DIR/health.png)")
    health.set_defaults(func=cmd_health)

    serve = sub.add_parser("serve", help="a vLLM server for rollout.mode=server (vLLM's own, with stapo's "
                                         "worker extension)",
                           description="Start vLLM's OpenAI-compatible server for training through it "
                                       "(rollout.mode=server, rollout.servers=[HOST:PORT]). Options after "
                                       "MODEL go to vLLM, e.g. --port 8000 --tensor-parallel-size 2; "
                                       "--dry-run prints the server's command line and exits.")
    serve.add_argument("model", help="HF model directory or hub name (the policy's architecture)")
    serve.add_argument("vllm_args", nargs=argparse.REMAINDER, help="vLLM server options")
    serve.set_defaults(func=cmd_serve)
    return parser


def _add_eval_arguments(parser: argparse.ArgumentParser) -> None:
    try:
        from stapo.evaluation import add_arguments
    except ImportError:
        parser.add_argument("model", nargs="?")
        return
    add_arguments(parser)


def _quiet_third_party() -> None:
    """Keep the console for stapo's own progress: no per-load progress bars, deprecation spam or
    accelerator notices from the libraries underneath (their errors still show)."""
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")
    warnings.filterwarnings("ignore", category=UserWarning, module=r"deepspeed")
    import torch

    if "DS_ACCELERATOR" not in os.environ and not torch.cuda.is_available():
        os.environ["DS_ACCELERATOR"] = "cpu"  # what DeepSpeed would pick, without its warning
    for name in ("transformers", "datasets", "DeepSpeed", "deepspeed", "torch.distributed"):
        logging.getLogger(name).setLevel(logging.ERROR)
    try:
        import datasets
        import transformers

        transformers.utils.logging.disable_progress_bar()
        datasets.disable_progress_bars()
    except ImportError:
        pass


def main(argv: list[str] | None = None) -> int:
    from stapo.rollout.server_engine import NoRolloutServers  # the run checkpointed and stopped: one line

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and args.command == "train" and all("=" in e and not e.startswith("-") for e in extra):
        args.overrides += extra  # overrides after an option: `stapo train CONFIG --dry-run key=value`
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    _quiet_third_party()
    try:
        return args.func(args)
    except KeyboardInterrupt:  # outside the training loop, or a second Ctrl-C inside it
        if os.environ.get("STAPO_TRACEBACK"):
            raise
        print(f"stapo {args.command}: interrupted (no checkpoint written by this stop)", file=sys.stderr)
        return 130
    except (UserError, ConfigError, FileNotFoundError, ValueError, NoRolloutServers) as exc:
        if os.environ.get("STAPO_TRACEBACK"):
            raise
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        print(f"stapo {args.command}: error: {message}  (STAPO_TRACEBACK=1 shows the traceback)",
              file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
