"""Imported into each `stapo train` of ``bench/async_overlap.py --long-tail`` (``--import``): responses of
heavy-tailed lengths on the tiny model, as in long-reasoning RL where a few run many times the median.

Each prompt's responses get a length drawn from a Pareto distribution (scale ``SCALE`` tokens, shape
``ALPHA``, capped by the response budget), seeded by the prompt's tokens, and vLLM is asked to sample exactly
that many tokens (``ignore_eos`` + ``max_tokens``). The same prompt gets the same length in every mode —
lock-step, k = 1 and ``rollout.partial``, whose continuations ask only for what is left. Only the segment
requests are changed; nothing else of the run."""

from __future__ import annotations

import math
import random
import zlib

import stapo.servers.engine as server_engine
import stapo.rollout.trajectory as trajectory

SCALE, ALPHA = 40, 1.1  # median ~75 tokens, 1 in 10 over ~320: generation outlasts the tiny update
_completion_body = server_engine.completion_body  # patched where ServerEngine looks it up
_request = trajectory.Trajectory.request


def length(prompt: list[int], cap: int) -> int:
    """The response length of a prompt: Pareto(SCALE, ALPHA) from its tokens, at most ``cap``."""
    u = random.Random(zlib.crc32(str(prompt).encode())).random()
    return max(1, min(cap, math.ceil(SCALE * (1.0 - u) ** (-1.0 / ALPHA))))


def request(self, budget):
    target = length(self.prompt, budget)
    return _request(self, target) if target > len(self.tokens) else _request(self, len(self.tokens) + 1)


def completion_body(segment, base):
    return {**_completion_body(segment, base), "ignore_eos": True}


server_engine.completion_body = completion_body
trajectory.Trajectory.request = request
