"""Imported into each `stapo train` of ``bench/async_overlap.py --long-tail`` (``--import``): responses of
heavy-tailed lengths on the tiny model, as in long-reasoning RL where a few run many times the median.

Each prompt's responses get a length drawn from a Pareto distribution (scale ``SCALE`` tokens, shape
``ALPHA``, capped by the request's ``max_tokens``), seeded by the prompt's request seed, and vLLM is asked to
sample exactly that many tokens (``ignore_eos`` + ``max_tokens``). The same prompt gets the same length in
every mode — whole-prompt requests (lock-step, k = 1) and per-sample segments (``rollout.partial``; a
continuation asks only for what is left). Only requests are changed; nothing else of the run."""

from __future__ import annotations

import math
import random

import stapo.rollout.partial as partial
import stapo.rollout.server_engine as server_engine

SCALE, ALPHA = 40, 1.1  # median ~75 tokens, 1 in 10 over ~320: generation outlasts the tiny update
_completion_request = server_engine.completion_request  # patched where ServerEngine looks it up
_segment_request = partial.PartialBatch.request


def length(prompt_seed: int | None, cap: int) -> int:
    """The response length of a prompt: Pareto(SCALE, ALPHA) from its seed, at most ``cap``."""
    u = random.Random(prompt_seed).random()
    return max(1, min(cap, math.ceil(SCALE * (1.0 - u) ** (-1.0 / ALPHA))))


def completion_request(prompt, base, seed):
    body = _completion_request(prompt, base, seed)
    body.update(ignore_eos=True, max_tokens=length(seed, base["max_tokens"]))
    return body


def segment_request(self, k, base):
    body = _segment_request(self, k, base)
    sample = self.samples[k]
    prompt_seed = None if sample.seed is None else sample.seed - k % self.n  # vLLM: sample i draws p + i
    target = length(prompt_seed, self.sampling.max_new_tokens)
    body.update(ignore_eos=True, max_tokens=max(target - len(sample.tokens), 1))
    return body


server_engine.completion_request = completion_request
partial.PartialBatch.request = segment_request
