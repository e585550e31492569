"""`Trajectory`: one sample under way and its seeds (`stapo.rollout.drivers.Generation` assembles the `Rollout`).

One seed scheme for every driver and engine (`prompt_seeds`, `segment_seed`; docs/rollout.md, "Segments and
drivers") reproduces a sample given where syncs cut it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from stapo.rollout.engine import Segment, SegmentRequest
from stapo.rollout.sampling import derived_seed
from stapo.tools import ParsedTurn

__all__ = ["Trajectory", "prompt_seeds", "segment_seed"]


def prompt_seeds(seed: int | None, num_prompts: int) -> list[int | None]:
    """Prompt p's seed in a call seeded ``seed`` (independent streams per prompt; NumPy's SeedSequence)."""
    return [None if seed is None else derived_seed(seed, p) for p in range(num_prompts)]


def segment_seed(sample_seed: int | None, segment: int) -> int | None:
    """The seed of a sample's segment: its own seed for segment 0, then ``derived_seed(seed, segment)``."""
    if sample_seed is None or segment == 0:
        return sample_seed
    return derived_seed(sample_seed, segment)


@dataclass
class Trajectory:
    """One sample under way: its tokens (policy and context), their log-probs and versions, the text of its
    turns, and, in a tool episode, its tool facts and sessions."""

    prompt: list[int]
    seed: int | None  # the sample's seed (its segment 0's)
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # 0 on context tokens
    sampled: list[bool] = field(default_factory=list)  # True: the policy's token, False: a context token
    versions: list[int] = field(default_factory=list)  # the policy version of each token (0 on context)
    texts: list[str] = field(default_factory=list)  # segment and context texts, in order
    turn_text: str = ""  # the policy turn under way (across segments a sync cut)
    final_text: str = ""  # the last finished policy turn: what the verifier scores
    finish: str | None = None  # None while under way
    segments: int = 0  # requests that produced tokens (the next one's seed index)
    first_version: int | None = None  # the version its first segment started with
    turns: int = 0  # finished policy turns
    calls: int = 0
    errors: int = 0
    tool_seconds: float = 0.0
    sessions: dict = field(default_factory=dict)  # tool name -> its session in this episode
    pending: ParsedTurn | None = None  # a finished turn's parsed calls, waiting for their tool turn

    @property
    def done(self) -> bool:
        return self.finish is not None

    def request(self, budget: int) -> SegmentRequest:
        """The next segment: prompt + everything so far, this segment's seed, the tokens left of ``budget``."""
        return SegmentRequest(self.prompt + self.tokens, segment_seed(self.seed, self.segments),
                              budget - len(self.tokens))

    def add(self, segment: Segment) -> None:
        """What a segment sampled (an interrupted one's too: it stays with the sample)."""
        if self.first_version is None:
            self.first_version = segment.version
        if segment.tokens:
            self.segments += 1
        self.tokens += segment.tokens
        self.logprobs += segment.logprobs
        self.sampled += [True] * len(segment.tokens)
        self.versions += [segment.version or 0] * len(segment.tokens)
        self.texts.append(segment.text)
        self.turn_text += segment.text

    def end_turn(self) -> str:
        """Close the policy turn under way; returns its text."""
        self.final_text, self.turn_text = self.turn_text, ""
        self.turns += 1
        return self.final_text

    def add_context(self, ids: list[int], text: str) -> None:
        """Tokens the model reads but never sampled (a tool turn)."""
        self.tokens += ids
        self.logprobs += [0.0] * len(ids)
        self.sampled += [False] * len(ids)
        self.versions += [0] * len(ids)
        self.texts.append(text)

    def close(self, finish: str) -> None:
        self.finish = finish
        for session in self.sessions.values():
            if session is not None:
                session.close()
        self.sessions = {}

