"""Algorithm 1 lines 3-5 on one rank: the weight sync, the prompts, their G responses and rewards.

Generation is seeded per (run, iteration, rank, dynamic-sampling round), so a resumed run regenerates the same
rows. A failed sync or a rank without servers is decided for ALL ranks by one collective, so they stop together.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

from stapo.config import STAPOConfig
from stapo.data import PromptSampler, balanced_shares
from stapo.distributed.process_group import DistInfo, all_gather_object, barrier, broadcast_object
from stapo.distributed.training_offload import offloaded
from stapo.rewards import RewardTerm
from stapo.rollout import Generation, Rollout, RolloutEngine, SamplingParams, ToolEpisodes
from stapo.servers.pool import NoRolloutServers
from stapo.sync.buckets import SyncStats, sync_weights
from stapo.trainer.producer import ProducedBatch, RolloutProducer
from stapo.trainer.scored_rollout import ScoredRollout, collect_scored_rollout, score_rollout

__all__ = ["Rollouts"]

T = TypeVar("T")
log = logging.getLogger("stapo.trainer")


class Rollouts:
    """This rank's rollouts: ``engine`` fed from ``model``; ``tools``: every row is a tool episode (None: one turn)."""

    def __init__(self, cfg: STAPOConfig, dist: DistInfo, engine: RolloutEngine, model, sampler: PromptSampler,
                 train_data, score, reward_terms: Sequence[RewardTerm], training_offload=None,
                 tools: ToolEpisodes | None = None) -> None:
        self.cfg, self.dist, self.engine, self.model, self.tools = cfg, dist, engine, model, tools
        self.training_offload = training_offload  # rollout.offload_training_state: ZeRO state aside while generating
        self.sampler, self.train_data, self.score, self.reward_terms = sampler, train_data, score, reward_terms
        self.server = cfg.rollout.mode == "server"
        self.producer: RolloutProducer | None = None
        self._under_way = None  # the producer's batch a sync cut: (index, examples, Generation, epoch, start)

    def start_producer(self, step: int) -> None:
        """Asynchronous training from iteration ``step`` on (the servers hold version ``step``)."""
        r = self.cfg.rollout
        if r.max_staleness > 0:
            cut = dict(interrupt=self.engine.interrupt, resume=self.engine.resume) if self.engine.interruptible else {}
            self.producer = RolloutProducer(self._produce, self.sampler.state_dict, max_staleness=r.max_staleness,
                                            first_index=step, version=step, stop_index=self.cfg.trainer.total_steps,
                                            close_timeout_s=r.producer_close_timeout_s, **cut)

    def close(self) -> None:
        if self.producer is not None:
            self.producer.close()
        self.engine.close()

    # ---- lines 4-5 ----------------------------------------------------------------------------
    def scored(self, step: int, timer) -> ScoredRollout:
        """Iteration ``step``'s scored rows (asynchronous: from the producer)."""
        r, t, world = self.cfg.rollout, self.cfg.trainer, self.dist.world_size
        if self.producer is not None:
            with timer("rollout"):  # the trainer's wait: generation itself ran during earlier updates
                produced = self._agreed(lambda: self.producer.take(step))
            with timer("reward"):
                scored = score_rollout(self.score, produced.rollout, produced.examples, self.reward_terms)
            return self._with_server_metrics(scored, step, produced.epoch, produced.seconds, produced.interrupted)
        start = time.perf_counter()
        scored = collect_scored_rollout(
            self.next_prompts, lambda examples, round_index: self.generate(examples, step, round_index=round_index),
            self.score, self.reward_terms, timer, group_size=r.group_size, dynamic=r.dynamic_sampling,
            target_groups=t.train_batch_size // world, max_rounds=r.max_sampling_rounds,
            multiple_of=t.mini_batch_size // world, gather=all_gather_object)
        return self._with_server_metrics(scored, step, self.sampler.epoch, time.perf_counter() - start)

    def _with_server_metrics(self, scored: ScoredRollout, step: int, epoch: int, generation_s: float,
                             interrupted: int = 0) -> ScoredRollout:
        """The draw's epoch and, in server mode, the tokens' staleness, generation time and segments a sync cut."""
        sampling = dict(scored.sampling)
        versions = scored.rollout.token_version
        if self.server and versions is not None and len(versions):
            mask = scored.rollout.response_mask
            lag = (step - versions)[mask].double()
            oldest = step - int(scored.rollout.policy_version.min())
            gathered = all_gather_object((max(oldest, int(lag.max()) if lag.numel() else 0), float(lag.sum()),
                                          int(lag.numel()), generation_s, interrupted))
            tokens = sum(g[2] for g in gathered)
            sampling["policy_staleness"] = float(max(g[0] for g in gathered))
            sampling["policy_staleness_mean"] = sum(g[1] for g in gathered) / tokens if tokens else 0.0
            sampling["generation_s"] = max(g[3] for g in gathered)
            if self.cfg.rollout.partial:
                sampling["partial_interrupted"] = float(sum(g[4] for g in gathered))
        return dataclasses.replace(scored, sampling=sampling, epoch=epoch)

    def _produce(self, index: int, version: int) -> ProducedBatch | None:
        """The producer's work (its thread; no collective): batch ``index`` with policy ``version``; None when
        a sync cut it, and the next call goes on with it."""
        if self._under_way is None or self._under_way[0] != index:
            examples = self.next_prompts()
            generation = Generation([e.prompt_ids for e in examples], self.cfg.rollout.group_size,
                                    self.sampling(index), tools=self.tools)
            self._under_way = (index, examples, generation, self.sampler.epoch, time.perf_counter())
        _, examples, generation, epoch, start = self._under_way
        if not self._advance(generation):
            log.info("batch %d: a weight sync cut %d response(s) under way (%d finished); they go on with the new "
                     "weights", index, generation.unfinished(), len(generation.trajectories) - generation.unfinished())
            return None
        self._under_way = None
        rollout = self._rollout(generation, examples, version)
        return ProducedBatch(index, examples, rollout, int(rollout.policy_version.min()), epoch,
                             time.perf_counter() - start, interrupted=generation.interrupted)

    def next_prompts(self) -> list:
        """This rank's share of the global batch, balanced by prompt tokens (the same deal on every rank)."""
        indices = self.sampler.next_batch()
        indices = indices[:len(indices) - len(indices) % self.dist.world_size]
        shares = balanced_shares([len(self.train_data[i].prompt_ids) for i in indices], self.dist.world_size)
        return [self.train_data[indices[j]] for j in shares[self.dist.rank]]

    def sampling(self, step: int, greedy: bool = False, round_index: int = 0) -> SamplingParams:
        r, t = self.cfg.rollout, self.cfg.trainer
        # a seed per (run, step, rank, dynamic-sampling round): resumed runs regenerate the same responses
        seed = (t.seed * 1_000_003 + step * 1_009 + self.dist.rank + round_index * 7_919) % 2**31
        return SamplingParams(temperature=0.0 if greedy else r.temperature, top_p=1.0 if greedy else r.top_p,
                              top_k=-1 if greedy else r.top_k, max_new_tokens=r.max_response_length, seed=seed)

    def generate(self, examples: list, step: int, greedy: bool = False, round_index: int = 0,
                 plain: bool = False) -> Rollout:
        """Rows for ``examples`` on the trainer's thread (`_agreed`); ``plain``: one turn each, without the tools."""
        return self._agreed(lambda: self._generate(examples, step, greedy, round_index, plain=plain))

    def _agreed(self, work: Callable[[], T]) -> T:
        """``work()``, then, in server mode, one collective: when any rank ran out of servers, every rank raises."""
        if not self.server:
            return work()
        result, lost = None, None
        try:
            result = work()
        except NoRolloutServers as err:
            lost = f"rank {self.dist.rank}: {err}"
        lost_anywhere = [x for x in all_gather_object(lost) if x is not None]
        if lost_anywhere:
            raise NoRolloutServers(lost_anywhere[0])
        return result

    def _generate(self, examples: list, step: int, greedy: bool = False, round_index: int = 0,
                  plain: bool = False) -> Rollout:
        """Rows for ``examples`` with iteration ``step``'s seed and (unless the engine says) policy version."""
        generation = Generation([e.prompt_ids for e in examples], 1 if greedy else self.cfg.rollout.group_size,
                                self.sampling(step, greedy, round_index), tools=None if plain else self.tools)
        if not self._advance(generation):
            raise RuntimeError("the rollout engine was interrupted outside the producer")
        return self._rollout(generation, examples, step)

    def _advance(self, generation: Generation) -> bool:
        """``generation``'s segments on the engine until done (True) or cut by a sync (False)."""
        if self.engine.needs_weights:  # rollout.sleep_level 2 discarded them
            sync_weights(self.model, self.engine, self.cfg.rollout.sync_bucket_mb * 2**20)
        with offloaded(self.training_offload):  # after any sync: that gathers from the ZeRO shards
            self.engine.wake()
            done = generation.advance(self.engine)
            self.engine.sleep()
        return done

    def _rollout(self, generation: Generation, examples: list, version: int) -> Rollout:
        """The finished rows with answers, prompts and every token's policy version (default ``version``)."""
        rollout = generation.rollout(self.engine.pad_token_id)
        if rollout.policy_version is None:
            rollout = rollout.with_policy_version(version)
        return rollout.with_ground_truth([e.ground_truth for e in examples]).with_prompt_text(
            [e.prompt_text for e in examples])

    # ---- line 3 -------------------------------------------------------------------------------
    def sync(self, version: int) -> SyncStats:
        """theta_old <- theta into the rollout engine, which then holds policy ``version``; no rank generates
        before (nor, asynchronous, during) the sync."""
        if not self.server:
            return sync_weights(self.model, self.engine, self.cfg.rollout.sync_bucket_mb * 2**20)
        attempts = self.cfg.rollout.server.sync_retries + 1
        for attempt in range(1, attempts + 1):
            cut = self.engine.interruptible  # rollout.partial: the batch under way is cut, not waited for
            with self.producer.paused(interrupt=cut) if self.producer is not None else contextlib.nullcontext():
                if self.producer is not None:
                    barrier()  # every rank's producer is idle before rank 0 opens the servers' session
                synced = sync_weights(self.model, self.engine, self.cfg.rollout.sync_bucket_mb * 2**20, version=version)
                outcome = broadcast_object(self.engine.last_sync)  # rank 0's: every rank decides the same
                if outcome.ok:
                    if self.producer is not None:  # under the engine lock: no batch reads the old version after
                        self.producer.advance(version)
                    return synced
            if self.dist.is_main:
                log.warning("weight sync %d of %d into the rollout servers failed: %s%s", attempt, attempts,
                            outcome.error, f"; retrying with the {outcome.live} server(s) left"
                            if outcome.live and attempt < attempts else "")
            if not outcome.live:
                break
        left = "" if outcome.live else "no rollout server is left: "
        raise NoRolloutServers(f"{left}the weight sync into the rollout servers failed {attempt} time(s): "
                               f"{outcome.error}")

    def resume_state(self, step: int) -> tuple[dict, int]:
        """``(prompt sampler state to resume iteration step from, batches generated ahead of it)``."""
        if self.producer is None:
            return self.sampler.state_dict(), 0
        with self.producer.paused():  # the draw of the first batch not trained yet; later ones are regenerated
            return self.producer.resume_state(step)
