"""`RolloutEngine`: what the trainer, the drivers and `stapo eval` need from a generator (paper Algorithm 1,
lines 1-2). This base class is the whole contract: nothing probes an engine for more (CONTRIBUTING.md,
docs/rollout.md, "Segments and drivers").
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from stapo.rollout.sampling import SamplingParams

__all__ = ["FINISH_REASONS", "RolloutEngine", "Segment", "SegmentRequest", "eos_token_ids", "pad_token_id"]

#: stop: EOS, a stop id or a stop string; length: the request's token limit; interrupted: cut by
#: `RolloutEngine.interrupt` (its tokens are kept, the sample goes on later); error: the request was refused
FINISH_REASONS = ("stop", "length", "interrupted", "error")


def eos_token_ids(tokenizer, *configs) -> list[int]:
    """EOS ids of the tokenizer and of generation / model ``configs`` (each may hold an int or a list)."""
    ids: set[int] = set()
    for source in (tokenizer, *configs):
        value = getattr(source, "eos_token_id", None)
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return sorted(ids)


def pad_token_id(tokenizer, *configs) -> int:
    """The first pad id of the tokenizer and ``configs``, else their first EOS id, else 0."""
    for source in (tokenizer, *configs):
        value = getattr(source, "pad_token_id", None)
        if isinstance(value, int):
            return value
    eos = eos_token_ids(tokenizer, *configs)
    return eos[0] if eos else 0


@dataclass(frozen=True)
class SegmentRequest:
    """Continue one context: the prompt and everything generated (or appended) after it so far."""

    context: list[int]
    seed: int | None  # this segment's seed (stapo.rollout.trajectory.segment_seed); None: the engine's stream
    max_new_tokens: int


@dataclass(frozen=True)
class Segment:
    """What one `SegmentRequest` produced."""

    tokens: list[int]
    logprobs: list[float]  # sampler log-prob of each token under the processed distribution
    text: str  # the new tokens decoded, special tokens skipped
    finish: str  # one of FINISH_REASONS
    version: int | None = None  # the policy version that sampled every token (None: nobody told the engine)

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.logprobs):
            raise ValueError(f"a segment has {len(self.tokens)} tokens but {len(self.logprobs)} log-probs")
        if self.finish not in FINISH_REASONS:
            raise ValueError(f"a segment finished with {self.finish!r}, not one of {FINISH_REASONS}")


class RolloutEngine(abc.ABC):
    """A generator of segments that accepts fresh weights. Subclasses set `tokenizer` and `pad_token_id` and
    implement the three abstract methods; the other members' defaults fit an engine without the feature."""

    tokenizer = None  # the policy's tokenizer (None: the engine never decodes here, e.g. rollout servers)
    pad_token_id: int = 0
    max_model_len: int | None = None  # longest context + new tokens the engine holds (None: no limit known)
    interruptible: bool = False  # `interrupt` can cut segments in flight (rollout servers with rollout.partial)
    needs_weights: bool = False  # a level-2 sleep discarded the weights: sync before generating
    policy_version: int | None = None  # the version of the last `weight_update(version)` (None: not told)
    last_sync = None  # what the last sync did (rollout servers: a `stapo.servers.engine.SyncOutcome`; None elsewhere)

    @abc.abstractmethod
    def generate_segments(self, requests: Sequence[SegmentRequest], sampling: SamplingParams) -> list[Segment]:
        """One segment per request, in order. ``sampling`` gives temperature, top-k, top-p, stop strings and
        stop ids; its ``seed`` and ``max_new_tokens`` are not read (each request carries its own)."""

    @abc.abstractmethod
    def weight_update(self, version: int | None = None) -> contextlib.AbstractContextManager:
        """One weight sync: a context in which `load_weights` is called once per bucket. Afterwards the
        engine holds policy ``version`` (`policy_version`). The engine may defer processing until the block
        ends (vLLM processes a fused layer once complete)."""

    @abc.abstractmethod
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy one bucket of full (gathered) tensors, keyed by HF parameter names, into the engine: called
        repeatedly inside `weight_update`; a bucket may end in the middle of a layer; names not in the model
        raise an error."""

    def sleep(self) -> None:
        """Release accelerator memory until `wake` (default: nothing to release)."""

    def wake(self) -> None:
        """Undo `sleep` (default: nothing to bring back)."""

    def close(self) -> None:
        """Stop what the engine runs in the background (default: nothing)."""

    def interrupt(self) -> None:
        """Cut the segments in flight (they return ``finish="interrupted"`` with what they produced) and start
        none until `resume`. Only for `interruptible` engines."""
        raise RuntimeError(f"{type(self).__name__} cannot be interrupted: its segments always run to the end")

    def resume(self) -> None:
        """Let segments run again after `interrupt` (default: nothing to undo)."""

