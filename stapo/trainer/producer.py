"""Asynchronous rollouts with bounded staleness (``rollout.max_staleness: k >= 1``; docs/algorithm.md,
"Asynchronous training"). Only generation runs on this thread: scoring and every collective stay on the
trainer's.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from stapo.rollout import Rollout

__all__ = ["ProducedBatch", "RolloutProducer"]


@dataclass(frozen=True)
class ProducedBatch:
    """One iteration's generated rows and where they came from."""

    index: int  # the iteration that trains on it (0-based)
    examples: list  # its prompts (PromptDataset examples)
    rollout: Rollout  # policy_version set on every row
    policy_version: int  # the version that sampled it (its oldest token's, with partial rollouts)
    epoch: int  # the prompt sampler's epoch of its draw
    seconds: float  # wall time of its generation
    interrupted: int = 0  # partial rollouts: segments a weight sync cut


class RolloutProducer:
    """The background producer: ``produce(index, version)`` generates one batch (None: a sync cut it, call again)
    for iterations ``first_index`` to ``stop_index`` (excluded). ``interrupt`` / ``resume``: how a sync cuts a
    generation under way (None: it waits). ``sampler_state()`` is read before each draw (the resume point)."""

    def __init__(self, produce: Callable[[int, int], ProducedBatch | None], sampler_state: Callable[[], dict], *,
                 max_staleness: int, first_index: int, version: int, stop_index: int | None = None,
                 close_timeout_s: float = 60.0, interrupt: Callable[[], None] | None = None,
                 resume: Callable[[], None] | None = None) -> None:
        if max_staleness < 1:
            raise ValueError(f"a producer needs max_staleness >= 1, got {max_staleness}")
        self._produce, self._sampler_state = produce, sampler_state
        self.max_staleness = max_staleness
        self._next, self._version = first_index, version
        self._stop_index = stop_index  # the first iteration not to generate for (the run's end)
        self.close_timeout_s = close_timeout_s
        self._interrupt, self._resume = interrupt, resume
        self._pausing = 0  # syncs waiting for or holding the engine (the producer waits them out)
        # _cond's lock guards every field below; _engine is held while generating (the weight sync and a
        # checkpoint's resume point take it too). Order: _engine before _cond, never the other way round.
        self._ready: dict[int, ProducedBatch] = {}
        self._states: dict[int, dict] = {}  # index -> sampler state before its draw
        self._error: BaseException | None = None
        self._stopped = False
        self._cond = threading.Condition()
        self._engine = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="stapo-producer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while True:
                with self._cond:
                    self._cond.wait_for(lambda: self._stopped or self._next - self._version <= self.max_staleness)
                    if self._stopped or (self._stop_index is not None and self._next >= self._stop_index):
                        return
                    index = self._next
                batch = self._generate(index)
                if batch is None:  # stopped
                    return
                with self._cond:
                    self._ready[index] = batch
                    self._next = index + 1
                    self._cond.notify_all()
        except BaseException as err:  # noqa: BLE001  (handed to the trainer's thread by `take`)
            with self._cond:
                self._error = err
                self._cond.notify_all()

    def _generate(self, index: int) -> ProducedBatch | None:
        """Batch ``index``, resumed after every sync that interrupts it; None once the producer is stopped."""
        while True:
            with self._cond:  # a sync waiting for the engine goes first (it interrupted this batch)
                self._cond.wait_for(lambda: self._stopped or self._pausing == 0)
                if self._stopped:
                    return None
            with self._engine:  # no sync can run from here until the batch is generated or interrupted
                with self._cond:  # the version the servers hold now (a sync in between advanced it)
                    version = self._version
                    if index not in self._states:
                        self._states[index] = self._sampler_state()
                batch = self._produce(index, version)
            if batch is not None:
                return batch

    def take(self, index: int) -> ProducedBatch:
        """Batch ``index`` (waits for it); re-raises what stopped the producer."""
        with self._cond:
            self._cond.wait_for(lambda: index in self._ready or self._error is not None)
            if index not in self._ready:
                raise self._error
            batch = self._ready.pop(index)
            for old in [i for i in self._states if i < index]:  # resume points of trained iterations
                del self._states[old]
        if index - batch.policy_version > self.max_staleness:  # by construction never; a guard for changes
            raise RuntimeError(f"batch {index} was sampled by policy version {batch.policy_version}, more than "
                               f"rollout.max_staleness={self.max_staleness} versions old")
        versions = batch.rollout.token_version if batch.rollout is not None else None
        if versions is not None and versions.numel():  # partial rollouts: at most k + 1 versions per response
            mask = batch.rollout.response_mask
            spread = (versions.masked_fill(~mask, -1).max(dim=1).values
                      - versions.masked_fill(~mask, 2**62).min(dim=1).values)[mask.any(dim=1)]
            if spread.numel() and int(spread.max()) > self.max_staleness:
                raise RuntimeError(f"a response of batch {index} mixes {int(spread.max()) + 1} policy versions, more "
                                   f"than rollout.max_staleness + 1 = {self.max_staleness + 1}")
        return batch

    @contextlib.contextmanager
    def paused(self, interrupt: bool = False) -> Iterator[None]:
        """No generation starts or runs inside the block (the weight sync, a checkpoint's resume point).
        ``interrupt``: cut a partial generation under way instead of waiting for it (the weight sync)."""
        with self._cond:
            self._pausing += 1
        try:
            if interrupt and self._interrupt is not None:
                self._interrupt()
            with self._engine:
                yield
        finally:
            if interrupt and self._resume is not None:
                self._resume()
            with self._cond:
                self._pausing -= 1
                self._cond.notify_all()

    def advance(self, version: int) -> None:
        """The servers now hold policy ``version``: batches up to ``version + k`` may be generated. Call it
        inside `paused` (the sync's own block), so no batch starts between the sync and this."""
        with self._cond:
            self._version = version
            self._cond.notify_all()

    def resume_state(self, index: int) -> tuple[dict, int]:
        """``(sampler state before batch index's draw, batches drawn ahead of it)``; call inside `paused`."""
        with self._cond:
            state = self._states.get(index)
            ahead = max(self._next - index, 0)
        if state is None:  # not drawn yet: the sampler stands right before it
            state = self._sampler_state()
        return state, ahead

    def close(self) -> None:
        """Stop after the generation in flight (cut, with partial rollouts; waits up to ``close_timeout_s``)."""
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        if self._interrupt is not None:
            self._interrupt()
        self._thread.join(timeout=self.close_timeout_s)
