"""Sampling parameters and the pure tensor functions that turn logits into sampled tokens.

Paper Eq. 1 compares the policy with the distribution a token was *actually drawn from*, so every engine reports
its log-prob under the **processed** distribution, in vLLM's order and top-p rule (docs/rollout.md, "Sampling").
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["SamplingParams", "derived_seed", "processed_logprobs", "sample_with_uniforms", "vllm_request_kwargs"]


@dataclass
class SamplingParams:
    """How to sample responses, validated on construction (docs/rollout.md, "Sampling"). Engines read the
    sampling settings from it; seeds and token limits reach them per request (`SegmentRequest`)."""

    temperature: float = 1.0  # 0: greedy (evaluation only; log-probs then of the temperature-1 distribution)
    top_p: float = 1.0  # nucleus mass in (0, 1]; 1: off
    top_k: int = -1  # keep the k most likely tokens; <= 0: off
    max_new_tokens: int = 256  # a sample's budget (an episode's: policy + context tokens); hit: "length"
    stop_token_ids: tuple[int, ...] = ()  # ids that end a row besides the tokenizer's EOS ids
    seed: int | None = None  # the call's; samples and segments derive theirs (`trajectory`); None: not reproducible
    stop: tuple[str, ...] = ()  # end a row once its decoded text holds one (vLLM's stop); the row keeps it

    def __post_init__(self) -> None:
        if not self.temperature >= 0.0:
            raise ValueError(f"SamplingParams.temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int):
            raise ValueError(f"SamplingParams.top_k must be an int (<= 0: off), got {self.top_k!r}")
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"SamplingParams.max_new_tokens must be an int >= 1, got {self.max_new_tokens!r}")
        self.stop_token_ids = tuple(int(t) for t in self.stop_token_ids)
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError(f"SamplingParams.stop_token_ids must be >= 0, got {self.stop_token_ids}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"SamplingParams.seed must be an int or None, got {self.seed!r}")
        self.stop = tuple(self.stop)
        if any(not isinstance(t, str) or not t for t in self.stop):
            raise ValueError(f"SamplingParams.stop must hold non-empty strings, got {self.stop!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def processed_logprobs(logits: torch.Tensor, temperature: float = 1.0, top_k: int = -1,
                       top_p: float = 1.0) -> torch.Tensor:
    """`logits (N, V)` -> `(N, V)` float32 log of the distribution a token is drawn from: temperature, top-k, top-p
    (filtered: -inf). Temperature 0 is treated as 1 (greedy picks the argmax, which no filter moves)."""
    scores = logits.float() / (temperature if temperature > 0 else 1.0)  # (N, V)
    vocab = scores.shape[-1]
    if 0 < top_k < vocab:
        kth = torch.topk(scores, top_k, dim=-1).values[..., -1:]  # (N, 1)
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if top_p < 1.0:
        sorted_scores, order = torch.sort(scores, dim=-1, descending=False)  # (N, V) ascending
        cum = torch.softmax(sorted_scores, dim=-1).cumsum(dim=-1)  # (N, V)
        drop_sorted = cum <= 1.0 - top_p
        drop_sorted[..., -1] = False  # always keep the most likely token
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        scores = scores.masked_fill(drop, float("-inf"))
    return torch.log_softmax(scores, dim=-1)


def sample_with_uniforms(logprobs: torch.Tensor, uniforms: torch.Tensor,
                         greedy: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """`(tokens (N,), token_logprobs (N,))` drawn by inverse CDF from `logprobs (N, V)`: row r takes the first token
    whose cumulative probability exceeds ``uniforms[r] × total``. Each row's uniforms come from its own generator,
    so its draw depends on its seed only; a filtered token (mass 0) is never drawn (the target stays below total)."""
    if greedy:
        tokens = logprobs.argmax(dim=-1)  # (N,)
    else:
        cdf = logprobs.exp().cumsum(dim=-1)  # (N, V)
        total = cdf[:, -1:]
        target = torch.minimum(uniforms.to(cdf)[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
        tokens = torch.searchsorted(cdf, target, right=True).squeeze(-1)  # (N,)
    return tokens, logprobs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def vllm_request_kwargs(sampling: SamplingParams) -> dict:
    """The settings of one vLLM request (``vllm.SamplingParams`` / ``/v1/completions``) from ``sampling``, the
    same for the colocated engine and the rollout servers: one sample (``n=1``), the processed log-prob of the
    sampled token (``logprobs=0``), special tokens skipped in the text. Seed and ``max_tokens`` are per request."""
    base = dict(n=1, temperature=sampling.temperature, top_p=sampling.top_p,
                top_k=sampling.top_k if sampling.top_k > 0 else -1, stop_token_ids=list(sampling.stop_token_ids),
                logprobs=0, skip_special_tokens=True)
    if sampling.stop:  # the text keeps the stop string, as the token ids and the HF engine do
        base.update(stop=list(sampling.stop), include_stop_str_in_output=True)
    return base


def derived_seed(seed: int, index: int) -> int:
    """A reproducible seed for item ``index`` of a run seeded with ``seed``, independent across items
    (NumPy's SeedSequence), in vLLM's accepted range."""
    return int(np.random.SeedSequence([seed, index]).generate_state(1)[0] % (2**31 - 1))
