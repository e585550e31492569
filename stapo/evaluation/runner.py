"""`evaluate_model`: the paper's evaluation protocol (STAPO §5.1) on an HF model or LoRA adapter directory
(docs/evaluation.md). All datasets load before any generation, so a missing file or field fails in seconds.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from datetime import timedelta
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from stapo.data import PAPER_INSTRUCTION, PromptDataset
from stapo.evaluation.adapter import is_adapter_dir, loadable_model_dir
from stapo.evaluation.benchmarks import (PAPER_SETTINGS, BenchmarkPreset, DecodingSetting, get_benchmark,
                                         load_benchmark)
from stapo.evaluation.report import BenchmarkResult, EvalReport
from stapo.rollout import Rollout, RolloutEngine, SamplingParams, ToolEpisodes, generate
from stapo.rollout.sampling import derived_seed
from stapo.rollout.trajectory import prompt_seeds

__all__ = ["Ranks", "build_engine", "check_model_dir", "evaluate_model", "sample_benchmark"]

logger = logging.getLogger("stapo.evaluation")

DEFAULT_PASS_K = (1, 4, 32)
#: How long a data-parallel rank may wait at the exchange for the slowest rank's last chunk.
EVAL_COLLECTIVE_TIMEOUT = timedelta(hours=12)


def check_model_dir(model_path: str | Path) -> Path:
    """The model (or LoRA adapter) directory, or FileNotFoundError naming what is missing."""
    path = Path(model_path)
    if not path.is_dir():
        raise FileNotFoundError(f"no such model directory: {path}")
    if is_adapter_dir(path):
        return path
    if not (path / "config.json").is_file():
        hint = " (a training run? its weights are in final/ or a checkpoint)" if (path / "final").is_dir() else ""
        raise FileNotFoundError(f"{path} is not a Hugging Face model directory: no config.json{hint}")
    return path


def evaluate_model(model_path: str | Path, benchmarks: Sequence[str | BenchmarkPreset], *,
                   settings: Sequence[DecodingSetting] = PAPER_SETTINGS, num_samples: int | None = None,
                   max_new_tokens: int = 20480, engine="auto", seed: int = 0,
                   pass_k: Sequence[int] = DEFAULT_PASS_K, batch_rows: int = 1024,
                   instruction: str | None = PAPER_INSTRUCTION, keep_responses: bool = True,
                   cache_dir: str | Path | None = None, reward_mode: str = "math",
                   reward_function: str | None = None, reward_function_batched: bool = False,
                   reward_timeout_s: float = 5.0, tensor_parallel_size: int = 1, tools: Sequence[str] = (),
                   tool_parser: str = "qwen3", max_turns: int = 8) -> EvalReport:
    """Evaluate a model on `benchmarks` under `settings`; the options are `stapo eval`'s (docs/evaluation.md).

    ``engine``: a registered engine's name or a ready `RolloutEngine`; ``tools``: every response a tool episode.
    """
    if num_samples is not None and num_samples < 1:
        raise ValueError(f"num_samples must be >= 1, got {num_samples}")
    if max_new_tokens < 1 or batch_rows < 1 or not settings or any(k < 1 for k in pass_k):
        raise ValueError("max_new_tokens, batch_rows and every pass@k must be >= 1 and settings non-empty")
    if tensor_parallel_size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {tensor_parallel_size}")
    ranks = _join_ranks(tensor_parallel_size)
    start = time.perf_counter()
    presets = [get_benchmark(b) if isinstance(b, str) else b for b in benchmarks]
    if not presets:
        raise ValueError("no benchmarks to evaluate")
    if len({p.name for p in presets}) < len(presets):
        raise ValueError(f"benchmark names must be unique, got {[p.name for p in presets]}")
    stack = contextlib.ExitStack()  # a LoRA adapter dir: its merged temp dir lives until the engine loaded it
    load_path = stack.enter_context(loadable_model_dir(check_model_dir(model_path))) \
        if isinstance(engine, str) else model_path
    with stack:
        tokenizer = _load_tokenizer(load_path) if isinstance(engine, str) else engine.tokenizer
        tokenizer = tokenizer or _load_tokenizer(model_path)
        episodes = _tool_episodes(tokenizer, tools, tool_parser, max_turns) if tools else None
        schemas = [t.schema() for t in episodes.tools.values()] if episodes is not None else None
        datasets = [load_benchmark(p, tokenizer, instruction=instruction, cache_dir=cache_dir, tools=schemas)
                    for p in presets]
        for p, ds in zip(presets, datasets, strict=True):
            logger.info("%s: %d problems from %s, N = %d", p.name, len(ds), p.hf_name, num_samples or p.num_samples)
        longest_prompt = max(len(e.prompt_ids) for ds in datasets for e in ds)
        engine_name, engine = build_engine(engine, load_path, tokenizer, max_model_len=longest_prompt + max_new_tokens,
                                           seed=seed, tensor_parallel_size=tensor_parallel_size)

    from stapo.rewards import build_scorer

    scorer = build_scorer("function" if reward_function else reward_mode, timeout_s=reward_timeout_s,
                          function=reward_function, function_batched=reward_function_batched)
    results = []
    try:
        for preset, ds in zip(presets, datasets, strict=True):
            for setting in settings:
                results.append(sample_benchmark(engine, scorer, ds, name=preset.name, setting=setting,
                                                num_samples=num_samples or preset.num_samples,
                                                max_new_tokens=max_new_tokens, seed=seed, pass_k=tuple(pass_k),
                                                batch_rows=batch_rows, keep_responses=keep_responses,
                                                ranks=ranks, tools=episodes))
    finally:
        scorer.close()
    return EvalReport(model_path=str(model_path), engine=engine_name, benchmarks=presets, settings=tuple(settings),
                      max_new_tokens=max_new_tokens, seed=seed, results=results,
                      seconds=time.perf_counter() - start)


@dataclasses.dataclass(frozen=True)
class Ranks:
    """This process among the evaluation's data-parallel ranks (one engine each)."""

    rank: int = 0
    world_size: int = 1


@dataclasses.dataclass(frozen=True)
class _Chunk:
    """One chunk's judged rows: (problems, N) arrays and the response texts per problem."""

    first: int
    correct: np.ndarray
    lengths: np.ndarray
    truncated: np.ndarray
    texts: list
    tool_calls: np.ndarray | None = None
    tool_errors: np.ndarray | None = None


def sample_benchmark(engine: RolloutEngine, scorer, dataset: PromptDataset, *, name: str, setting: DecodingSetting,
                     num_samples: int, max_new_tokens: int, seed: int, pass_k: tuple[int, ...] = DEFAULT_PASS_K,
                     batch_rows: int = 1024, keep_responses: bool = True, ranks: Ranks = Ranks(),
                     tools: ToolEpisodes | None = None) -> BenchmarkResult:
    """N samples per problem of `dataset` under `setting` (tool episodes with ``tools``), judged by `scorer`:
    a response is correct when its reward is > 0. Chunk ``c`` of ``batch_rows // N`` problems goes to rank
    ``c % world_size``, seeded by its first problem's index, so any rank count samples the same rows."""
    n, examples = num_samples, list(dataset)
    per_call = max(1, batch_rows // n)
    firsts = list(range(0, len(examples), per_call))[ranks.rank::ranks.world_size]
    mine = [examples[first: first + per_call] for first in firsts]
    seeds = [s for first, chunk in zip(firsts, mine) for s in prompt_seeds(derived_seed(seed, first), len(chunk))]
    sampling = SamplingParams(temperature=setting.temperature, top_p=setting.top_p, max_new_tokens=max_new_tokens)
    start = time.perf_counter()
    rollout = generate(engine, [e.prompt_ids for chunk in mine for e in chunk], n, sampling, tools=tools, seeds=seeds)
    chunks, row, total = [], 0, sum(len(chunk) for chunk in mine)
    for first, chunk in zip(firsts, mine, strict=True):
        chunks.append(_judge_chunk(scorer, chunk, first, rollout.select(slice(row, row + len(chunk) * n)), n,
                                   keep_responses))
        row += len(chunk) * n
        done = sum(len(c.correct) for c in chunks)
        share = f" (rank {ranks.rank}: {done}/{total})" if ranks.world_size > 1 else f" {done}/{len(examples)} problems"
        logger.info("%s [%s]%s, %.1f%% correct so far, %.0f s", name, setting.label, share,
                    100 * np.concatenate([c.correct for c in chunks]).mean(), time.perf_counter() - start)
    if ranks.world_size > 1:
        from stapo.distributed.process_group import all_gather_object

        chunks = [c for rank_chunks in all_gather_object(chunks) for c in rank_chunks]
    chunks.sort(key=lambda c: c.first)
    calls = np.concatenate([c.tool_calls for c in chunks]) if tools is not None else None
    return BenchmarkResult(benchmark=name, setting=setting, correct=np.concatenate([c.correct for c in chunks]),
                           response_lengths=np.concatenate([c.lengths for c in chunks]),
                           truncated=np.concatenate([c.truncated for c in chunks]),
                           problem_index=[e.index for e in examples], ground_truth=[e.ground_truth for e in examples],
                           responses=[t for c in chunks for t in c.texts], pass_k=pass_k, tool_calls=calls,
                           tool_errors=np.concatenate([c.tool_errors for c in chunks]) if tools is not None else None)


def _judge_chunk(scorer, chunk: list, first: int, rollout: Rollout, n: int, keep_responses: bool) -> _Chunk:
    """Judge one chunk's rows (problems ``first``, ``first + 1``, ...; rows: problem ``i // n``): an
    episode's final turn is its answer (`Rollout.answer_text`)."""
    answers = [e.ground_truth for e in chunk for _ in range(n)]
    fields = [e.fields for e in chunk for _ in range(n)]
    verdicts = [r > 0 for r in scorer.score(rollout.answer_text, answers, fields)]
    shape = (len(chunk), n)
    info = rollout.episodes
    return _Chunk(first=first, correct=np.asarray(verdicts, dtype=bool).reshape(shape),
                  lengths=rollout.response_lengths.numpy().reshape(shape),
                  truncated=np.asarray([r == "length" for r in rollout.finish_reason]).reshape(shape),
                  texts=[rollout.response_text[i * n: (i + 1) * n] for i in range(len(chunk))] if keep_responses
                  else [],
                  tool_calls=None if info is None else info.tool_calls.numpy().reshape(shape),
                  tool_errors=None if info is None else info.tool_errors.numpy().reshape(shape))


def _tool_episodes(tokenizer, names: Sequence[str], parser: str, max_turns: int) -> ToolEpisodes:
    """Episodes with the registered tools ``names`` (their default limits) in the ``parser`` call format."""
    from stapo.tools import build_tool, build_tool_parser

    return ToolEpisodes(tokenizer, build_tool_parser(parser, tools=tuple(names)),
                        {name: build_tool(name) for name in names}, max_turns=max_turns)


def _join_ranks(tensor_parallel_size: int) -> Ranks:
    """The launcher's ranks (torchrun & co.) as data-parallel evaluators; one process without one."""
    from stapo.distributed.process_group import init_distributed, launcher_world_size

    if launcher_world_size() == 1:
        return Ranks()
    if tensor_parallel_size > 1:
        raise ValueError(f"tensor_parallel_size {tensor_parallel_size} under a launcher with "
                         f"{launcher_world_size()} ranks: stapo eval runs either one engine over several GPUs "
                         "(one process, --tensor-parallel-size) or one engine per rank (torchrun), not both")
    info = init_distributed(timeout=EVAL_COLLECTIVE_TIMEOUT)  # a rank waits for the slowest one's last chunk
    return Ranks(info.rank, info.world_size)


def build_engine(engine: str | RolloutEngine, model_path: str | Path, tokenizer, *, max_model_len: int,
                 seed: int = 0, tensor_parallel_size: int = 1) -> tuple[str, RolloutEngine]:
    """`(name, engine)`: a ready engine is used as given; a name goes through the rollout-engine
    registry ("auto" picks vLLM on a GPU when installed)."""
    if not isinstance(engine, str):
        return type(engine).__name__, engine
    import torch

    from stapo.rollout.registry import EngineOptions, build_engine as build_registered, resolve_engine

    cuda = torch.cuda.is_available()
    opts = EngineOptions(dtype=torch.bfloat16 if cuda else torch.float32, max_model_len=max_model_len, seed=seed,
                         max_batch_size=64, gpu_memory_utilization=0.9, enable_sleep_mode=False,
                         tensor_parallel_size=tensor_parallel_size, progress=True)
    if tensor_parallel_size > 1 and resolve_engine(engine) != "vllm":
        raise ValueError(f"tensor_parallel_size {tensor_parallel_size} needs the vllm engine, got "
                         f"{resolve_engine(engine)}")
    return build_registered(engine, model_path, tokenizer, opts)


def _load_tokenizer(model_path: str | Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_path))

