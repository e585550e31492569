"""`stapo eval`: arguments and entry point (docs/evaluation.md has the usage).

User mistakes raise FileNotFoundError / ValueError with one line; the CLI prints it.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from stapo.evaluation.benchmarks import BENCHMARKS, SETTING_GROUPS, get_benchmark, local_benchmark
from stapo.evaluation.runner import DEFAULT_PASS_K, check_model_dir, evaluate_model
from stapo.rewards import available_reward_modes

__all__ = ["add_arguments", "run_cli"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the `stapo eval` arguments to `parser`."""
    parser.add_argument("model", help="Hugging Face model directory (e.g. a run's final/), or a LoRA adapter "
                                      "directory (a model.lora run's final/: merged into its base model)")
    parser.add_argument("--benchmark", action="append", default=[], metavar="NAME",
                        help=f"benchmark preset, repeatable (default: all: {', '.join(BENCHMARKS)}; none "
                             "when --data is given)")
    parser.add_argument("--data", action="append", default=[], metavar="[NAME=]FILE",
                        help="local .jsonl/.json/.parquet benchmark, repeatable; NAME=FILE loads preset NAME "
                             "(its fields and N) from FILE")
    parser.add_argument("--prompt-field", metavar="FIELD",
                        help="problem column of --data files (default: the preset's, else 'problem')")
    parser.add_argument("--answer-field", metavar="FIELD",
                        help="answer column of --data files (default: the preset's, else 'answer')")
    parser.add_argument("--samples", type=int, metavar="N",
                        help="samples per problem (default: the paper's N: 32 AIME/AMC, 4 others; 4 for files)")
    parser.add_argument("--settings", choices=sorted(SETTING_GROUPS), default="paper",
                        help="decoding: train (T=1.0, top-p=1.0), justrl (T=0.7, top-p=0.9), paper (both), "
                             "greedy (T=0: a training run's own evaluation; use --samples 1)")
    parser.add_argument("--max-new-tokens", type=int, default=20480, metavar="N", help="default: 20480 (paper)")
    from stapo.rollout.registry import engine_choices  # the registry: user-registered engines count

    parser.add_argument("--engine", choices=engine_choices(), default="auto",
                        help="auto: vLLM on a GPU when installed, else the HF engine")
    parser.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                        help="GPUs of the one vLLM engine (one process; for models one GPU cannot hold). "
                             "For one engine per GPU instead, launch with torchrun --nproc_per_node N")
    parser.add_argument("--batch-rows", type=int, default=1024, metavar="ROWS",
                        help="problems x samples per chunk (default 1024; its seed derives from its first "
                             "problem); chunks are dealt to torchrun ranks, so keep several per rank")
    parser.add_argument("--pass-k", type=int, nargs="+", default=list(DEFAULT_PASS_K), metavar="K",
                        help=f"k of pass@k to report (default: {' '.join(map(str, DEFAULT_PASS_K))}; k > N skipped)")
    parser.add_argument("--out", metavar="DIR", help="results directory (default: MODEL/eval)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-samples", action="store_true", help="do not write the responses (samples.jsonl)")
    parser.add_argument("--cache-dir", metavar="DIR", help="datasets cache directory (default: HF's own)")
    parser.add_argument("--reward-mode", default="math", choices=available_reward_modes(),
                        help="judge (as reward.mode; default: math); a response is correct when its reward is > 0")
    parser.add_argument("--reward-function", metavar="SPEC",
                        help="user reward function 'pkg.module:fn' or 'file.py:fn' (as reward.function)")
    parser.add_argument("--reward-function-batched", action="store_true",
                        help="the function takes the whole batch (as reward.function_batched)")
    parser.add_argument("--reward-timeout", type=float, default=5.0, metavar="S",
                        help="limit per verifier item / function call in seconds (as reward.timeout_s)")
    parser.add_argument("--tools", metavar="NAME[,NAME]",
                        help="every response is a tool episode calling these registered tools (stapo tools; "
                             "as rollout.tools in training); the tool calls and errors per episode are reported")
    parser.add_argument("--tool-parser", default="qwen3", metavar="NAME",
                        help="the call format of --tools (as rollout.tools.parser; default: qwen3)")
    parser.add_argument("--max-turns", type=int, default=8, metavar="N",
                        help="policy turns per episode with --tools (default 8); --max-new-tokens bounds the "
                             "episode's policy and context tokens")
    parser.add_argument("--dry-run", action="store_true",
                        help="check the model directory, benchmarks, engine and judge, print the plan and exit")


def run_cli(args: argparse.Namespace) -> int:
    """Run `stapo eval`: evaluate, print the table, write results.md / results.json / samples.jsonl."""
    model = check_model_dir(args.model)
    if args.reward_function_batched and not args.reward_function:
        raise ValueError("--reward-function-batched needs --reward-function")
    if args.reward_timeout <= 0:
        raise ValueError(f"--reward-timeout must be > 0, got {args.reward_timeout}")
    for name, value in (("--samples", args.samples), ("--max-new-tokens", args.max_new_tokens),
                        ("--tensor-parallel-size", args.tensor_parallel_size), ("--batch-rows", args.batch_rows),
                        ("--max-turns", args.max_turns)):
        if value is not None and value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    args.tools = _tools(args)
    benchmarks = _benchmarks(args)
    if args.dry_run:
        return _dry_run(model, benchmarks, args)
    report = evaluate_model(model, benchmarks, settings=SETTING_GROUPS[args.settings],
                            num_samples=args.samples, max_new_tokens=args.max_new_tokens, engine=args.engine,
                            seed=args.seed, pass_k=tuple(args.pass_k), keep_responses=not args.no_samples,
                            cache_dir=args.cache_dir, reward_mode=args.reward_mode,
                            reward_function=args.reward_function,
                            reward_function_batched=args.reward_function_batched,
                            reward_timeout_s=args.reward_timeout, tensor_parallel_size=args.tensor_parallel_size,
                            batch_rows=args.batch_rows, tools=args.tools, tool_parser=args.tool_parser,
                            max_turns=args.max_turns)
    from stapo.distributed.process_group import get_rank

    if get_rank() == 0:  # under torchrun every rank holds the whole report
        paths = report.write(Path(args.out) if args.out else model / "eval")
        print(report.markdown())
        print("written: " + ", ".join(str(p) for p in paths.values()))
    return 0


def _dry_run(model: Path, benchmarks: list, args: argparse.Namespace) -> int:
    """What `stapo eval` would sample, after the checks that need no weights; the judge is built
    (a --reward-function is imported) and the engine's needs on this machine reported."""
    from stapo.rewards import build_scorer
    from stapo.rollout.registry import engine_problem, resolve_engine

    build_scorer("function" if args.reward_function else args.reward_mode, timeout_s=args.reward_timeout,
                 function=args.reward_function, function_batched=args.reward_function_batched).close()
    engine = resolve_engine(args.engine)
    lines = [f"stapo eval --dry-run: {model} (nothing was loaded or sampled)"]
    for p in benchmarks:
        source = "local file" if p.is_local else "hub dataset, downloaded at start"
        lines.append(f"  {p.name}: {p.hf_name} ({source}), N = {args.samples or p.num_samples}")
    lines += [f"  settings: {args.settings}; max new tokens: {args.max_new_tokens}; pass@k: {args.pass_k}",
              f"  engine: {args.engine}" + (f" -> {engine}" if engine != args.engine else "")
              + (f", tensor parallel over {args.tensor_parallel_size} GPUs" if args.tensor_parallel_size > 1 else ""),
              f"  judge: {args.reward_function or args.reward_mode}"]
    if args.tools:
        lines.append(f"  tool episodes: {', '.join(args.tools)} ({args.tool_parser} calls, at most {args.max_turns} "
                     "turns)")
    problem = engine_problem(engine)
    lines += [f"  not on this machine: {problem}"] if problem else []
    print("\n".join(lines))
    return 0


def _tools(args: argparse.Namespace) -> list[str]:
    """--tools as registered names, with --tool-parser checked (each error names what is valid)."""
    if not args.tools:
        return []
    from stapo.tools import build_tool_parser, tool_params

    names = [name.strip() for name in args.tools.split(",") if name.strip()]
    for name in names:
        tool_params(name)  # an unknown name raises, listing the registered tools
    build_tool_parser(args.tool_parser, tools=tuple(names))
    return names


def _benchmarks(args: argparse.Namespace) -> list:
    """Presets from --benchmark (validated first) plus local files from --data."""
    presets = [get_benchmark(name.strip()) for arg in args.benchmark for name in arg.split(",") if name.strip()]
    if (args.prompt_field or args.answer_field) and not args.data:
        raise ValueError("--prompt-field / --answer-field apply to --data files; pass --data FILE")
    for spec in args.data:
        name, sep, path = spec.partition("=")
        if not sep or Path(spec).is_file():  # a plain path (it may contain '=')
            name, path = None, spec
        elif name not in BENCHMARKS:
            get_benchmark(name)  # raises: unknown preset, listing the valid ones
        presets.append(local_benchmark(path, name=name, prompt_field=args.prompt_field,
                                       answer_field=args.answer_field))
        presets = [p for p in presets if not (name and p.name == name and not p.is_local)]
    if not presets:
        presets = list(BENCHMARKS.values())
    return presets
