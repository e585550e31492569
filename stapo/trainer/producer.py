"""Asynchronous rollouts with bounded staleness (``rollout.max_staleness: k >= 1``; docs/algorithm.md).

A background thread generates the batches of the next iterations on the rollout servers while the
trainer updates. Policy version ``v`` = optimizer iterations whose weights the servers hold; batch
``j`` (the batch iteration ``j`` trains, 0-based) may be sampled once ``j - v <= k``, so every row the
trainer uses is at most ``k`` versions old — with ``k = 1``, batch ``j + 1`` is generated during
iteration ``j``'s update, the one-step off-policy schedule of verl and prime-rl. The weight sync
pauses the producer (`paused`): a server never generates inside a weight-update session.

Only generation runs here (prompt draws, the engine's ``generate``): scoring, the no-grad pass and
every collective stay on the trainer's thread, so the mask statistics and ``old_logprobs`` still come
from the current policy. The checkpoint's resume point is the prompt sampler's state before the first
batch not yet trained (`resume_state`); batches generated ahead are regenerated after a restart.
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
    policy_version: int  # the version that sampled it
    epoch: int  # the prompt sampler's epoch of its draw
    seconds: float  # wall time of its generation


class RolloutProducer:
    """The background producer; ``produce(index, version)`` draws and generates one batch, for the
    iterations from ``first_index`` up to (not including) ``stop_index``.

    ``sampler_state()`` returns the prompt sampler's state; it is read before each draw, so that a
    checkpoint can name the draw of the first batch not yet trained.
    """

    def __init__(self, produce: Callable[[int, int], ProducedBatch], sampler_state: Callable[[], dict], *,
                 max_staleness: int, first_index: int, version: int, stop_index: int | None = None,
                 close_timeout_s: float = 60.0) -> None:
        if max_staleness < 1:
            raise ValueError(f"a producer needs max_staleness >= 1, got {max_staleness}")
        self._produce, self._sampler_state = produce, sampler_state
        self.max_staleness = max_staleness
        self._next, self._version = first_index, version
        self._stop_index = stop_index  # the first iteration not to generate for (the run's end)
        self.close_timeout_s = close_timeout_s
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
                with self._engine:  # no sync can run from here until the batch is generated
                    with self._cond:  # the version the servers hold now (a sync in between advanced it)
                        version = self._version
                        self._states[index] = self._sampler_state()
                    batch = self._produce(index, version)
                with self._cond:
                    self._ready[index] = batch
                    self._next = index + 1
                    self._cond.notify_all()
        except BaseException as err:  # noqa: BLE001  (handed to the trainer's thread by `take`)
            with self._cond:
                self._error = err
                self._cond.notify_all()

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
        return batch

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """No generation starts or runs inside the block (the weight sync, a checkpoint's resume point)."""
        with self._engine:
            yield

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
        """Stop after the generation in flight (waits up to ``close_timeout_s``)."""
        with self._cond:
            self._stopped = True
            self._cond.notify_all()
        self._thread.join(timeout=self.close_timeout_s)
