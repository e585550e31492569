"""`ServerEngine`: rollouts from vLLM server processes of their own (``rollout.mode: server``).

The colocated `VLLMEngine` shares each trainer rank's GPU; here generation runs on separate vLLM
servers (``stapo serve MODEL``, any node) listed in ``rollout.servers``, so rollout and training
GPUs can be sized apart and overlap (``rollout.max_staleness``; docs/rollout.md, "Rollout servers").
It is the same `RolloutEngine`:

- requests are vLLM's ``/v1/completions`` with TOKEN-ID prompts, one request per prompt with its
  ``n`` samples and its own seed — the colocated derivation (`request_seeds`), so a seed gives the
  same samples in both modes — and ``logprobs=0`` (the sampled token's log-prob; the server runs
  with ``--logprobs-mode processed_logprobs``, as the colocated engine does);
- at start every server must answer, serve the trainer's model and tokenizer (`stapo.rollout.fingerprint`)
  and report its ``max_model_len``; a session a stopped trainer left open is aborted (rank 0);
- requests go to the live server with the fewest requests in flight. A request error (4xx) fails that
  request only: its rows come back empty (``finish_reason`` ``"error"``, a warning names the server and
  why); a 5xx or a malformed reply is retried (``retries``, each logged), then the server is declared
  down and the request goes to another; so is a server that does not answer, or stops answering its
  health route while requests are in flight (`ServerPool`); with no server left, `NoRolloutServers`;
- before each generation the servers' state is read: one that holds another policy version than the last
  sync (restarted, or down during a sync) serves again only after the next sync has reached it;
- weights: only the engine built with ``sends_weights`` (the trainer's global rank 0) runs the session
  (`BroadcastSession`). A failing session never raises mid-sync — the trainer's ZeRO-3 gathers are
  collective, so every bucket still comes by and is dropped — it is aborted on every server it reached
  (each keeps its weights), the servers that failed are marked down, and ``last_sync`` says what
  happened: the trainer retries with the rest (`stapo.trainer.rollouts`);
- ``sync="delta"`` (``rollout.sync``): rank 0 keeps a copy of what the servers hold (`SentWeights`) and sends
  each bucket's changed words when that is smaller; a sync is full when any server does not hold the copy
  (restarted, or it missed a sync or failed a checksum). ``last_sync.transfer`` says what was sent.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from stapo.rollout.batch import Rollout
from stapo.rollout.engine import check_prompts
from stapo.rollout.fingerprint import first_difference
from stapo.rollout.partial import PartialBatch
from stapo.rollout.sampling import SamplingParams
from stapo.rollout.server_client import MALFORMED, ServerClient, ServerError, parse_address
from stapo.rollout.server_completions import completion_request, failed_outputs, outputs_from_completion
from stapo.rollout.server_partial import SegmentRunner
from stapo.rollout.server_pool import NoRolloutServers, ServerPool
from stapo.rollout.server_weights import BroadcastSession, SyncFailed
from stapo.rollout.vllm_engine import rollout_from_vllm_outputs, vllm_sampling_kwargs
from stapo.rollout.weight_delta import SentWeights, TransferStats
from stapo.rollout.weight_group import sync_address

__all__ = ["NoRolloutServers", "SYNC_MODES", "ServerEngine", "ServerLimits", "ServerPool", "SyncOutcome",
           "sync_address"]

SYNC_MODES = ("full", "delta")  # rollout.sync

log = logging.getLogger("stapo.rollout")


@dataclass(frozen=True)
class ServerLimits:
    """Every time limit and retry count of server mode (``rollout.*``; docs/rollout.md, "Faults")."""

    request_timeout_s: float = 600.0  # one request's limit before its tokens are counted ...
    request_timeout_per_token_s: float = 0.1  # ... plus this per token of max_new_tokens
    request_retries: int = 2  # retries of a 5xx / malformed reply on the same server
    server_down_after_s: float = 60.0  # no /health answer for this long while requests are in flight: down
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


class ServerEngine:
    """Rollouts from vLLM servers; see the module docstring.

    Args:
        servers: ``host:port`` of each server (``stapo serve``), any node.
        pad_token_id: the tokenizer's pad id (rows are padded on the trainer's side).
        sends_weights: this process runs the weight sessions (the trainer's global rank 0).
        limits: time limits and retries (`ServerLimits`).
        token: the shared secret the servers were started with (``STAPO_SERVER_TOKEN``), or None.
        sync_host: the trainer's address the servers reach for the weight group (`sync_address`).
        fingerprint: the trainer's `stapo.rollout.fingerprint` (``{"model", "tokenizer"}``); None: not checked.
        sync: ``full`` (every bucket whole) or ``delta`` (changed words where smaller; module docstring).
    """

    def __init__(self, servers: Sequence[str], pad_token_id: int, *, sends_weights: bool = True,
                 limits: ServerLimits = ServerLimits(), token: str | None = None, sync_host: str | None = None,
                 fingerprint: dict | None = None, sync: str = "full") -> None:
        if not servers:
            raise ValueError("rollout.mode=server needs rollout.servers (host:port of each `stapo serve`)")
        if sync not in SYNC_MODES:
            raise ValueError(f"rollout.sync must be one of {list(SYNC_MODES)}, got {sync!r}")
        self.sent = SentWeights() if sync == "delta" and sends_weights else None  # rank 0's copy of the servers'
        self.limits = limits
        addresses = [parse_address(a) for a in servers]
        self.pool = ServerPool([ServerClient(a, limits.request_timeout_s, token) for a in addresses],
                               down_after_s=limits.server_down_after_s, probe_interval_s=limits.health_interval_s,
                               probe_timeout_s=limits.health_timeout_s)
        self.pad_token_id = pad_token_id
        self.sends_weights = sends_weights
        self.sync_host = sync_address(addresses, sync_host) if sends_weights else sync_host
        self.fingerprint = fingerprint
        self.policy_version: int | None = None  # what the servers hold after the last sync
        self.last_sync: SyncOutcome | None = None
        self.failed_requests = 0  # requests that failed with a request error (their rows are empty)
        self._instances: dict[str, str] = {}  # address -> the worker instance whose model was checked
        self._workers: dict[str, int] = {}
        self._session: BroadcastSession | None = None
        self._session_error: str | None = None
        self._failed: tuple[str, ...] = ()  # servers a failed session step named
        self._in_session = False
        self.segments = SegmentRunner(self.pool, limits.request_timeout_s)  # partial rollouts
        self.max_model_len = min(self._check_server(c) for c in self.pool.clients)

    # ---------------------------------------------------------------- start
    def _check_server(self, client: ServerClient) -> int:
        """One listed server at start: it answers, runs stapo's worker extension, serves the trainer's model
        and tokenizer; a session left open is aborted (rank 0). Returns its ``max_model_len``."""
        port = client.address.rpartition(":")[2]
        try:
            client.get("/health", timeout_s=30)
        except ServerError as err:
            raise ValueError(f"rollout server {client.address} does not answer ({err}); start it with "
                             f"`stapo serve MODEL --port {port}` or fix rollout.servers") from None
        try:
            states = self._states(client, timeout_s=30)
            self._check_model(client)
            models = client.get("/v1/models", timeout_s=30).get("data") or [{}]
        except ServerError as err:
            if err.status == 401:
                raise ValueError(f"rollout server {client.address} needs the shared secret it was started with: give "
                                 "the trainer STAPO_SERVER_TOKEN or rollout.server_token_file (`stapo serve` names its "
                                 "file on its first line)") from None
            if err.status in (403, 404, 500) or err.kind == MALFORMED:
                raise ValueError(f"rollout server {client.address} does not run stapo's worker extension ({err}): "
                                 "start it with `stapo serve MODEL`") from None
            raise ValueError(str(err)) from None
        self._instances[client.address] = ",".join(str(s.get("instance")) for s in states)  # checked above
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
    def generate(self, prompt_ids: Sequence[Sequence[int]], n: int, sampling: SamplingParams) -> Rollout:
        """Sample ``n`` responses per prompt on the servers; rows grouped per prompt (see `Rollout`)."""
        prompts = check_prompts(prompt_ids, n)
        if self._in_session:
            raise RuntimeError("generate() inside a weight update session: finish the update first")
        self.refresh()
        base, seeds = vllm_sampling_kwargs(sampling, n, len(prompts))
        bodies = [completion_request(p, base, None if seeds is None else seeds[i]) for i, p in enumerate(prompts)]
        timeout = self.limits.request_timeout(sampling.max_new_tokens)
        with ThreadPoolExecutor(max_workers=min(len(bodies), 64), thread_name_prefix="stapo-rollout") as pool:
            outputs = list(pool.map(lambda body: self._complete(body, n, timeout), bodies))
        return rollout_from_vllm_outputs(outputs, prompts, n, self.pad_token_id)

    def _complete(self, body: dict, n: int, timeout_s: float) -> SimpleNamespace:
        """One request, on whichever live server has the least to do; fails over until none is left."""
        while True:
            client = self.pool.acquire()
            try:
                return self._attempts(client, body, n, timeout_s)
            except ServerError as err:
                if err.request_error:  # the request, not the server
                    self.failed_requests += 1
                    log.warning("a rollout request failed on %s (%s): its %d rows are left empty", client.address,
                                err, n)
                    return failed_outputs(n)
                self.pool.mark_down(client, str(err).removeprefix(f"rollout server {client.address}: "))
            finally:
                self.pool.release(client)

    def _attempts(self, client: ServerClient, body: dict, n: int, timeout_s: float) -> SimpleNamespace:
        tracker = self.pool.tracker(client)
        for attempt in range(self.limits.request_retries + 1):
            try:
                return outputs_from_completion(client.post("/v1/completions", body, timeout_s, tracker), n,
                                               client.address)
            except ServerError as err:
                if err.down or err.request_error or attempt == self.limits.request_retries:
                    raise
                log.warning("rollout server %s: attempt %d of %d failed (%s); retrying", client.address, attempt + 1,
                            self.limits.request_retries + 1, err)
                time.sleep(min(2.0 ** attempt, 10.0))
        raise AssertionError("unreachable")

    # ---------------------------------------------------- partial rollouts
    def generate_partial(self, batch: PartialBatch, version: int) -> bool:
        """Advance ``batch`` by one segment per unfinished sample with the weights of policy ``version``
        (stapo.rollout.partial); True once every sample finished, False when a sync interrupted it."""
        if self._in_session:
            raise RuntimeError("generate_partial() inside a weight update session: finish the update first")
        if self.segments.interrupted:
            return False
        self.refresh()
        return self.segments.advance(batch, version)

    def interrupt(self) -> None:
        """A weight sync is about to start: cut the partial segments in flight (they keep their tokens);
        no new one starts until `resume`."""
        self.segments.interrupt()

    def resume(self) -> None:
        self.segments.resume()

    def refresh(self) -> None:
        """Read the live servers' state: one that does not answer, holds another policy version than the last
        sync (restarted, or missed a sync), has a session open or serves another model is down. A server
        comes back only through a sync that reaches it (`weight_update`), which also proves it takes weights."""
        for client in self.pool.live:
            try:
                states = self._states(client)
            except ServerError as err:
                self.pool.mark_down(client, f"no state ({err.kind}: {err})")
                continue
            if not self._same_instance(client, states):
                continue
            held = {s.get("version") for s in states}
            if self.policy_version is not None and held != {self.policy_version}:  # None: never synced here
                self.pool.mark_down(client, f"holds policy version {sorted(held, key=str)}, not {self.policy_version} "
                                            "(it serves again once a weight sync reached it)")
            elif any(s.get("session_open") for s in states):
                self.pool.mark_down(client, "a weight session is open on it (it serves again after the next sync)")

    def _same_instance(self, client: ServerClient, states: list[dict]) -> bool:
        """A server seen for the first time or restarted (new worker instance) must serve the trainer's model."""
        instance = ",".join(str(s.get("instance")) for s in states)
        if self._instances.get(client.address) == instance:
            return True
        try:
            self._check_model(client)
        except (ValueError, ServerError) as err:
            self.pool.mark_down(client, f"restarted with another model: {err}")
            return False
        self._instances[client.address] = instance
        return True

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
        for client in self.pool.clients:
            try:
                states = self._states(client)
            except ServerError as err:
                self.pool.mark_down(client, f"no answer at the weight sync ({err.kind})")
                continue
            if self._same_instance(client, states):
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

    def sleep(self) -> None:
        """Nothing to release: the servers run on their own devices."""

    def wake(self) -> None:
        """Nothing to bring back (see `sleep`)."""
