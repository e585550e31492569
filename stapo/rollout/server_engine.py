"""`ServerEngine`: rollouts from vLLM server processes of their own (``rollout.mode: server``).

The colocated `VLLMEngine` shares each trainer rank's GPU; here generation runs on separate vLLM
servers (``stapo serve MODEL``, any node) listed in ``rollout.servers``, so rollout and training
GPUs can be sized apart and overlap (``rollout.max_staleness``; docs/rollout.md, "Rollout servers").
It is the same `RolloutEngine`:

- requests are vLLM's ``/v1/completions`` with TOKEN-ID prompts, one request per prompt with its
  ``n`` samples and its own seed — the colocated derivation (`request_seeds`), so a seed gives the
  same samples in both modes — and ``logprobs=0`` (the sampled token's log-prob; the server runs
  with ``--logprobs-mode processed_logprobs``, as the colocated engine does);
- requests go to the live server with the fewest requests in flight; a request that fails is retried
  (``retries``), then its server is declared down (a warning names it) and the request goes to
  another; with no server left, :class:`NoRolloutServers`;
- a server that is down comes back only when it answers and holds the current policy version: the
  trainer's next sync re-sends it the weights (`BroadcastSession`) before it serves again;
- weights: only the engine built with ``sends_weights`` (the trainer's global rank 0) runs the
  session; on the other ranks `weight_update` and `load_weights` are no-ops (their ZeRO-3 gathers
  still take part, `stapo.sync.buckets.sync_weights` is collective).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import torch

from stapo.rollout.batch import Rollout
from stapo.rollout.engine import check_prompts
from stapo.rollout.sampling import SamplingParams
from stapo.rollout.server_client import ServerClient, ServerError, parse_address
from stapo.rollout.server_weights import BroadcastSession
from stapo.rollout.vllm_engine import rollout_from_vllm_outputs, vllm_sampling_kwargs

__all__ = ["NoRolloutServers", "ServerEngine", "ServerPool", "completion_request", "outputs_from_completion"]

log = logging.getLogger("stapo.rollout")


class NoRolloutServers(RuntimeError):
    """Every rollout server is down: the run cannot generate (the trainer checkpoints and stops)."""


class ServerPool:
    """The servers and their state: requests in flight, down or live (thread-safe)."""

    def __init__(self, clients: Sequence[ServerClient]) -> None:
        self.clients = list(clients)
        self._in_flight = {c.address: 0 for c in self.clients}
        self._down: dict[str, str] = {}  # address -> why
        self._lock = threading.Lock()

    @property
    def live(self) -> list[ServerClient]:
        with self._lock:
            return [c for c in self.clients if c.address not in self._down]

    @property
    def down(self) -> list[ServerClient]:
        with self._lock:
            return [c for c in self.clients if c.address in self._down]

    def acquire(self) -> ServerClient:
        """The live server with the fewest requests in flight (the first listed on a tie)."""
        with self._lock:
            live = [c for c in self.clients if c.address not in self._down]
            if not live:
                raise NoRolloutServers("no rollout server is left: " + "; ".join(
                    f"{a}: {why}" for a, why in self._down.items()))
            client = min(live, key=lambda c: self._in_flight[c.address])
            self._in_flight[client.address] += 1
            return client

    def release(self, client: ServerClient) -> None:
        with self._lock:
            self._in_flight[client.address] -= 1

    def mark_down(self, client: ServerClient, why: str) -> None:
        with self._lock:
            if client.address in self._down:
                return
            self._down[client.address] = why
            left = len(self.clients) - len(self._down)
        log.warning("rollout server %s is down (%s); its requests go to the %d left", client.address, why, left)

    def mark_live(self, client: ServerClient) -> None:
        with self._lock:
            if self._down.pop(client.address, None) is not None:
                log.warning("rollout server %s is back and serves again", client.address)


def completion_request(prompt: list[int], base: dict, seed: int | None) -> dict:
    """The ``/v1/completions`` body of one prompt (``base``: `vllm_sampling_kwargs`' settings)."""
    body = {"prompt": prompt, **base, "return_token_ids": True}
    if seed is not None:
        body["seed"] = seed
    return body


def outputs_from_completion(reply: dict) -> SimpleNamespace:
    """A ``/v1/completions`` reply as the ``RequestOutput`` shape `rollout_from_vllm_outputs` reads."""
    outputs = []
    for choice in reply["choices"]:
        ids = choice.get("token_ids") or []
        logprobs = (choice.get("logprobs") or {}).get("token_logprobs") or []
        outputs.append(SimpleNamespace(
            index=choice["index"], token_ids=ids, text=choice.get("text", ""), finish_reason=choice.get("finish_reason"),
            logprobs=[{tok: lp} for tok, lp in zip(ids, logprobs)] if len(logprobs) == len(ids) else None))
    return SimpleNamespace(outputs=outputs)


class ServerEngine:
    """Rollouts from vLLM servers; see the module docstring.

    Args:
        servers: ``host:port`` of each server (``stapo serve``), any node.
        pad_token_id: the tokenizer's pad id (rows are padded on the trainer's side).
        sends_weights: this process runs the weight sessions (the trainer's global rank 0).
        timeout_s: one request's limit (a long response on a busy server takes minutes).
        retries: failed attempts at one server before it is declared down.
        sync_timeout_s: limit of a weight session's steps (group creation, one bucket, finish).
    """

    def __init__(self, servers: Sequence[str], pad_token_id: int, *, sends_weights: bool = True,
                 timeout_s: float = 3600.0, retries: int = 2, sync_timeout_s: float = 600.0) -> None:
        if not servers:
            raise ValueError("rollout.mode=server needs rollout.servers (host:port of each `stapo serve`)")
        self.pool = ServerPool([ServerClient(parse_address(a), timeout_s) for a in servers])
        self.pad_token_id = pad_token_id
        self.sends_weights = sends_weights
        self.retries = retries
        self.sync_timeout_s = sync_timeout_s
        self.policy_version: int | None = None  # what the servers hold after the last sync
        self._workers: dict[str, int] = {}
        self._session: BroadcastSession | None = None
        self._check_servers()

    def _check_servers(self) -> None:
        """Every listed server answers and runs stapo's worker extension; else one clear error."""
        for client in self.pool.clients:
            try:
                client.get("/health", timeout_s=30)
            except ServerError as err:
                raise ValueError(f"rollout server {client.address} does not answer ({err}); start it with "
                                 f"`stapo serve MODEL --port {client.address.rpartition(':')[2]}` or fix "
                                 "rollout.servers") from None
            self._workers[client.address] = len(self._versions_of(client))

    def _versions_of(self, client: ServerClient) -> list[int | None]:
        """The policy version each worker of ``client`` holds (vLLM's route returns them as strings)."""
        try:
            return [None if v in (None, "None") else int(v) for v in client.rpc("stapo_policy_version", timeout_s=30)]
        except ServerError as err:
            if err.status in (404, 500):
                raise ValueError(f"rollout server {client.address} does not run stapo's worker extension "
                                 "(or was started without VLLM_SERVER_DEV_MODE=1): start it with `stapo serve "
                                 "MODEL`, which sets both") from None
            raise

    # ---------------------------------------------------------------- generate
    def generate(self, prompt_ids: Sequence[Sequence[int]], n: int, sampling: SamplingParams) -> Rollout:
        """Sample ``n`` responses per prompt on the servers; rows grouped per prompt (see `Rollout`)."""
        prompts = check_prompts(prompt_ids, n)
        if self._session is not None:
            raise RuntimeError("generate() inside a weight update session: finish the update first")
        self._revive_servers()
        base, seeds = vllm_sampling_kwargs(sampling, n, len(prompts))
        bodies = [completion_request(p, base, None if seeds is None else seeds[i]) for i, p in enumerate(prompts)]
        with ThreadPoolExecutor(max_workers=min(len(bodies), 64), thread_name_prefix="stapo-rollout") as pool:
            replies = list(pool.map(self._complete, bodies))
        return rollout_from_vllm_outputs([outputs_from_completion(r) for r in replies], prompts, n, self.pad_token_id)

    def _complete(self, body: dict) -> dict:
        """One request, on whichever live server has the least to do; fails over until none is left."""
        while True:
            client = self.pool.acquire()
            try:
                return self._attempts(client, body)
            except ServerError as err:
                self.pool.mark_down(client, str(err))
            finally:
                self.pool.release(client)

    def _attempts(self, client: ServerClient, body: dict) -> dict:
        for attempt in range(self.retries + 1):
            try:
                return client.post("/v1/completions", body)
            except ServerError as err:
                if err.down or attempt == self.retries or (err.status is not None and err.status < 500):
                    raise
                time.sleep(min(2.0 ** attempt, 10.0))
        raise AssertionError("unreachable")

    def _revive_servers(self) -> None:
        """A server that was down serves again once it answers and holds the current weights."""
        for client in self.pool.down:
            if client.healthy() and self.policy_version is not None:
                try:
                    held = self._versions_of(client)
                except (ServerError, ValueError):
                    continue
                if held and all(v == self.policy_version for v in held):
                    self.pool.mark_live(client)

    # ------------------------------------------------------------ weight sync
    @contextlib.contextmanager
    def weight_update(self, version: int | None = None) -> Iterator[None]:
        """One sync into every server that answers (a restarted one included); afterwards the servers
        hold policy ``version`` (None: the next one after the last)."""
        if self._session is not None:
            raise RuntimeError("a weight update session is already open")
        version = version if version is not None else (self.policy_version or 0) + 1
        if not self.sends_weights:
            yield
            self.policy_version = version
            return
        targets = [c for c in self.pool.clients if c.healthy()]
        for client in self.pool.clients:
            if client not in targets:
                self.pool.mark_down(client, "no answer at the weight sync")
        if not targets:
            raise NoRolloutServers("no rollout server is left: none answers at the weight sync")
        for client in targets:
            self._workers[client.address] = len(self._versions_of(client))
        session = BroadcastSession([(c, self._workers[c.address]) for c in targets], self.sync_timeout_s)
        try:
            session.open()
            self._session = session
            yield
            session.close(version)
        except BaseException:
            session.abort()  # a failed open or send: no thread pool or half-joined group left behind
            raise
        finally:
            self._session = None
        self.policy_version = version
        for client in targets:
            self.pool.mark_live(client)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Broadcast one bucket of full tensors (HF names) to every server in the open session."""
        if not self.sends_weights:
            return
        if self._session is None:
            raise RuntimeError("ServerEngine.load_weights must be called inside `with engine.weight_update():`")
        self._session.send(weights)

    def policy_versions(self) -> dict[str, list[int | None]]:
        """What each live server reports: the policy version of each of its workers."""
        return {c.address: self._versions_of(c) for c in self.pool.live}

    def sleep(self) -> None:
        """Nothing to release: the servers run on their own devices."""

    def wake(self) -> None:
        """Nothing to bring back (see `sleep`)."""
