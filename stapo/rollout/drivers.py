"""The drivers: rollouts as sequences of segments on any `RolloutEngine` (docs/rollout.md, "Segments and drivers").

Tool turns and weight syncs both separate a sample's segments, so a tool episode cut by a sync continues exactly.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from stapo.rollout.batch import EpisodeInfo, Rollout, left_pad, right_pad
from stapo.rollout.engine import RolloutEngine
from stapo.rollout.episodes import ToolEpisodes
from stapo.rollout.sampling import SamplingParams
from stapo.rollout.trajectory import Trajectory, prompt_seeds

__all__ = ["Generation", "check_prompts", "generate"]


def check_prompts(prompt_ids: Sequence[Sequence[int]], n: int) -> list[list[int]]:
    """Validate a driver's inputs; returns the prompts as plain int lists."""
    if n < 1:
        raise ValueError(f"n (samples per prompt) must be >= 1, got {n}")
    try:
        prompts = [[int(t) for t in p] for p in prompt_ids]
    except (TypeError, ValueError) as err:
        raise TypeError("prompt_ids must be a sequence of token-id sequences (not text, not a tokenizer "
                        f"BatchEncoding): {err}") from err
    if not prompts:
        raise ValueError("generate() got no prompts")
    empty = [i for i, p in enumerate(prompts) if not p]
    if empty:
        raise ValueError(f"prompts {empty[:10]} are empty; every prompt needs at least one token")
    return prompts


class Generation:
    """``n`` samples of each prompt under way (row ``p * n + k``: prompt p, sample k). ``sampling.max_new_tokens``
    is each sample's budget (an episode's policy and context tokens); ``tools``: tool episodes (None: one turn);
    ``seeds``: one per prompt instead of those derived from ``sampling.seed`` (`stapo eval`'s chunks)."""

    def __init__(self, prompt_ids: Sequence[Sequence[int]], n: int, sampling: SamplingParams, *,
                 tools: ToolEpisodes | None = None, seeds: Sequence[int | None] | None = None) -> None:
        prompts = check_prompts(prompt_ids, n)
        seeds = prompt_seeds(sampling.seed, len(prompts)) if seeds is None else list(seeds)
        if len(seeds) != len(prompts):
            raise ValueError(f"{len(seeds)} prompt seeds for {len(prompts)} prompts")
        self.trajectories = [Trajectory(p, None if s is None else s + k) for p, s in zip(prompts, seeds)
                             for k in range(n)]
        self.n, self.budget, self.tools = n, sampling.max_new_tokens, tools
        self.sampling = sampling if tools is None else tools.sampling(sampling)
        self.interrupted = 0  # segments an interrupt cut (that had produced tokens)
        self.tool_wait_s = 0.0  # wall seconds spent waiting for tool turns
        self.versions_known = True  # every segment came with the version that sampled it

    def unfinished(self) -> int:
        return sum(not t.done for t in self.trajectories)

    def advance(self, engine: RolloutEngine) -> bool:
        """Run rounds of segments until every sample finished (True) or ``engine`` was interrupted (False:
        call again once it resumes; the samples go on from where they were cut)."""
        while True:
            self._tool_turns()
            live = [t for t in self.trajectories if not t.done]
            if not live:
                return True
            segments = engine.generate_segments([t.request(self.budget) for t in live], self.sampling)
            cut = False
            for t, segment in zip(live, segments, strict=True):
                self.versions_known &= segment.version is not None
                if self.tools is not None:
                    segment = self.tools.read(t.turn_text, segment)
                t.add(segment)
                if segment.finish == "interrupted":
                    cut = True
                    self.interrupted += bool(segment.tokens)
                    if len(t.tokens) >= self.budget:  # cut right at its last token: nothing left to ask for
                        t.end_turn()
                        t.close("length")
                elif self.tools is None or segment.finish in ("length", "error"):
                    t.end_turn()
                    t.close(segment.finish)
                else:
                    self.tools.end_turn(t)
            if cut:
                return False

    def _tool_turns(self) -> None:
        if self.tools is not None and any(t.pending is not None for t in self.trajectories):
            start = time.perf_counter()
            self.tools.tool_turns(self.trajectories, self.budget)
            self.tool_wait_s += time.perf_counter() - start

    def rollout(self, pad_token_id: int) -> Rollout:
        """The finished samples as one `Rollout`, the one assembler: prompts left-padded, responses right-padded,
        groups of ``n``; tool episodes with context tokens and `EpisodeInfo`; every token's policy version when the
        engine gave them (a row's oldest as its `policy_version`)."""
        trajectories = self.trajectories
        unfinished = [i for i, t in enumerate(trajectories) if not t.done]
        if unfinished:
            raise RuntimeError(f"Generation.rollout: samples {unfinished[:5]} are not finished")
        prompt_ids, prompt_mask = left_pad([t.prompt for t in trajectories], pad_token_id)
        sampled = right_pad([t.sampled for t in trajectories], False, torch.bool)  # (B, T)
        real = right_pad([[True] * len(t.tokens) for t in trajectories], False, torch.bool)  # (B, T)
        info = token_version = policy_version = None
        if self.versions_known:  # a row's version is its oldest token's; a row without tokens: the one it started with
            token_version = right_pad([t.versions for t in trajectories], 0, torch.long)  # 0 on context and padding
            started = torch.tensor([t.first_version or 0 for t in trajectories], dtype=torch.long)
            oldest = token_version.masked_fill(~sampled, 2**62).min(dim=1).values if sampled.any() else started
            policy_version = torch.where(sampled.any(dim=1), oldest, started)
        if self.tools is not None:
            info = EpisodeInfo(
                turns=torch.tensor([t.turns for t in trajectories]),
                tool_calls=torch.tensor([t.calls for t in trajectories]),
                tool_errors=torch.tensor([t.errors for t in trajectories]),
                tool_seconds=torch.tensor([t.tool_seconds for t in trajectories], dtype=torch.float64),
                final_text=[t.final_text for t in trajectories], tool_wait_s=self.tool_wait_s)
        return Rollout(
            prompt_ids=prompt_ids, prompt_mask=prompt_mask,
            response_ids=right_pad([t.tokens for t in trajectories], pad_token_id, torch.long), response_mask=sampled,
            sampling_logprobs=right_pad([t.logprobs for t in trajectories], 0.0, torch.float32),
            finish_reason=[t.finish for t in trajectories], response_text=["".join(t.texts) for t in trajectories],
            group_index=torch.arange(len(trajectories) // self.n).repeat_interleave(self.n), group_size=self.n,
            pad_token_id=pad_token_id, context_mask=real & ~sampled, episodes=info,
            policy_version=policy_version, token_version=token_version)


def generate(engine: RolloutEngine, prompt_ids: Sequence[Sequence[int]], n: int, sampling: SamplingParams, *,
             tools: ToolEpisodes | None = None, seeds: Sequence[int | None] | None = None) -> Rollout:
    """``n`` samples of each prompt on ``engine`` (one turn, or tool episodes with ``tools``); rows grouped per
    prompt (`Rollout`). For an engine that may be interrupted meanwhile, drive a `Generation` instead."""
    generation = Generation(prompt_ids, n, sampling, tools=tools, seeds=seeds)
    if not generation.advance(engine):
        raise RuntimeError("generate(): the engine was interrupted; a Generation continues after it resumes")
    return generation.rollout(engine.pad_token_id)
