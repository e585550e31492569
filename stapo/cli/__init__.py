"""stapo command line: train, list masks, tools and recipes, evaluate, inspect runs and their health.

User mistakes print one line, not a traceback (STAPO_TRACEBACK=1 shows it).

May import: every other folder of ``stapo`` (the top row of docs/index.md, "Layout").
"""

from __future__ import annotations

import argparse
import difflib
import faulthandler
import importlib.metadata
import logging
import os
import sys

from stapo.cli.catalog import add_catalog_parsers
from stapo.cli.common import UserError, builtin_recipe
from stapo.cli.runs import add_run_parsers
from stapo.cli.train import add_train_parser
from stapo.config import ConfigError
from stapo.run_dir import first_line

__all__ = ["UserError", "build_parser", "builtin_recipe", "main", "run"]


def cmd_serve(args: argparse.Namespace) -> int:
    """Replace this process with vLLM's server, set up for ``rollout.mode: server`` (docs/rollout.md)."""
    import torch

    from stapo.serve.launcher import serve_command, take_token_file
    from stapo.serve.secret import TOKEN_ENV, serve_secret

    dry_run = "--dry-run" in args.vllm_args
    token_file, vllm_args = take_token_file([a for a in args.vllm_args if a != "--dry-run"])
    secret, where = serve_secret(os.environ, token_file, create=not dry_run)
    argv, env = serve_command(args.model, vllm_args, sys.executable, os.environ, on_cpu=not torch.cuda.is_available(),
                              secret=secret)
    print(f"stapo serve: {where}", file=sys.stderr, flush=True)
    added = " ".join(f"{k}={v}" for k, v in env.items() if os.environ.get(k) != v and k != TOKEN_ENV)
    print(f"stapo serve: {added} {' '.join(argv)}", file=sys.stderr, flush=True)
    if dry_run:
        return 0
    os.execve(sys.executable, argv, env)
    return 0  # not reached


def _versions() -> str:
    """``stapo X (torch Y, ...)``: what a bug report needs, read from the installed metadata (nothing imported)."""
    def version(name: str) -> str:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return "not installed"

    packages = ("torch", "transformers", "deepspeed", "vllm", "peft")
    return f"stapo {version('stapo')} (python {sys.version.split()[0]}, " + \
        ", ".join(f"{name} {version(name)}" for name in packages) + ")"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="stapo", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # --version unwrapped
    parser.add_argument("--version", action="version", version=_versions())
    sub = parser.add_subparsers(dest="command", required=True)
    add_train_parser(sub)
    add_catalog_parsers(sub)

    from stapo.evaluation import add_arguments as add_eval_arguments, run_cli as cmd_eval

    evaluate = sub.add_parser("eval", help="avg@N / pass@k accuracy of a model on math benchmarks")
    add_eval_arguments(evaluate)
    evaluate.set_defaults(func=cmd_eval)
    add_run_parsers(sub)

    serve = sub.add_parser("serve", help="a vLLM server for rollout.mode=server (vLLM's own, with stapo's "
                                         "worker extension)",
                           description="Start vLLM's OpenAI-compatible server for training through it "
                                       "(rollout.mode=server, rollout.server.addresses=[HOST:PORT]). Options after "
                                       "MODEL go to vLLM, e.g. --port 8000 --tensor-parallel-size 2; "
                                       "--token-file PATH: the shared secret's file (read, or created 0600; "
                                       "default: STAPO_SERVER_TOKEN, else ~/.cache/stapo/server_token); "
                                       "--dry-run prints the server's command line and exits.")
    serve.add_argument("model", help="HF model directory or hub name (the policy's architecture)")
    serve.add_argument("vllm_args", nargs=argparse.REMAINDER, help="vLLM server options")
    serve.set_defaults(func=cmd_serve)
    parser.commands = sub.choices  # for _unknown's suggestions
    return parser


def _quiet_third_party() -> None:
    """Keep the console for stapo's progress: the libraries underneath show their errors only."""
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


def _unknown(parser: argparse.ArgumentParser, command: str, argument: str) -> str:
    """One line for an argument ``command`` does not take, with its closest option (``--dryrun``)."""
    options = list(parser.commands[command]._option_string_actions)  # argparse keeps no public list
    close = difflib.get_close_matches(argument, options, n=1, cutoff=0.6) if argument.startswith("-") else []
    return (f"unrecognized argument {argument}" + (f"; did you mean {close[0]}?" if close else "")
            + f" (stapo {command} --help lists its arguments)")


def main(argv: list[str] | None = None) -> int:
    from stapo.servers.pool import NoRolloutServers  # the run checkpointed and stopped: one line

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and hasattr(args, "overrides") and all("=" in e and not e.startswith("-") for e in extra):
        args.overrides += extra  # overrides after an option: `stapo train CONFIG --dry-run key=value`
    elif extra:
        print(f"stapo {args.command}: error: {_unknown(parser, args.command, extra[0])}", file=sys.stderr)
        return 2
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
        print(f"stapo {args.command}: error: {first_line(exc)}  (STAPO_TRACEBACK=1 shows the traceback)",
              file=sys.stderr)
        return 2


def run() -> None:
    """The ``stapo`` process: `main`, then an exit that a finished command's torch threads cannot turn into an
    abort (`exit_process`); `main` called in-process keeps its process group for the next trainer."""
    faulthandler.enable()  # a crash in native code prints the Python stacks that led to it
    status = main()
    if "torch.distributed" not in sys.modules:  # a command that never loaded torch: a plain exit
        sys.exit(status)
    from stapo.distributed.process_group import exit_process

    exit_process(status)


if __name__ == "__main__":
    run()
