"""Sampling parameters and the pure tensor functions that turn logits into sampled tokens.

The RL objective (paper Eq. 1, docs/algorithm.md) compares the current policy with the distribution the
response was *actually drawn from*, so every engine reports the log-probability of the sampled token
under the **processed** distribution: logits / temperature, then top-k, then top-p, renormalized.
The order and the top-p rule follow vLLM's sampler so that `HFEngine` and `VLLMEngine` agree:

    top-k keeps the k largest logits;
    top-p sorts ascending and drops every token whose cumulative probability (from the smallest)
    is <= 1 - top_p, always keeping the most likely token.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["SamplingParams", "derived_seed", "processed_logprobs", "sample_from_logprobs", "sample_rows"]


@dataclass
class SamplingParams:
    """How to sample responses (validated on construction).

    Attributes:
        temperature: softmax temperature; 0 means greedy decoding (evaluation only: the reported
            logprobs are then those of the temperature-1 distribution after top-k / top-p).
        top_p: nucleus mass in (0, 1]; 1 switches it off.
        top_k: keep the k most likely tokens; <= 0 switches it off.
        max_new_tokens: response length limit; a row that hits it finishes with reason "length".
        stop_token_ids: extra ids that end a row (the tokenizer's EOS ids always do).
        seed: seeds the engine's own `torch.Generator`; None draws a fresh random seed.
        stop: strings that end a row once its decoded text (special tokens skipped) contains one, as
            vLLM's ``stop``: the row keeps every token up to and including the one that completed it
            (a tool call's closing tag ends a turn; docs/tir.md).
        request_seeds: one seed per prompt of the call, overriding `seed`: sample i of prompt p draws
            from ``request_seeds[p] + i`` (vLLM's rule for n samples) on every engine, whatever else is
            in the batch. Multi-turn episodes seed each (episode, turn) this way.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = 256
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    stop: tuple[str, ...] = ()
    request_seeds: tuple[int, ...] | None = None

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
        if self.request_seeds is not None:
            self.request_seeds = tuple(self.request_seeds)
            if any(not isinstance(x, int) or not 0 <= x < 2**31 - 1 for x in self.request_seeds):
                raise ValueError("SamplingParams.request_seeds must be ints in [0, 2**31 - 1), got "
                                 f"{self.request_seeds[:5]!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def processed_logprobs(logits: torch.Tensor, temperature: float = 1.0, top_k: int = -1,
                       top_p: float = 1.0) -> torch.Tensor:
    """Log of the distribution a token is drawn from: temperature, then top-k, then top-p.

    `logits (N, V)` of any float dtype -> `(N, V)` float32 log-probabilities; filtered tokens get
    -inf. Temperature 0 is treated as 1 (greedy decoding picks the argmax, which no filter moves).
    """
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


def sample_from_logprobs(logprobs: torch.Tensor, generator: torch.Generator | None,
                         greedy: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row from `logprobs (N, V)`; returns `(tokens (N,) long, token_logprobs (N,))`.

    Sampling uses only `generator` (never the global RNG), so a seeded generator reproduces the draw.
    """
    if greedy:
        tokens = logprobs.argmax(dim=-1)  # (N,)
    else:
        tokens = torch.multinomial(logprobs.exp(), 1, generator=generator).squeeze(-1)  # (N,)
    return tokens, logprobs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def sample_rows(logprobs: torch.Tensor, generators: list[torch.Generator],
                greedy: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """`sample_from_logprobs` with one generator per row: row r's draw depends only on
    ``generators[r]``, not on which other rows share the batch (per-request seeds)."""
    if greedy:
        return sample_from_logprobs(logprobs, None, greedy=True)
    tokens = torch.cat([torch.multinomial(row.exp(), 1, generator=g)
                        for row, g in zip(logprobs, generators, strict=True)])  # (N,)
    return tokens, logprobs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def derived_seed(seed: int, index: int) -> int:
    """A reproducible seed for item ``index`` of a run seeded with ``seed``, independent across items
    (NumPy's SeedSequence), in vLLM's accepted range."""
    return int(np.random.SeedSequence([seed, index]).generate_state(1)[0] % (2**31 - 1))
