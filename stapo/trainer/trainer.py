"""``STAPOTrainer``: paper Algorithm 1 on DeepSpeed ZeRO-3 with a rollout engine; the step reads as the
algorithm box (docs/algorithm.md, "Algorithm 1, line by line"; launchers: docs/distributed.md, "Launch")."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from stapo.config import STAPOConfig
from stapo.losses import (TokenMask, TokenStats, build_mask, group_advantages, mismatch_sums, registered_name,
                          spurious_probe, truncated_keep, truncated_rows)
from stapo.rollout import Rollout
from stapo.servers.pool import NoRolloutServers
from stapo.trainer import components as build, tool_setup
from stapo.run_dir import CONFIG_FILE, CURVES_FILE, FINAL_DIR, METRICS_FILE, read_metrics
from stapo.trainer.checkpoint import CheckpointManager, archive_previous_run, export_final
from stapo.trainer.interrupt import RunInterrupted, stop_on_signals
from stapo.distributed.process_group import all_gather_object, barrier, broadcast_object, init_distributed
from stapo.distributed.shared_dir import require_shared_dir
from stapo.distributed.training_offload import offloaded
from stapo.telemetry.metrics import MetricsLogger
from stapo.trainer.preflight import plan_run
from stapo.trainer.recording import TokenRecorder
from stapo.trainer.recovery import Recovery, restore
from stapo.distributed.deepspeed_engine import current_lr
from stapo.distributed.lora import reference_scope
from stapo.distributed.zero3_trace import REFERENCE
from stapo.trainer.rollouts import Rollouts
from stapo.trainer.server_setup import prompt_length_limit
from stapo.telemetry.mfu import device_peak_flops
from stapo.telemetry.step_metrics import (PhaseTimer, StepSums, evaluation_metrics, mask_sums, sample_completions,
                                        skipped_updates, stats_counts, step_metrics, token_counts)
from stapo.trainer.update import TrainBatch, policy_stats, rollout_entropy, update_minibatch

log = logging.getLogger("stapo.trainer")


class TrainingAborted(RuntimeError):
    """Too many consecutive steps had a non-finite loss or gradient norm."""


class STAPOTrainer:
    """Spurious-Token-Aware Policy Optimization (and its baselines, via ``mask``). ``reward_fn``
    ``(response, ground_truth) -> float`` replaces the verifier; ``mask`` (a TokenMask) overrides ``config.mask``;
    the datasets (PromptDataset, HF dataset or list of dicts) override ``config.data``."""

    def __init__(self, config: STAPOConfig, *, reward_fn=None, mask: TokenMask | None = None,
                 train_dataset=None, eval_dataset=None):
        self.config = cfg = config
        self.dist = init_distributed(timeout=build.collective_timeout(cfg))
        # before anything reads or writes it: one output_dir that every node sees, or a clear stop on all
        self.output_dir = require_shared_dir(cfg.trainer.output_dir, name="trainer.output_dir")
        plan = plan_run(cfg, self.dist.world_size, data=train_dataset is None)  # as `stapo train --dry-run`
        if plan.run_problems:
            raise ValueError(plan.run_problems[0])
        self.score, self._close_scorer = build.build_scorer(cfg, reward_fn)  # imports reward.function
        resume_from = broadcast_object(plan.resume_from)  # rank 0's pick: every rank resumes the same step
        if resume_from is None:
            self._set_aside_previous_run(cfg.trainer.resume)
        self.model_path = build.resolve_model_path(cfg, self.dist)
        self.tokenizer = build.load_tokenizer(self.model_path, cfg)
        self.engine = build.build_deepspeed(build.build_policy(self.model_path, cfg), cfg, self.dist.world_size)
        self.model = self.engine.module  # a PeftModel with model.lora (stapo/distributed/lora.py)
        self.reference = build.build_reference(cfg, self.model_path, self.model)  # None unless loss.kl_coef > 0
        self.peak_flops = device_peak_flops(torch.cuda.get_device_name() if torch.cuda.is_available() else None)
        self.training_offload = build.build_training_offload(cfg, self.engine)  # None unless configured
        with offloaded(self.training_offload):  # vLLM sizes its memory share against what is free at start
            self.rollout_engine = build.build_rollout_engine(cfg, self.model_path, self.tokenizer, self.dist.rank)
        self.mask = mask if mask is not None else build_mask(cfg.mask.name, **cfg.mask.params)
        self.spurious_probe = spurious_probe(self.mask)  # S2T criterion as a diagnostic, whatever the mask
        self.reward_terms = build.build_reward_terms(cfg)  # added to the scores: overlong, tool shaping
        episodes = tool_setup.tool_episodes(cfg, self.tokenizer)  # None unless rollout.tools
        self.control_ids = tool_setup.control_token_ids(episodes)  # tool format's tags (health)
        longest_prompt = prompt_length_limit(cfg, self.rollout_engine)  # servers may hold fewer tokens
        self.train_data, self.eval_data = build.main_rank_first(  # rank 0 fills the datasets cache first
            self.dist, lambda: build.build_datasets(cfg, self.tokenizer, train_dataset, eval_dataset, longest_prompt))
        self.eval_data_without_tools = build.build_eval_without_tools(cfg, self.tokenizer, eval_dataset,
                                                                      longest_prompt)
        from stapo.data import PromptSampler

        self.sampler = PromptSampler(len(self.train_data), cfg.trainer.train_batch_size, seed=cfg.trainer.seed)
        self.opts = build.update_options(cfg)
        self.correction = build.build_correction(cfg)  # off-policy: IS weights / rejection (a no-op when off)
        log.info(build.correction_line(cfg))
        self.checkpoints = CheckpointManager(self.output_dir, keep_last=cfg.trainer.keep_last,
                                             exclude_frozen=cfg.model.lora.enabled)
        self.logger = MetricsLogger(
            self.output_dir, is_main=self.dist.is_main, tensorboard=cfg.logging.tensorboard,
            wandb={"project": cfg.logging.wandb_project, "config": cfg.to_dict()} if cfg.logging.wandb_project else None,
            total_steps=cfg.trainer.total_steps, progress=cfg.logging.progress,
        )
        self.recorder = TokenRecorder(self.output_dir, every=cfg.inspect.record_every, is_main=self.dist.is_main,
                                      all_minibatches=cfg.inspect.record_minibatches == "all")
        self.rollouts = Rollouts(cfg, self.dist, self.rollout_engine, self.model, self.sampler, self.train_data,
                                 self.score, self.reward_terms, training_offload=self.training_offload,
                                 tools=episodes)  # lines 3-5: prompts, generation, rewards, sync
        self.health = Recovery(self, build.build_health(cfg))  # monitors and health.on_alarm (docs/health.md)
        self.step_count = 0
        self.skipped_steps = 0
        self._consecutive_skips = 0
        if self.dist.is_main:
            cfg.to_yaml(self.output_dir / CONFIG_FILE)
        if resume_from is not None:
            self._resume(resume_from)
        elif cfg.rollout.mode == "server":
            self.rollouts.sync(self.step_count)  # servers hold whatever they started with: give them this policy
        self.rollouts.start_producer(self.step_count)  # rollout.max_staleness >= 1 only

    # ---- Algorithm 1 ------------------------------------------------------------------------
    def step(self) -> dict[str, float]:
        """One training iteration (Algorithm 1 lines 3-13); returns the step's metrics."""
        cfg, timer = self.config, PhaseTimer()
        scored = self.rollouts.scored(self.step_count, timer)  # lines 4-5: x ~ D, G responses, rewards
        rollout, rewards = scored.rollout, scored.rewards
        advantages = group_advantages(  # line 5, Eq. 2
            rewards, cfg.rollout.group_size, scale=cfg.loss.advantage_scale, eps=cfg.loss.advantage_eps)
        with timer("stats"):
            batch = self._train_batch(rollout, advantages)  # theta_old's logprobs and entropy (line 8)
        sums = StepSums()
        for key, value in {**scored.sums, **token_counts(rollout, no_grad_passes=1 + (self.reference is not None)),
                           **mismatch_sums(batch.sampling_logprobs, batch.old_logprobs, batch.response_mask)}.items():
            sums.add_value(key, value)  # rewards', token counts and rollout-vs-trainer sums
        batch_entropy = rollout_entropy(batch)
        self.mask.start_step(batch_entropy)  # a weighting mask's schedule (STARE's gate and W/M)
        for k, rows in enumerate(self._mini_batches(len(batch))):  # line 6
            mini = batch.rows(rows)
            with timer("stats"):
                stats = self._mask_stats(mini, first=k == 0, batch_entropy=batch_entropy, seed=self._mask_seed(k))
            if k > 0 and cfg.mask.stats_source == "fresh":
                for key, value in stats_counts(mini).items():
                    sums.add_value(key, value)
            masked = self.mask.apply(stats)  # lines 9-10: the S2T mask (or a baseline's)
            probe = self.spurious_probe.apply(stats)  # diagnostic: the S2T criterion, whatever the mask
            corrected = self.correction(mini.sampling_logprobs, mini.old_logprobs, mini.trainable)  # vs the sampler
            self._observe(k, mini, stats, masked, probe, rollout, rewards, rows, corrected.rejected)
            with timer("update"):  # lines 11-12: Eq. 1 over kept tokens, optimizer step
                update_sums = update_minibatch(self.engine, self.model, mini, masked.keep, self.opts,
                                               weights=masked.weights, correction=corrected)
            sums.add({**update_sums, **mask_sums(stats, masked, probe), **corrected.sums})
        self.step_count += 1
        self._track_skips(skipped_updates(sums))

        def metrics() -> dict[str, float]:  # after the sync, or without it when the sync fails
            return step_metrics(step=self.step_count, epoch=scored.epoch, lr=current_lr(self.engine),
                                skipped_steps=self.skipped_steps, group_size=cfg.rollout.group_size,
                                world_size=self.dist.world_size, scored=scored, sums=sums, timer=timer,
                                entropy_coef=cfg.loss.entropy_coef, model_config=self.model.config,
                                peak_flops=self.peak_flops, control_ids=self.control_ids)
        server = dict(server=cfg.rollout.mode == "server", delta=cfg.rollout.server.sync == "delta")
        try:
            with timer("sync"):
                synced = self.rollouts.sync(self.step_count)  # line 3, for the next iteration
        except NoRolloutServers as err:  # the update happened and the stop checkpoint keeps it: so does the log
            sums.add_sync(None, **server)
            err.step_metrics = metrics()
            raise
        sums.add_sync(synced, **server)
        return metrics()

    def _train_batch(self, rollout: Rollout, advantages: torch.Tensor) -> TrainBatch:
        """The iteration's rows with theta_old's stats (and the reference's logprobs when ``loss.kl_coef > 0``)."""
        old_logprobs, old_entropy = policy_stats(self.model, rollout, self.opts)
        ref_logprobs = None
        if self.reference is not None:  # LoRA: the policy itself, adapters disabled
            with reference_scope(self.reference) as reference:
                ref_logprobs = policy_stats(reference, rollout, self.opts, trace=REFERENCE)[0]
        loss_mask = None  # loss.mask_truncated: responses cut at max_response_length leave the loss
        if self.config.loss.mask_truncated:
            loss_mask = truncated_keep(rollout.response_mask, truncated_rows(rollout.finish_reason))
        return TrainBatch(rollout.prompt_ids, rollout.prompt_mask, rollout.response_ids, rollout.response_mask,
                          advantages, old_logprobs, old_entropy, sampling_logprobs=rollout.sampling_logprobs,
                          ref_logprobs=ref_logprobs, loss_mask=loss_mask, context_mask=rollout.context_mask)

    def _mask_stats(self, mini: TrainBatch, first: bool, batch_entropy: float, seed: int) -> TokenStats:
        """Exact for the first mini-batch (theta = theta_old); later ones: a fresh pass (``mask.stats_source``)."""
        if first or self.config.mask.stats_source == "old":
            logprobs, entropy = mini.old_logprobs, mini.old_entropy
        else:
            logprobs, entropy = policy_stats(self.model, mini, self.opts)
        return TokenStats(logprobs, entropy, mini.advantages, mini.trainable,  # truncated rows: padding
                          old_logprobs=mini.old_logprobs, clip_range=(self.opts.clip_low, self.opts.clip_high),
                          batch_entropy=batch_entropy, seed=seed)

    def _mask_seed(self, k: int) -> int:
        """Mini-batch ``k``'s seed (clip_cov): per (run, step, mini-batch), equal on all ranks: resumes stay exact."""
        return (self.config.trainer.seed * 1_000_003 + self.step_count * 1_009 + k * 7_919 + 104_729) % 2**31

    def _mini_batches(self, num_rows: int) -> list[slice]:
        size = build.rows_per_rank(self.config, self.dist.world_size)
        return [slice(s, min(s + size, num_rows)) for s in range(0, num_rows, size)]

    # ---- evaluation -------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Greedy accuracy on the held-out set (each rank scores its share)."""
        if self.eval_data is None:
            return {}
        metrics = self._evaluate_on(self.eval_data, "eval_")
        if self.eval_data_without_tools is not None:  # rollout.tools.eval_without_tools: one turn, no tools
            metrics.update(self._evaluate_on(self.eval_data_without_tools, "eval_no_tools_", plain=True))
        return metrics

    def _evaluate_on(self, data, prefix: str, plain: bool = False) -> dict[str, float]:
        examples = [data[i] for i in range(self.dist.rank, len(data), self.dist.world_size)]
        rollout = self.rollouts.generate(examples, self.step_count, greedy=True, plain=plain)
        rewards = self.score(rollout.answer_text, rollout.ground_truth, [dict(e.fields) for e in examples])
        calls = None if rollout.episodes is None else rollout.episodes.tool_calls.tolist()
        return evaluation_metrics(rewards, rollout.response_mask.sum(dim=1).tolist(), tool_calls=calls,
                                  prefix=prefix)

    # ---- the loop ---------------------------------------------------------------------------
    def train(self) -> dict[str, float]:
        """Run to ``trainer.total_steps``; returns a summary. Signals stop at a step boundary (trainer.interrupt)."""
        cfg, start, first_step = self.config, time.perf_counter(), self.step_count
        before = self.evaluate() if self.step_count == 0 else self._logged_evaluation(0)
        if before and self.step_count == 0:
            self.logger.log(0, before)
        try:
            with stop_on_signals() as stop:
                while self.step_count < cfg.trainer.total_steps:
                    self._stop_if_asked(stop)
                    metrics = self.step()
                    if cfg.trainer.eval_every and self.step_count % cfg.trainer.eval_every == 0:
                        metrics.update(self.evaluate())
                    alarms = self.health.observe(metrics)  # the monitors' statistics join the row
                    self.logger.log(self.step_count, metrics)
                    saved = bool(alarms) and self.health.respond(alarms)  # warn / stop / rollback
                    if not saved and cfg.trainer.save_every and self.step_count % cfg.trainer.save_every == 0:
                        self.save_checkpoint()
                self._stop_if_asked(stop)
        except NoRolloutServers as err:
            if getattr(err, "step_metrics", None):  # the servers went between this step's update and its sync
                self.logger.log(self.step_count, err.step_metrics)
            log.error("%s; saving a checkpoint at step %d before stopping (restart a server and rerun: the run "
                      "resumes)", err, self.step_count)
            self.save_checkpoint()
            raise
        finally:
            self.rollouts.close()
        after = self.evaluate()
        if after:
            self.logger.log(self.step_count, after)
        self.save_checkpoint()
        return self._finish(before, after, time.perf_counter() - start, self.step_count - first_step)

    def _stop_if_asked(self, stop) -> None:
        """At a step boundary: when any rank got Ctrl-C / SIGTERM, all save a checkpoint and stop."""
        name = stop.agreed(all_gather_object) if self.dist.world_size > 1 else stop.signal_name
        if name is None:
            return
        saved = None
        if self.step_count > 0:
            log.warning("%s at step %d: saving a checkpoint before exiting", name, self.step_count)
            saved = self.save_checkpoint()
        self.logger.close()
        self._close_scorer()
        raise RunInterrupted(name, self.step_count, saved)

    def _logged_evaluation(self, step: int) -> dict[str, float]:
        """A resumed run's evaluation at ``step`` from metrics.jsonl (the summary's "before")."""
        rows = read_metrics(self.output_dir / METRICS_FILE) if self.dist.is_main else []
        return next(({k: v for k, v in r.items() if k.startswith("eval_")} for r in rows
                     if r.get("step") == step and "eval_accuracy" in r), {})

    def _finish(self, before: dict, after: dict, seconds: float, session_steps: int) -> dict[str, float]:
        from stapo.plots import plot_training_curves
        if self.config.trainer.export_hf:
            export_final(self.engine, self.tokenizer, self.output_dir / FINAL_DIR,
                         merged=self.config.model.lora.export_merged)
        if self.dist.is_main and self.config.logging.plot:
            plot_training_curves(self.output_dir / METRICS_FILE, self.output_dir / CURVES_FILE)
        main = self.dist.is_main  # metrics.jsonl is rank 0's file: rank 0 reads it and broadcasts the summary
        rows = [r for r in read_metrics(self.output_dir / METRICS_FILE) if "silenced_frac" in r] if main else []
        summary = {
            "steps": self.step_count,
            "session_steps": session_steps,  # this process's steps: fewer than ``steps`` after a resume
            "accuracy_before": before.get("eval_accuracy", float("nan")),
            "accuracy_after": after.get("eval_accuracy", float("nan")),
            "silenced_frac_mean": sum(r["silenced_frac"] for r in rows) / max(len(rows), 1),
            "spurious_frac_mean": sum(r["spurious_frac"] for r in rows) / max(len(rows), 1),
            "seconds": seconds,
        }
        summary = broadcast_object(summary)
        self.logger.close()
        self._close_scorer()
        return summary

    def _observe(self, k, mini, stats, masked, probe, rollout, rewards, rows, rejected) -> None:
        """Sample completions and token records of mini-batch ``k`` when due; BEFORE its update, so the
        recorder's top-k alternatives come from the same theta_old as p, H and A."""
        step, every = self.step_count + 1, self.config.logging.log_samples_every
        log_samples = k == 0 and every and step % every == 0
        record = self.recorder.due(step, k)
        if not (log_samples or record):
            return
        rollout, rewards = rollout.select(rows), rewards[rows]
        if log_samples:
            self.logger.log_samples(step, sample_completions(rollout, rewards, masked.silenced, self.tokenizer))
        if record:
            thresholds = {"tau_p": self.spurious_probe.tau_p, **probe.thresholds, **masked.thresholds}
            self.recorder.record(step, k, self.model, mini, stats, masked, thresholds, rollout, rewards,
                                 self.tokenizer, registered_name(self.mask) or type(self.mask).__name__, self.opts,
                                 rejected=rejected)

    def _track_skips(self, skipped_updates: int) -> None:
        """The one place that counts skipped steps (and aborts after too many in a row)."""
        skipped = skipped_updates > 0
        self.skipped_steps += int(skipped)
        self._consecutive_skips = self._consecutive_skips + 1 if skipped else 0
        if skipped:
            log.warning("step %d: non-finite loss or grad norm, update skipped (%d in a row)",
                        self.step_count, self._consecutive_skips)
        if self._consecutive_skips >= self.config.trainer.max_consecutive_skips:
            raise TrainingAborted(f"{self._consecutive_skips} consecutive steps had a non-finite loss or "
                                  f"gradient norm (trainer.max_consecutive_skips); last step {self.step_count}")

    # ---- checkpoints ------------------------------------------------------------------------
    def save_checkpoint(self) -> Path:
        sampler, ahead = self.rollouts.resume_state(self.step_count)  # async: later batches are regenerated
        self.health.watch.checkpoint_saved(self.step_count)  # a rollback candidate when no monitor has a streak
        state = {
            "step": self.step_count,
            "skipped_steps": self.skipped_steps,
            "sampler": sampler,  # RNG states of every rank are saved by the manager
            "rollouts_ahead": ahead,
            "mask": self.mask.state_dict(),  # a weighting mask's schedule (STARE's W, M and gate)
            "health": self.health.watch.state_dict(),
            "config": self.config.to_dict(),
        }
        return self.checkpoints.save(self.engine, self.step_count, state, protect=self.health.watch.protected())

    def _set_aside_previous_run(self, how: str) -> None:
        """A run starting from scratch never appends to, or overwrites, an earlier run's files."""
        if self.dist.is_main:
            archive = archive_previous_run(self.output_dir)
            if archive is not None:
                log.warning("%s held an earlier run (trainer.resume=%s): moved its files to %s",
                            self.output_dir, how, archive)
        barrier()

    def _resume(self, path: Path) -> None:
        state = restore(self, path, rng=True)
        self.step_count, self.skipped_steps = int(state["step"]), int(state.get("skipped_steps", 0))
        self.sampler.load_state_dict(state["sampler"])
        self.health.watch.load_state_dict(state.get("health"))
        self.logger.truncate_after(self.step_count)
        self.rollouts.sync(self.step_count)
        log.info("resumed from %s at step %d", path, self.step_count)
        if state.get("rollouts_ahead"):
            log.info("%d rollout batches generated ahead of step %d before the restart are regenerated",
                     state["rollouts_ahead"], self.step_count)
