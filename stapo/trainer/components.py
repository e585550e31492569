"""The one place where a :class:`~stapo.config.STAPOConfig` becomes components, which take flat
arguments (CONTRIBUTING.md)."""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Sequence
from typing import TypeVar
from datetime import timedelta
from pathlib import Path

import torch

from stapo.config import STAPOConfig
from stapo.distributed.process_group import DistInfo, barrier, broadcast_object
from stapo.distributed.attention import ONE_ROW_ATTENTION, choose_attention
from stapo.distributed.deepspeed_engine import ZeroTuning
from stapo.trainer import tool_setup
from stapo.trainer import server_setup
from stapo.losses import RolloutCorrection
from stapo.rewards import RewardTerm, build_reward_term
from stapo.trainer.model_source import BUILTIN_MODEL, require_model
from stapo.trainer.update import UpdateOptions

T = TypeVar("T")
log = logging.getLogger("stapo.trainer")

BUILTIN_DATA = "builtin:arithmetic"
# Seeds of the synthetic task's splits: the training prompts, the held-out set and the warm-start
# data never share a seed, so held-out accuracy is measured on unseen problems.
TRAIN_DATA_SEED, EVAL_DATA_SEED = 1_000_003, 2_000_003


def resolve_model_path(cfg: STAPOConfig, dist: DistInfo) -> str:
    """The policy's HF directory or hub name (checked before any weights load); the tiny model is built by
    rank 0 and its files copied into every rank's cache, which may be node-local."""
    if cfg.model.path != BUILTIN_MODEL:
        require_model(cfg.model.path)
        return cfg.model.path
    from stapo.tiny import arithmetic_problems, build_tiny_model, warm_start
    from stapo.tiny.cache import entry_files, install_entry
    from stapo.tiny.warmstart import DEFAULT_TRAIN_SEED

    def build() -> str:
        if cfg.tiny.task == "tir":  # tools demo: its own tokenizer, model and warm start (docs/tir.md)
            return tool_setup.build_tiny_tir_model(cfg, progress=dist.is_main)
        path = build_tiny_model(seed=cfg.tiny.seed)
        if cfg.tiny.warm_start_steps > 0:
            problems = arithmetic_problems(4000, seed=DEFAULT_TRAIN_SEED, terms=cfg.tiny.terms)
            path = warm_start(path, problems=problems, steps=cfg.tiny.warm_start_steps,
                              lr=cfg.tiny.warm_start_lr, seed=cfg.tiny.seed,
                              bare_fraction=cfg.tiny.warm_start_bare_fraction, progress=dist.is_main)
        return str(path)

    # One build, the same bytes everywhere: transformers' save_pretrained writes on global rank 0 only,
    # so another node could not build its own copy, and a warm start is only reproducible per machine.
    entry = None
    if dist.is_main:
        built = Path(build())
        entry = (built.name, entry_files(built))
    name, files = broadcast_object(entry)
    return str(install_entry(name, files))


def main_rank_first(dist: DistInfo, build: Callable[[], T]) -> T:
    """``build()`` on rank 0, then on the others (they find rank 0's cache instead of all writing it). Collective."""
    if dist.is_main:
        result = build()
    barrier()
    if not dist.is_main:
        result = build()
    return result


def collective_timeout(cfg: STAPOConfig) -> timedelta:
    return timedelta(minutes=cfg.trainer.collective_timeout_minutes)


def policy_dtype(cfg: STAPOConfig) -> torch.dtype:
    if cfg.model.dtype == "bf16" or (cfg.model.dtype == "auto" and torch.cuda.is_available()):
        return torch.bfloat16
    return torch.float32


def load_tokenizer(path: str, cfg: STAPOConfig):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=cfg.model.trust_remote_code)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def attention(cfg: STAPOConfig) -> str:
    return choose_attention(cfg.model.attn_implementation, dtype=policy_dtype(cfg))


def load_policy(path: str, cfg: STAPOConfig):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=policy_dtype(cfg), trust_remote_code=cfg.model.trust_remote_code,
        attn_implementation=attention(cfg),
    )
    model.config.use_cache = False
    return model


def build_policy(path: str, cfg: STAPOConfig):
    """The loaded model, with LoRA adapters (seeded by ``trainer.seed``) when ``model.lora.enabled``."""
    model = load_policy(path, cfg)
    lora = cfg.model.lora
    if not lora.enabled:
        return model
    from stapo.distributed.lora import wrap_with_lora

    return wrap_with_lora(model, rank=lora.rank, alpha=lora.alpha, dropout=lora.dropout,
                          target_modules=lora.target_modules, seed=cfg.trainer.seed)


def rows_per_rank(cfg: STAPOConfig, world_size: int) -> int:
    """Rows (prompts x G) of one mini-batch on one rank; the batch sizes must split evenly."""
    t = cfg.trainer
    for name, value in (("train_batch_size", t.train_batch_size), ("mini_batch_size", t.mini_batch_size)):
        if value % world_size:
            raise ValueError(f"trainer.{name} ({value}) must be divisible by the number of ranks ({world_size})")
    return t.mini_batch_size // world_size * cfg.rollout.group_size


def zero_tuning(cfg: STAPOConfig) -> ZeroTuning:
    return ZeroTuning(**dataclasses.asdict(cfg.zero))


def build_deepspeed(model, cfg: STAPOConfig, world_size: int):
    from stapo.distributed.deepspeed_engine import build_engine

    micro_batches = math.ceil(rows_per_rank(cfg, world_size) / cfg.trainer.micro_batch_size)
    return build_engine(
        model,
        lr=cfg.optim.lr,
        # the paper warms up over its first 10 rollout steps; the schedule counts optimizer steps
        warmup_steps=cfg.optim.warmup_steps * cfg.num_mini_batches,
        weight_decay=cfg.optim.weight_decay,
        betas=(cfg.optim.beta1, cfg.optim.beta2),
        grad_clip=cfg.optim.grad_clip,
        grad_accum_steps=micro_batches,
        micro_batch_size=cfg.trainer.micro_batch_size,
        zero_stage=cfg.trainer.zero_stage,
        bf16=policy_dtype(cfg) == torch.bfloat16,
        gradient_checkpointing=cfg.model.gradient_checkpointing,
        compile_layers=cfg.model.compile_layers,
        offload=cfg.trainer.offload,
        zero_tuning=zero_tuning(cfg),
    )


def build_training_offload(cfg: STAPOConfig, engine):
    """``rollout.offload_training_state`` (docs/gpu.md): ZeRO state to the host around generation, or None."""
    if not cfg.rollout.offload_training_state:
        return None
    from stapo.distributed.training_offload import TrainingOffload

    return TrainingOffload(engine)


def build_reference(cfg: STAPOConfig, model_path: str, policy=None):
    """The KL term's frozen reference, or None when ``loss.kl_coef`` is 0 (the paper); with LoRA, ``policy``
    with its adapters disabled (no second copy of the weights; use it inside ``lora.reference_scope``)."""
    if cfg.loss.kl_coef == 0:
        return None
    if cfg.model.lora.enabled:
        from stapo.distributed.lora import DisabledAdapters

        return DisabledAdapters(policy)
    from stapo.distributed.deepspeed_engine import build_reference as wrap

    return wrap(load_policy(model_path, cfg), zero_stage=cfg.trainer.zero_stage,
                bf16=policy_dtype(cfg) == torch.bfloat16, zero_tuning=zero_tuning(cfg))


def build_rollout_engine(cfg: STAPOConfig, model_path: str, tokenizer, dist_rank: int = 0):
    """``rollout.engine`` from the registry, seeded ``trainer.seed + rank`` (ranks must not share a stream)."""
    from stapo.rollout.registry import EngineOptions, build_engine

    r = cfg.rollout
    if r.mode == "server":
        return server_setup.build_server_engine(cfg, model_path, tokenizer, policy_dtype(cfg), dist_rank)
    opts = EngineOptions(dtype=policy_dtype(cfg), max_model_len=cfg.data.max_prompt_length + r.max_response_length,
                         seed=cfg.trainer.seed + dist_rank, max_batch_size=r.max_batch_size,
                         gpu_memory_utilization=r.gpu_memory_utilization, tensor_parallel_size=r.tensor_parallel_size,
                         sleep_level=r.sleep_level)
    name, engine = build_engine(r.engine, model_path, tokenizer, opts)
    log.info("rollout engine: %s", name)
    if r.tensor_parallel_size > 1:  # one engine per group of ranks: the group submits its prompts together
        from stapo.rollout.tensor_parallel import TensorParallelRollout, tensor_parallel_group

        engine = TensorParallelRollout(engine, tensor_parallel_group(r.tensor_parallel_size))
    return engine


def update_options(cfg: STAPOConfig) -> UpdateOptions:
    return UpdateOptions(
        clip_low=cfg.loss.clip_low,
        clip_high=cfg.loss.clip_high,
        clip_c=cfg.loss.clip_c,
        agg=cfg.loss.agg,
        log_ratio_clamp=cfg.loss.log_ratio_clamp,
        chunk_size=cfg.loss.chunk_size,
        temperature=cfg.rollout.temperature,
        max_response_length=cfg.rollout.max_response_length,
        kl_coef=cfg.loss.kl_coef,
        entropy_coef=cfg.loss.entropy_coef,
        packing=cfg.trainer.packing,
        pack_one_row=attention(cfg) in ONE_ROW_ATTENTION,
        micro_batch_size=cfg.trainer.micro_batch_size,
        max_tokens_per_micro_batch=cfg.trainer.max_tokens_per_micro_batch or None,
        max_tokens_per_stats_micro_batch=cfg.trainer.max_tokens_per_stats_micro_batch or None,
    )


def build_correction(cfg: STAPOConfig) -> RolloutCorrection:
    """The off-policy correction (``loss.rollout_*``); a no-op when everything is off."""
    return RolloutCorrection(**cfg.rollout_correction)


def correction_line(cfg: STAPOConfig) -> str:
    """What the run corrects, and why (``stapo train --dry-run`` and the trainer's log print it)."""
    line = f"off-policy correction: {build_correction(cfg).describe()}"
    k, lo = cfg.rollout.max_staleness, cfg.loss
    if lo.rollout_is == "auto":
        why = (f"importance weights on by default with rollout.max_staleness={k}; loss.rollout_is=null turns "
               "them off" if k >= 1 else
               "loss.rollout_is=auto: no importance weights in lock-step, the paper's setting")
        return line + f" ({why})"
    return line


def build_reward_terms(cfg: STAPOConfig) -> list[RewardTerm]:
    """The reward terms added to the scores (``reward.overlong_*``, ``reward.tool_*``; stapo.rewards.terms)."""
    rw = cfg.reward
    return [build_reward_term("overlong", max_response_length=cfg.rollout.max_response_length,
                              buffer=rw.overlong_buffer, penalty=rw.overlong_penalty),
            build_reward_term("tool", error_penalty=rw.tool_error_penalty, call_budget=rw.tool_call_budget,
                              call_penalty=rw.tool_call_penalty)]


RewardFn = Callable[[str, str], float]
BatchScorer = Callable[[Sequence[str], Sequence[str]], list[float]]


def build_scorer(cfg: STAPOConfig, reward_fn: RewardFn | None) -> tuple[BatchScorer, Callable[[], None]]:
    """``(scorer, close)``: ``reward_fn`` in-process when given, else the ``reward.mode`` registry's scorer
    (stapo/rewards/modes.py); ``scorer.failures`` feeds the metric ``reward_failures``."""
    from stapo.rewards import CallableScorer
    from stapo.rewards import build_scorer as build_reward_scorer

    r = cfg.reward
    if reward_fn is not None:
        scorer = CallableScorer(reward_fn, failure_value=r.failure_value)
    else:
        scorer = build_reward_scorer(r.scorer_mode, timeout_s=r.timeout_s, function=r.function,
                                     function_batched=r.function_batched, failure_value=r.failure_value)
    return scorer, scorer.close


def build_health(cfg: STAPOConfig):
    """The run's :class:`~stapo.health.HealthWatch` from the ``health`` section (docs/health.md)."""
    from stapo.health import HealthWatch, build_monitor

    h = cfg.health
    monitors = [build_monitor(name, **h.params.get(name, {})) for name in h.monitors]
    return HealthWatch(monitors, window=h.window, warmup=h.warmup, patience=h.patience, keep_healthy=h.keep_healthy)


def builtin_rows(n: int, seed: int, terms: int) -> list[dict]:
    from stapo.tiny import arithmetic_problems

    return [{"prompt": p.question, "answer": p.answer} for p in arithmetic_problems(n, seed=seed, terms=terms)]


def _dataset_loader(cfg: STAPOConfig, tokenizer, tools: list[dict] | None, max_prompt_length: int | None = None):
    """``load(source, override, n_builtin, seed, split) -> PromptDataset | None``, prompts listing ``tools``."""
    from stapo.data import PromptDataset, prompt_dataset_from_records

    d = cfg.data
    longest = d.max_prompt_length if max_prompt_length is None else max_prompt_length
    builtin = d.source == BUILTIN_DATA

    def from_rows(rows):  # a list of dicts (or an HF dataset) with the configured fields
        return prompt_dataset_from_records(
            rows, prompt_field="prompt" if builtin else d.prompt_field,
            answer_field="answer" if builtin else d.answer_field, preset=None if builtin else d.preset,
            tokenizer=tokenizer, instruction=d.instruction, tools=tools, max_prompt_length=longest)

    def load(source, override, n_builtin, seed, split):
        if isinstance(override, PromptDataset):
            return override
        if override is not None:
            return from_rows(override)
        if source is None:
            return None
        if source == BUILTIN_DATA:
            rows = (tool_setup.tiny_tir_rows(n_builtin, seed) if cfg.tiny.task == "tir"
                    else builtin_rows(n_builtin, seed, cfg.tiny.terms))
            return from_rows(rows)
        from stapo.data import load_prompt_dataset

        try:
            return load_prompt_dataset(
                source, split=split, prompt_field=d.prompt_field, answer_field=d.answer_field, preset=d.preset,
                tokenizer=tokenizer, instruction=d.instruction, max_prompt_length=longest,
                cache_dir=Path(cfg.trainer.output_dir) / "cache" / "datasets",  # nothing written elsewhere
                tools=tools)
        except KeyError as exc:  # a column a hub dataset lacks (local files are checked by plan_run)
            raise ValueError(f"{source}: {exc.args[0]} (data.prompt_field={d.prompt_field}, "
                             f"data.answer_field={d.answer_field})") from None

    return load


def _eval_source(cfg: STAPOConfig) -> str | None:
    d = cfg.data
    return d.eval_source if d.eval_source is not None else (BUILTIN_DATA if d.source == BUILTIN_DATA else None)


def build_datasets(cfg: STAPOConfig, tokenizer, train_dataset=None, eval_dataset=None,
                   max_prompt_length: int | None = None):
    """``(train, eval or None)`` PromptDatasets; prompts over ``max_prompt_length`` (`prompt_length_limit`) leave."""
    d = cfg.data
    load = _dataset_loader(cfg, tokenizer, tool_setup.tool_schemas(cfg), max_prompt_length)
    train = load(d.source, train_dataset, d.num_builtin_problems, TRAIN_DATA_SEED, d.split)
    evaluation = load(_eval_source(cfg), eval_dataset, d.eval_size, EVAL_DATA_SEED, "test")
    if len(train) < cfg.trainer.train_batch_size:
        raise ValueError(f"the training set has {len(train)} prompts, fewer than trainer.train_batch_size "
                         f"({cfg.trainer.train_batch_size})")
    return train, evaluation


def build_eval_without_tools(cfg: STAPOConfig, tokenizer, eval_dataset=None, max_prompt_length: int | None = None):
    """The held-out prompts offering no tools (``rollout.tools.eval_without_tools``), or None."""
    if not (cfg.rollout.tools.enabled and cfg.rollout.tools.eval_without_tools):
        return None
    if eval_dataset is not None and not isinstance(eval_dataset, list) and hasattr(eval_dataset, "examples"):
        raise ValueError("rollout.tools.eval_without_tools needs eval_dataset as rows (a list of dicts or an HF "
                         "dataset), not prompts already rendered with the tools")
    return _dataset_loader(cfg, tokenizer, None, max_prompt_length)(_eval_source(cfg), eval_dataset,
                                                                    cfg.data.eval_size, EVAL_DATA_SEED, "test")
