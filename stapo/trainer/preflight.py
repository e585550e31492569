"""What a run will do, and whether it can start, decided before anything heavy is built: the trainer's first
step and ``stapo train --dry-run`` give the same messages. What this machine lacks is reported, not raised: a
dry run often checks a recipe for another machine (docs/distributed.md, "Check a launch first").
"""

from __future__ import annotations

import importlib.util
import math
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from stapo.config import STAPOConfig
from stapo.config.experiment import ConfigChanges
from stapo.losses import build_mask, mask_params
from stapo.rollout.registry import engine_problem, resolve_engine
from stapo.run_dir import written_artifacts
from stapo.distributed.process_group import get_rank
from stapo.trainer.components import attention, correction_line, rows_per_rank
from stapo.trainer.data_check import DataSource, check_data
from stapo.trainer.model_source import CACHED, LOCAL, ModelSource, model_source, offline, unavailable_reason
from stapo.trainer.resume import choose_checkpoint, log_changes, resume_changes, warn_skipped

__all__ = ["RunPlan", "plan_run", "summary_lines"]


@dataclass(frozen=True)
class RunPlan:
    """A run's shape on ``world_size`` ranks and what this machine lacks for it."""

    world_size: int
    rows_per_rank: int  # rows (prompts x G) of one mini-batch on one rank
    engine: str  # rollout.engine with auto resolved on this machine ("server": rollout.mode=server)
    engine_problem: str | None  # why that engine cannot run here (``stapo train`` stops with it)
    model: ModelSource
    model_problem: str | None  # why the weights cannot load here without the network
    resume_from: Path | None  # the checkpoint trainer.resume continues, None: a fresh start
    earlier_run: bool  # a fresh start moves an earlier run's files to previous_runs/
    data: tuple[DataSource, ...] = ()  # data.source (and data.eval_source), checked
    packages: tuple[tuple[str, str, bool], ...] = ()  # (package, why, required) the config needs but is missing
    resume_skipped: tuple[tuple[Path, str], ...] = ()  # newer checkpoints that cannot be resumed, and why
    servers_down: tuple[str, ...] = ()  # rollout.mode=server: listed servers that do not answer now
    changes: ConfigChanges | None = None  # a resumed run's config vs its checkpoint's (safe ones, or forced)

    @property
    def machine_problems(self) -> list[str]:
        """Everything this machine lacks for the run (``--dry-run`` notes)."""
        data = [d.problem for d in self.data if d.problem is not None]
        return [p for p in (self.engine_problem, self.model_problem) if p is not None] + data + \
            [why for _, why, _ in self.packages] + \
            [f"rollout server {a} does not answer now (start it with `stapo serve MODEL --port "
             f"{a.rpartition(':')[2]}`)" for a in self.servers_down]

    @property
    def run_problems(self) -> list[str]:
        """What stops ``stapo train`` here before anything is built (the model is checked as it loads)."""
        data = [d.problem for d in self.data if d.problem is not None and offline()]
        return [p for p in (self.engine_problem,) if p is not None] + data + \
            [why for _, why, required in self.packages if required]


def plan_run(cfg: STAPOConfig, world_size: int, *, data: bool = True) -> RunPlan:
    """The run of ``cfg`` on ``world_size`` ranks; ValueError / FileNotFoundError on the first error.
    ``data=False``: the caller brings its own datasets."""
    if world_size < 1:
        raise ValueError(f"the number of ranks must be >= 1, got {world_size}")
    rows = rows_per_rank(cfg, world_size)
    server = cfg.rollout.mode == "server"
    engine = "server" if server else resolve_engine(cfg.rollout.engine)
    tp = cfg.rollout.tensor_parallel_size
    if tp > 1 and not server and (engine != "vllm" or world_size % tp):
        raise ValueError(f"rollout.tensor_parallel_size {tp} needs the vllm engine (this run: {engine}) and a number "
                         f"of ranks it divides (this run: {world_size}): each group of {tp} consecutive ranks "
                         "shares one vLLM engine (docs/gpu.md)")
    source = model_source(cfg.model.path)
    check_writable(cfg.trainer.output_dir)
    _check_lora_targets(cfg, source)
    resume = choose_checkpoint(cfg.trainer.output_dir, cfg.trainer.resume, world_size)
    changes = resume.path and resume_changes(resume.path, cfg.to_dict(), cfg.trainer.resume, cfg.trainer.output_dir)
    if get_rank() == 0:
        warn_skipped(resume)
        if changes:
            log_changes(resume.path, changes, cfg.trainer.resume)
    earlier = resume.path is None and bool(written_artifacts(cfg.trainer.output_dir))
    return RunPlan(world_size, rows, engine, None if server else engine_problem(engine), source,
                   unavailable_reason(source), resume.path, earlier, tuple(check_data(cfg)) if data else (),
                   missing_packages(cfg), resume.skipped, servers_down(cfg), changes or None)


def _check_lora_targets(cfg: STAPOConfig, source: ModelSource) -> None:
    """``model.lora.target_modules`` against the model built on the meta device, when its config is here."""
    if not cfg.model.lora.enabled or source.kind not in (LOCAL, CACHED):
        return
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from stapo.distributed.lora import lora_target_problem

    config = AutoConfig.from_pretrained(source.path, trust_remote_code=cfg.model.trust_remote_code)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=cfg.model.trust_remote_code)
    problem = lora_target_problem(model, cfg.model.lora.target_modules)
    if problem is not None:
        raise ValueError(problem)


# (config says, package, why, required): optional packages a config turns on
_OPTIONAL = (
    (lambda cfg: cfg.model.lora.enabled, "peft",
     "model.lora.enabled needs PEFT: pip install 'stapo[lora]' (or pip install peft)", True),
    (lambda cfg: bool(cfg.logging.wandb_project), "wandb",
     "logging.wandb_project needs wandb (pip install wandb); without it the run logs no W&B", False),
    (lambda cfg: cfg.logging.tensorboard, "tensorboard",
     "logging.tensorboard needs tensorboard (pip install tensorboard); without it the run writes no "
     "TensorBoard scalars (or set logging.tensorboard=false)", False),
)


def servers_down(cfg: STAPOConfig) -> tuple[str, ...]:
    """``rollout.mode=server``: the listed servers that do not answer their health route now (a note only)."""
    if cfg.rollout.mode != "server":
        return ()
    from stapo.servers.client import ServerClient, parse_address

    return tuple(a for a in map(parse_address, cfg.rollout.server.addresses) if not ServerClient(a).healthy(timeout_s=2.0))


def missing_packages(cfg: STAPOConfig) -> tuple[tuple[str, str, bool], ...]:
    """``(package, why, required)`` for every optional package the config turns on and this machine lacks."""
    return tuple((name, why, required) for wanted, name, why, required in _OPTIONAL
                 if wanted(cfg) and not _installed(name))


def _installed(name: str) -> bool:
    try:  # find_spec imports nothing heavy: the package itself is not executed
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def check_writable(output_dir: str | os.PathLike) -> None:
    """ValueError when ``trainer.output_dir`` cannot be created or written (probed in its nearest existing dir)."""
    path = Path(output_dir).expanduser()
    existing = next(p for p in (path, *path.absolute().parents) if p.exists())
    if not existing.is_dir():
        raise ValueError(f"trainer.output_dir {output_dir}: {existing} is a file, not a directory")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".stapo-write-check-", dir=existing))
    except OSError as exc:
        raise ValueError(f"trainer.output_dir {output_dir} cannot be created or written here "
                         f"({exc.strerror or exc} in {existing})") from None


def _output_line(cfg: STAPOConfig, plan: RunPlan) -> str:
    out = cfg.trainer.output_dir
    if plan.resume_from is not None:
        skipped = "".join(f"; {p.name} skipped: {why}" for p, why in plan.resume_skipped)
        changed = plan.changes.experiment + plan.changes.settings if plan.changes else ()
        return (f"output_dir: {out} (resumes from {plan.resume_from}{skipped}"
                + (f"; changed since: {'; '.join(changed)}" if changed else "") + ")")
    if plan.earlier_run:
        return f"output_dir: {out} (a new run; the earlier run's files move to {out}/previous_runs/)"
    return f"output_dir: {out} (a new run)"


def _micro_batch_line(cfg: STAPOConfig, plan: RunPlan) -> str:
    t, longest = cfg.trainer, cfg.data.max_prompt_length + cfg.rollout.max_response_length
    if not t.max_tokens_per_micro_batch:
        count = math.ceil(plan.rows_per_rank / t.micro_batch_size)
        return f"micro-batches per mini-batch and rank: {count} of <= {t.micro_batch_size} rows"
    line = f"micro-batches: <= {t.max_tokens_per_micro_batch:,} tokens each (a row holds <= {longest:,})"
    if longest > t.max_tokens_per_micro_batch:
        line += "; rows longer than the budget get a micro-batch of their own"
    return line


def _rollout_line(cfg: STAPOConfig, plan: RunPlan) -> str:
    r = cfg.rollout
    if r.mode != "server":
        engine = r.engine + (f" -> {plan.engine}" if plan.engine != r.engine else "")
        return f"rollout: colocated, engine {engine}" + (f", tensor parallel {r.tensor_parallel_size}"
                                                         if r.tensor_parallel_size > 1 else "")
    lag = (f"asynchronous, max_staleness {r.max_staleness}" + (", partial rollouts" if r.partial else "")
           if r.max_staleness else "lock-step (max_staleness 0)")
    s = r.server
    return f"rollout: server mode, {len(s.addresses)} server(s) {', '.join(s.addresses)}; {lag}; weight sync {s.sync}"


def _method_lines(cfg: STAPOConfig, plan: RunPlan) -> list[str]:
    lo, op, lora, tools = cfg.loss, cfg.optim, cfg.model.lora, cfg.rollout.tools
    adapters = (f"LoRA rank {lora.rank}, alpha {lora.alpha:g} on {', '.join(lora.target_modules)}" if lora.enabled
                else "full fine-tuning (no LoRA)")
    used = ", ".join(f"{n} ({', '.join(f'{k}={v!r}' for k, v in tools.settings_of(n)[0].items())})"
                     for n in tools.names) if tools.enabled else ""
    return [
        f"model.path: {cfg.model.path} ({plan.model.describe()}); {adapters}",
        f"tools: {used}; parser {tools.parser}, <= {tools.max_turns} turns" if tools.enabled else "tools: off",
        f"optimizer: AdamW lr {op.lr:g} (warm-up {op.warmup_steps} steps), clip ratio to "
        f"[{1 - lo.clip_low:g}, {1 + lo.clip_high:g}]" + (f", dual clip {lo.clip_c:g}" if lo.clip_c else ""),
        f"KL to the initial policy: k3 x {lo.kl_coef:g}" if lo.kl_coef else "KL: off (loss.kl_coef=0, no reference model)",
    ]


def _attention_line(cfg: STAPOConfig) -> str:
    requested = cfg.model.attn_implementation
    try:
        chosen = attention(cfg)
    except ValueError as exc:  # e.g. flex_attention on a CPU-only machine: the run stops with this line
        return f"model.attn_implementation: {requested} (not on this machine: {exc})"
    return f"model.attn_implementation: {requested}" + (f" -> {chosen} on this machine" if chosen != requested else "")


def summary_lines(cfg: STAPOConfig, plan: RunPlan) -> list[str]:
    """What ``stapo train --dry-run`` prints first: the run's size and what defines it."""
    t, r = cfg.trainer, cfg.rollout
    responses = t.train_batch_size * r.group_size
    longest = cfg.data.max_prompt_length + r.max_response_length
    rounds = r.max_sampling_rounds if r.dynamic_sampling else 1
    mask = build_mask(cfg.mask.name, **cfg.mask.params)
    params = ", ".join(f"{k}={getattr(mask, k)!r}" for k in mask_params(cfg.mask.name)) or "no parameters"
    lines = [
        f"ranks: {plan.world_size}   steps: {t.total_steps}   optimizer steps: "
        f"{t.total_steps * cfg.num_mini_batches:,} ({cfg.num_mini_batches} per step)",
        f"rollouts per step: {t.train_batch_size} prompts x G={r.group_size} = {responses:,} responses "
        f"(per rank: {t.train_batch_size // plan.world_size} prompts, {responses // plan.world_size:,} responses)"
        + (f"; dynamic sampling: up to {rounds} rounds" if r.dynamic_sampling else ""),
        f"mini-batch per rank: {plan.rows_per_rank} rows; " + _micro_batch_line(cfg, plan),
        f"tokens per step, upper bound: {responses:,} x {longest:,} = {responses * longest:,} "
        f"(generated: <= {responses * r.max_response_length * rounds:,})",
        *_method_lines(cfg, plan),
        _rollout_line(cfg, plan),
        _attention_line(cfg),
        f"reward: {'reward.function ' + cfg.reward.function if cfg.reward.function else cfg.reward.mode}",
        f"mask: {cfg.mask.name} ({params})",
        correction_line(cfg),
        *(f"{d.setting}: {d.source} ({d.describe()})" for d in plan.data),
        _output_line(cfg, plan),
    ]
    lines += [f"not on this machine: {problem}" for problem in plan.machine_problems]
    return lines
