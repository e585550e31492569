"""The segments of partial rollouts on rollout servers (``rollout.partial``; stapo.rollout.partial).

`SegmentRunner.advance` streams the next segment of every unfinished sample of a `PartialBatch`
(``/v1/completions`` with ``stream: true``, one sample per request) and records each chunk's tokens,
sampler log-probs and text as they arrive, stamped with the policy version the servers hold. `interrupt`
— called when a weight sync is about to start — cuts every stream in flight: what a segment received
stays with its sample, and the batch goes on after the sync from there (its next segment, its next seed).

A segment that fails for the server's sake (down, 5xx, malformed, hung) is NOT kept: its tokens are
dropped and the same segment, with the same seed, runs again on another server — so a fault never changes
what is sampled. A refused request (4xx) ends its sample with ``finish_reason`` ``"error"``.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor

from stapo.rollout.partial import PartialBatch, PartialSample
from stapo.rollout.server_client import ABORTED, MALFORMED, ServerClient, ServerError
from stapo.rollout.server_pool import ServerPool
from stapo.rollout.vllm_engine import vllm_sampling_kwargs

__all__ = ["SegmentRunner"]

log = logging.getLogger("stapo.rollout")


class SegmentRunner:
    """Advances partial batches on ``pool``'s servers; ``request_timeout_s`` bounds the wait for a chunk."""

    def __init__(self, pool: ServerPool, request_timeout_s: float) -> None:
        self.pool, self.request_timeout_s = pool, request_timeout_s
        self._interrupted = threading.Event()
        self._lock = threading.Lock()  # batch.interrupted

    @property
    def interrupted(self) -> bool:
        return self._interrupted.is_set()

    def interrupt(self) -> None:
        """Stop every segment in flight (they keep what they streamed) until `resume`."""
        self._interrupted.set()
        for client in self.pool.clients:
            self.pool.tracker(client).cut()

    def resume(self) -> None:
        self._interrupted.clear()

    def advance(self, batch: PartialBatch, version: int) -> bool:
        """One segment of every unfinished sample, sampled by policy ``version``; True once all finished."""
        if self.interrupted:
            return False
        base, _ = vllm_sampling_kwargs(batch.sampling, 1, 1)
        todo = batch.unfinished()
        if todo:
            with ThreadPoolExecutor(max_workers=min(len(todo), 64), thread_name_prefix="stapo-segment") as pool:
                list(pool.map(lambda k: self._segment(batch, k, version, base), todo))
        return batch.done

    def _segment(self, batch: PartialBatch, k: int, version: int, base: dict) -> None:
        sample = batch.samples[k]
        if sample.first_version is None:
            sample.first_version = version
        while not self.interrupted:
            client = self.pool.acquire()
            mark = sample.mark()
            try:
                sample.finish_reason = self._stream(client, batch.request(k, base), sample, version)
                sample.segments += 1
                return
            except ServerError as err:
                if self.interrupted and err.kind == ABORTED:  # cut by the sync: its tokens stay
                    if sample.produced_since(mark):
                        sample.segments += 1
                        with self._lock:
                            batch.interrupted += 1
                    return
                if err.request_error:
                    log.warning("a rollout request failed on %s (%s): its response ends here", client.address, err)
                    sample.finish_reason = "error"
                    return
                sample.rewind(mark)  # the same segment, same seed, on another server
                self.pool.mark_down(client, str(err).removeprefix(f"rollout server {client.address}: "))
            finally:
                self.pool.release(client)

    def _stream(self, client: ServerClient, body: dict, sample: PartialSample, version: int) -> str:
        """Stream one segment into ``sample`` as its chunks arrive; its finish reason."""
        for event in client.stream("/v1/completions", body, self.request_timeout_s, self.pool.tracker(client)):
            choice = (event.get("choices") or [{}])[0]
            ids = choice.get("token_ids") or []
            logprobs = (choice.get("logprobs") or {}).get("token_logprobs") or []
            if len(ids) != len(logprobs):
                raise ServerError(client.address, f"a streamed chunk has {len(ids)} tokens and {len(logprobs)} "
                                                  "log-probs", kind=MALFORMED)
            sample.add(list(ids), [float(x) for x in logprobs], choice.get("text") or "", version)
            if choice.get("finish_reason") is not None:
                if choice["finish_reason"] not in ("stop", "length"):
                    raise ServerError(client.address, f"a segment ended with {choice['finish_reason']!r}",
                                      kind=MALFORMED)
                return choice["finish_reason"]
        raise ServerError(client.address, "a segment's stream ended without a finish reason", kind=MALFORMED)
