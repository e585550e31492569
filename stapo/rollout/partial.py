"""Partial rollouts (``rollout.partial``): responses that outlive a weight sync (docs/rollout.md).

With rollout servers and ``rollout.max_staleness >= 1``, a batch is generated while the trainer updates;
without partial rollouts the sync after the update waits for the batch's LONGEST response (the long tail:
in long-reasoning RL a few responses run many times longer than the median). With them, the sync
interrupts the requests in flight, keeps every token they produced with its sampler log-prob and the
policy version that sampled it, and after the sync each unfinished response continues from its prompt
plus its own tokens with the new weights (AReaL's interruptible generation, verl's ``partial_rollout``).

A response is a sequence of segments; segment ``s`` of a sample is one request with its own seed,
`segment_seed`: segment 0 uses the sample's seed — the seed vLLM gives sample ``i`` of a prompt seeded
``p`` is ``p + i``, so an uninterrupted response is the one the whole-prompt request would have sampled —
and segment ``s >= 1`` a seed derived from it (``derived_seed(sample seed, s)``). A seed therefore
reproduces a response given where it was cut, and a continuation equals a fresh request on the new
weights from the same prefix with that seed (the servers' prefix caches are dropped at every sync, so no
key/value entry of the old weights is reused).

This module is the bookkeeping only (pure Python + torch): `PartialBatch` holds every sample's tokens,
log-probs and versions, gives the next request of each unfinished sample, and turns the finished batch
into a `Rollout` whose ``token_version`` records the version of every token.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from stapo.rollout.batch import Rollout, left_pad, right_pad
from stapo.rollout.sampling import SamplingParams, derived_seed

__all__ = ["PartialBatch", "PartialSample", "segment_seed"]


def segment_seed(sample_seed: int | None, segment: int) -> int | None:
    """The seed of a sample's segment: its own seed for segment 0, then ``derived_seed(seed, segment)``."""
    if sample_seed is None or segment == 0:
        return sample_seed
    return derived_seed(sample_seed, segment)


@dataclass
class PartialSample:
    """One response under way: what its segments produced so far."""

    prompt: list[int]
    seed: int | None
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    segments: int = 0  # segments finished or interrupted so far
    first_version: int | None = None  # the version its first segment started with

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def add(self, token_ids: list[int], logprobs: list[float], text: str, version: int) -> None:
        """Tokens a segment streamed (with their log-probs), sampled by policy ``version``."""
        if len(token_ids) != len(logprobs):
            raise ValueError(f"{len(token_ids)} tokens but {len(logprobs)} log-probs in one chunk")
        self.tokens += token_ids
        self.logprobs += logprobs
        self.versions += [version] * len(token_ids)
        self.text += text

    def mark(self) -> tuple[int, int]:
        """Where the sample stands (tokens, text): `rewind` goes back there."""
        return len(self.tokens), len(self.text)

    def produced_since(self, mark: tuple[int, int]) -> bool:
        return len(self.tokens) > mark[0]

    def rewind(self, mark: tuple[int, int]) -> None:
        """Drop what a failed segment added since ``mark``."""
        tokens, text = mark
        del self.tokens[tokens:], self.logprobs[tokens:], self.versions[tokens:]
        self.text = self.text[:text]


@dataclass
class PartialBatch:
    """``n`` samples of each prompt (row ``p * n + i``: prompt ``p``, sample ``i``), generated in segments."""

    prompts: list[list[int]]
    n: int
    sampling: SamplingParams
    samples: list[PartialSample]
    interrupted: int = 0  # segments cut by a sync

    @classmethod
    def start(cls, prompts: list[list[int]], n: int, sampling: SamplingParams,
              prompt_seeds: list[int] | None) -> "PartialBatch":
        samples = [PartialSample(list(p), None if prompt_seeds is None else prompt_seeds[j] + i)
                   for j, p in enumerate(prompts) for i in range(n)]
        return cls([list(p) for p in prompts], n, sampling, samples)

    @property
    def done(self) -> bool:
        return all(s.done for s in self.samples)

    def unfinished(self) -> list[int]:
        return [k for k, s in enumerate(self.samples) if not s.done]

    def request(self, k: int, base: dict) -> dict:
        """The ``/v1/completions`` body of sample ``k``'s next segment (``base``: the call's vLLM settings):
        its prompt plus its tokens so far, one sample, the tokens it has left, its segment's seed."""
        s = self.samples[k]
        body = {**base, "prompt": s.prompt + s.tokens, "n": 1, "return_token_ids": True,
                "max_tokens": self.sampling.max_new_tokens - len(s.tokens)}
        seed = segment_seed(s.seed, s.segments)
        if seed is not None:
            body["seed"] = seed
        return body

    def to_rollout(self, pad_token_id: int) -> Rollout:
        """The finished batch as a `Rollout` with every token's version (`Rollout.token_version`)."""
        if not self.done:
            raise RuntimeError("PartialBatch.to_rollout before every sample finished")
        prompt_ids, prompt_mask = left_pad([s.prompt for s in self.samples], pad_token_id)
        lengths = [len(s.tokens) for s in self.samples]
        rollout = Rollout(
            prompt_ids=prompt_ids, prompt_mask=prompt_mask,
            response_ids=right_pad([s.tokens for s in self.samples], pad_token_id, torch.long),
            response_mask=right_pad([[1] * n for n in lengths], 0, torch.long).bool(),
            sampling_logprobs=right_pad([s.logprobs for s in self.samples], 0.0, torch.float32),
            finish_reason=[s.finish_reason for s in self.samples], response_text=[s.text for s in self.samples],
            group_index=torch.arange(len(self.prompts)).repeat_interleave(self.n), group_size=self.n,
            pad_token_id=pad_token_id)
        return rollout.with_token_versions(right_pad([s.versions for s in self.samples], 0, torch.long),
                                           [s.first_version or 0 for s in self.samples])
