"""`ServerEngine`: rollouts from vLLM server processes of their own (``rollout.mode: server``; docs/rollout.md,
"Rollout servers", "Partial rollouts", "Faults" and "Delta syncs" say what it does and why).

A segment is one ``/v1/completions`` request with a token-id prompt, one sample and its own seed (the seed scheme
of `stapo.rollout.trajectory`), streamed with ``rollout.partial`` so that a weight sync's `interrupt` can cut it and
keep what it produced. Every request goes through `ServerPool.run` (the one retry and failover policy); a failed
attempt's tokens are dropped and its retry has the same seed, so a fault never changes what is sampled. Only the
engine built with ``sends_weights`` (the trainer's global rank 0) runs the weight session; a failing one never
raises mid-sync (the trainer's ZeRO-3 gathers are collective): ``last_sync`` says what happened.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from stapo.rollout.engine import RolloutEngine, Segment, SegmentRequest
from stapo.rollout.sampling import SamplingParams, vllm_request_kwargs
from stapo.serve.fingerprint import first_difference
from stapo.servers.client import MALFORMED, ServerClient, ServerError, parse_address
from stapo.servers.completions import completion_body, read_chunk, segment_from_reply
from stapo.servers.pool import ServerPool
from stapo.sync.broadcast import BroadcastSession, SyncFailed
from stapo.sync.weight_delta import SentWeights, TransferStats
from stapo.sync.weight_group import sync_address

__all__ = ["SYNC_MODES", "ServerEngine", "ServerLimits", "SyncOutcome"]

SYNC_MODES = ("full", "delta")  # rollout.server.sync

log = logging.getLogger("stapo.rollout")


@dataclass(frozen=True)
class ServerLimits:
    """Every time limit and retry count of server mode (the ``rollout.server.*`` of the same names)."""

    request_timeout_s: float = 600.0  # one request's limit before its tokens are counted ...
    request_timeout_per_token_s: float = 0.1  # ... plus this per token of max_new_tokens
    request_retries: int = 2  # retries of a 5xx / malformed reply on the same server (whole or streamed)
    down_after_s: float = 60.0  # no /health answer for this long while requests are in flight: down
    health_interval_s: float = 5.0  # probe period of the servers with requests in flight
    health_timeout_s: float = 5.0  # one probe's (and one state read's) limit
    sync_timeout_s: float = 300.0  # each step of a weight session (group formation, one bucket, the commit)
    sync_join_timeout_s: float = 30.0  # every server checks in for a session within this, or it is called off

    def request_timeout(self, max_tokens: int) -> float:
        return self.request_timeout_s + self.request_timeout_per_token_s * max_tokens


@dataclass(frozen=True)
class SyncOutcome:
    """What the last weight sync did: ``ok`` when at least one server holds the new weights;
    ``failed``: the servers marked down by it; ``error``: why it failed; ``transfer``: the bytes rank 0 sent."""

    ok: bool
    error: str | None = None
    failed: tuple[str, ...] = ()
    live: int = 0  # servers live after it
    transfer: TransferStats | None = None


def _instance(states: list[dict]) -> str:
    """A server's worker instances: a new one means the server restarted (its model is checked again)."""
    return ",".join(str(s.get("instance")) for s in states)


class ServerEngine(RolloutEngine):
    """Rollouts from vLLM servers; see the module docstring.

    Args:
        servers: ``host:port`` of each server (``stapo serve``), any node.
        pad_token_id: the tokenizer's pad id (rows are padded on the trainer's side).
        sends_weights: this process runs the weight sessions (the trainer's global rank 0).
        limits: time limits and retries (`ServerLimits`).
        token: the shared secret the servers were started with (``STAPO_SERVER_TOKEN``), or None.
        sync_host: the trainer's address the servers reach for the weight group (`sync_address`).
        fingerprint: the trainer's `stapo.serve.fingerprint` (``{"model", "tokenizer"}``); None: not checked.
        sync: ``full`` (every bucket whole) or ``delta`` (changed words where smaller; module docstring).
        stream: stream every segment, so `interrupt` can cut it (``rollout.partial``); else plain calls.
        tokenizer: the policy's tokenizer, for callers that decode (the servers decode their own text).
    """

    def __init__(self, servers: Sequence[str], pad_token_id: int, *, sends_weights: bool = True,
                 limits: ServerLimits = ServerLimits(), token: str | None = None, sync_host: str | None = None,
                 fingerprint: dict | None = None, sync: str = "full", stream: bool = False, tokenizer=None) -> None:
        if not servers:
            raise ValueError("rollout.mode=server needs rollout.server.addresses (host:port of each `stapo serve`)")
        if sync not in SYNC_MODES:
            raise ValueError(f"rollout.server.sync must be one of {list(SYNC_MODES)}, got {sync!r}")
        self.sent = SentWeights() if sync == "delta" and sends_weights else None  # rank 0's copy of the servers'
        self.limits = limits
        addresses = [parse_address(a) for a in servers]
        self.pool = ServerPool([ServerClient(a, limits.request_timeout_s, token) for a in addresses],
                               down_after_s=limits.down_after_s, probe_interval_s=limits.health_interval_s,
                               probe_timeout_s=limits.health_timeout_s, retries=limits.request_retries)
        self.pad_token_id, self.tokenizer, self.interruptible = pad_token_id, tokenizer, stream
        self.sends_weights = sends_weights
        self.sync_host = sync_address(addresses, sync_host) if sends_weights else sync_host
        self.fingerprint = fingerprint
        self.policy_version: int | None = None  # what the servers hold after the last sync
        self.last_sync: SyncOutcome | None = None
        self.failed_requests = 0  # requests that failed with a request error (their segments are empty)
        self._instances: dict[str, str] = {}  # address -> the worker instance whose model was checked
        self._workers: dict[str, int] = {}
        self._session: BroadcastSession | None = None
        self._session_error: str | None = None
        self._failed: tuple[str, ...] = ()  # servers a failed session step named
        self._in_session = False
        self._interrupted = threading.Event()  # from `interrupt` to `resume`: no segment starts
        self._interrupts = 0  # interrupts so far: a segment begun before one more was cut by it
        self.max_model_len = min(self._check_server(c) for c in self.pool.clients)

    # ---------------------------------------------------------------- start
    def _check_server(self, client: ServerClient) -> int:
        """One listed server at start: it answers, runs stapo's worker extension, serves the trainer's model
        and tokenizer; a session left open is aborted (rank 0). Returns its ``max_model_len``."""
        try:
            client.get("/health", timeout_s=30)
        except ServerError as err:
            raise ValueError(f"rollout server {client.address} does not answer ({err}); start it with "
                             f"`stapo serve MODEL --port {client.port}` or fix rollout.server.addresses") from None
        try:
            states = self._states(client, timeout_s=30)
            self._check_model(client)
            models = client.get("/v1/models", timeout_s=30).get("data") or [{}]
        except ServerError as err:
            if err.status == 401:
                raise ValueError(f"rollout server {client.address} needs the shared secret it was started with: give "
                                 "the trainer STAPO_SERVER_TOKEN or rollout.server.token_file (`stapo serve` names its "
                                 "file on its first line)") from None
            if err.status in (403, 404, 500) or err.kind == MALFORMED:
                raise ValueError(f"rollout server {client.address} does not run stapo's worker extension ({err}): "
                                 "start it with `stapo serve MODEL`") from None
            raise ValueError(str(err)) from None
        self._instances[client.address] = _instance(states)  # its model was checked above
        if self.sends_weights and any(s.get("session_open") for s in states):
            client.rpc("stapo_abort_weight_update", "", timeout_s=30)
            log.warning("rollout server %s was in the middle of a weight sync (a trainer stopped during one): aborted "
                        "it; the server keeps the weights it had", client.address)
        return int(models[0].get("max_model_len") or 0) or 2**31 - 1

    def _states(self, client: ServerClient, timeout_s: float | None = None) -> list[dict]:
        states = client.rpc_json("stapo_server_state", timeout_s=timeout_s or self.limits.health_timeout_s)
        self._workers[client.address] = len(states)
        return states

    def _check_model(self, client: ServerClient) -> None:
        """ValueError naming the server and the first difference when it serves another model or tokenizer."""
        if self.fingerprint is None:
            return
        served = client.rpc_json("stapo_fingerprint", timeout_s=120)[0]
        difference = first_difference(self.fingerprint, served)
        if difference is not None:
            raise ValueError(f"rollout server {client.address} does not serve the trainer's model: {difference} "
                             "(start it with `stapo serve` on the trainer's model.path, same --dtype)")

    # ---------------------------------------------------------------- generate
    def generate_segments(self, requests: Sequence[SegmentRequest], sampling: SamplingParams) -> list[Segment]:
        """One request per segment on the servers, at most 64 at once (see the module docstring)."""
        if self._in_session:
            raise RuntimeError("generation inside a weight update session: finish the update first")
        version, interrupts = self.policy_version, self._interrupts
        if self._interrupted.is_set():
            return [Segment([], [], "", "interrupted", version) for _ in requests]
        self.refresh()
        base = vllm_request_kwargs(sampling)
        cut = lambda: self._interrupted.is_set() or self._interrupts != interrupts  # noqa: E731
        with ThreadPoolExecutor(max_workers=min(len(requests), 64) or 1, thread_name_prefix="stapo-rollout") as pool:
            return list(pool.map(lambda r: self._segment(completion_body(r, base), version, cut), requests))

    def _segment(self, body: dict, version: int | None, cut: Callable[[], bool]) -> Segment:
        """One segment under the pool's policy. ``cut()``: an `interrupt` came since the segment began (the
        ONE test of a cut, whatever error the cut socket surfaced as): it ends ``"interrupted"``."""
        timeout = self.limits.request_timeout(body["max_tokens"])
        if self.interruptible:
            attempt = lambda client: self._stream(client, body, version, cut)  # noqa: E731
        else:
            attempt = lambda client: segment_from_reply(  # noqa: E731
                client.post("/v1/completions", body, timeout, self.pool.tracker(client)), client.address, version)
        try:
            segment = self.pool.run(attempt, cut)
        except ServerError as err:  # a request error: the request, not the server
            self.failed_requests += 1
            log.warning("a rollout request failed on %s (%s): its response ends here", err.address, err)
            return Segment([], [], "", "error", version)
        return segment if segment is not None else Segment([], [], "", "interrupted", version)

    def _stream(self, client: ServerClient, body: dict, version: int | None, cut: Callable[[], bool]) -> Segment:
        """One streamed segment; cut by `interrupt` (``cut()``), it keeps what it received (``finish="interrupted"``):
        after any chunk, and whatever error the cut socket surfaced as."""
        tokens, logprobs, text = [], [], []
        try:
            for event in client.stream("/v1/completions", body, self.limits.request_timeout_s,
                                       self.pool.tracker(client)):
                ids, lps, chunk, finish = read_chunk((event.get("choices") or [{}])[0], client.address)
                tokens += ids
                logprobs += lps
                text.append(chunk)
                if finish is not None:
                    return Segment(tokens, logprobs, "".join(text), finish, version)
                if cut():  # a stream the cut missed (it connected meanwhile) or whose chunks were already read
                    break
            else:
                raise ServerError(client.address, "a segment's stream ended without a finish reason", kind=MALFORMED)
        except ServerError:
            if not cut():
                raise
        return Segment(tokens, logprobs, "".join(text), "interrupted", version)

    def interrupt(self) -> None:
        """A weight sync is about to start: cut the streamed segments in flight (they keep their tokens);
        none starts until `resume`."""
        if not self.interruptible:
            super().interrupt()
        self._interrupts += 1  # before the cut: a segment that sees its socket fail sees this too
        self._interrupted.set()
        for client in self.pool.clients:
            self.pool.tracker(client).cut()

    def resume(self) -> None:
        self._interrupted.clear()

    def refresh(self) -> None:
        """Read the live servers' state: one that does not answer, holds another policy version than the last
        sync (restarted, or missed a sync), has a session open or serves another model is down. A server
        comes back only through a sync that reaches it (`weight_update`), which also proves it takes weights."""
        for client, states in self._answering(self.pool.live, "to the state read"):
            held = {s.get("version") for s in states}
            if self.policy_version is not None and held != {self.policy_version}:  # None: never synced here
                self.pool.mark_down(client, f"holds policy version {sorted(held, key=str)}, not {self.policy_version} "
                                            "(it serves again once a weight sync reached it)")
            elif any(s.get("session_open") for s in states):
                self.pool.mark_down(client, "a weight session is open on it (it serves again after the next sync)")

    def _answering(self, clients: Sequence[ServerClient], when: str) -> Iterator[tuple[ServerClient, list[dict]]]:
        """``(server, its workers' states)`` of each of ``clients`` that answers and serves the trainer's model (one
        seen for the first time or restarted, with a new worker instance, is checked again); the others are down."""
        for client in clients:
            try:
                states = self._states(client)
            except ServerError as err:
                self.pool.mark_down(client, f"no answer {when} ({err.kind}: {err})")
                continue
            instance = _instance(states)
            if self._instances.get(client.address) != instance:
                try:
                    self._check_model(client)
                except (ValueError, ServerError) as err:
                    self.pool.mark_down(client, f"restarted with another model: {err}")
                    continue
                self._instances[client.address] = instance
            yield client, states

    # ------------------------------------------------------------ weight sync
    @contextlib.contextmanager
    def weight_update(self, version: int | None = None) -> Iterator[None]:
        """One sync into every server that answers; afterwards they hold policy ``version`` (None: the next
        one). Never raises for a server's fault: ``last_sync`` says what happened (module docstring)."""
        if self._in_session:
            raise RuntimeError("a weight update session is already open")
        version = version if version is not None else (self.policy_version or 0) + 1
        self._in_session, self._session_error, self._session, self._failed = True, None, None, ()
        try:
            if self.sends_weights:
                self._open_session()
            yield
            outcome = self._close_session(version) if self.sends_weights else SyncOutcome(True)
        except BaseException:
            if self.sent is not None:  # the copy may hold buckets no server committed
                self.sent.invalidate()
            raise
        finally:
            self._in_session = False
        self.last_sync = outcome
        if outcome.ok:
            self.policy_version = version

    def _open_session(self) -> None:
        targets, holding = [], self.sent is not None
        for client, states in self._answering(self.pool.clients, "at the weight sync"):
            if any(s.get("session_open") for s in states):
                client.rpc("stapo_abort_weight_update", "", timeout_s=self.limits.health_timeout_s)
            targets.append(client)
            if holding and not self.sent.holds(client.address, self._instances[client.address],
                                               [s.get("version") for s in states]):
                holding = False
                if self.sent.version is not None:
                    log.info("weight sync: rollout server %s does not hold the weights last sent (restarted or "
                             "missed a sync): this sync sends every bucket whole", client.address)
        if not targets:
            self._session_error = "no rollout server answers at the weight sync"
            return
        self._session = BroadcastSession([(c, self._workers[c.address]) for c in targets], self.sync_host,
                                         self.limits.sync_timeout_s, join_timeout_s=self.limits.sync_join_timeout_s,
                                         sent=self.sent, delta=holding)
        self._guarded(self._session.open)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Broadcast one bucket of full tensors (HF names) to every server in the open session (after a
        failure in this session: dropped, so the trainer's collective gathers go on in step)."""
        if not self.sends_weights:
            return
        if not self._in_session:
            raise RuntimeError("ServerEngine.load_weights must be called inside `with engine.weight_update():`")
        if self._session is not None and self._session_error is None:
            self._guarded(lambda: self._session.send(weights))

    def _guarded(self, step) -> None:
        try:
            step()
        except (SyncFailed, ServerError, RuntimeError, OSError) as err:
            self._session_error = str(err)
            self._failed = getattr(err, "servers", ()) or ((err.address,) if isinstance(err, ServerError) else ())

    def _close_session(self, version: int) -> SyncOutcome:
        session, failed = self._session, set()
        if session is not None and self._session_error is None:
            for client, why in session.close(version):
                failed.add(client.address)
                self.pool.mark_down(client, why)
            for client, _ in session.servers:
                if client.address not in failed:
                    self.pool.mark_live(client)
            committed = {c.address: self._instances[c.address] for c, _ in session.servers if c.address not in failed}
            if committed:
                if self.sent is not None:
                    self.sent.commit(version, committed)
                return SyncOutcome(True, failed=tuple(sorted(failed)), live=len(self.pool.live), transfer=session.stats)
            self._session_error = "every server failed the weight commit"
        elif session is not None:
            session.abort()  # a server too busy to take it (blocked until its timeout) is asked again next time
            failed = set(self._failed)  # named by the failure (e.g. did not check in), or not answering at all
            failed |= {c.address for c, _ in session.servers if not c.healthy(self.limits.health_timeout_s)}
            for address in failed:
                self.pool.mark_down(next(c for c in self.pool.clients if c.address == address),
                                    f"failed the weight sync: {self._session_error}")
        if self.sent is not None and session is not None and session.stats.dense_bytes:
            self.sent.invalidate()  # updated by the buckets sent, committed nowhere: the next sync is full
        return SyncOutcome(False, self._session_error, tuple(sorted(failed)), live=len(self.pool.live),
                           transfer=None if session is None else session.stats)

    def policy_versions(self) -> dict[str, list[int | None]]:
        """What each live server reports: the policy version of each of its workers."""
        return {c.address: [s.get("version") for s in self._states(c)] for c in self.pool.live}

    def close(self) -> None:
        """Stop the health watch (the servers keep running)."""
        self.pool.close()
