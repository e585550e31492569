"""The trainer's side of a weight sync into vLLM servers: one session, buckets by broadcast (docs/rollout.md,
"Rollout servers", "Security").

Our own group, not vLLM's weight-transfer engines: those run NCCL and CUDA IPC only, which a CPU machine (and
CI) cannot; a group per session also lets a restarted server join the next sync.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Protocol

import torch

from stapo.distributed.process_group import default_backend
from stapo.sync.bucket_format import pack_bucket_tensor
from stapo.sync.weight_delta import EncodedBucket, SentWeights, TransferStats, checksum
from stapo.sync.weight_group import GroupSpec, call_off, checked_in, let_form, listening_store, namespaced, new_nonce

__all__ = ["BroadcastSession", "CallFailed", "ServerCalls", "SyncFailed"]

log = logging.getLogger("stapo.rollout")


class CallFailed(RuntimeError):
    """A call to one server failed (`stapo.servers.client.ServerError` is one)."""


class ServerCalls(Protocol):
    """All a session knows of one server (`stapo.servers.client.ServerClient` is one); calls raise `CallFailed`."""

    address: str

    def rpc(self, method: str, *args: str, timeout_s: float | None = None) -> list: ...

    def post(self, path: str, body: dict, timeout_s: float | None = None) -> dict: ...


class SyncFailed(RuntimeError):
    """A weight session failed; ``servers``: the addresses known to have failed (may be empty)."""

    def __init__(self, message: str, servers: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.servers = tuple(servers)


def _in_daemon_thread(fn, *args, name: str = "stapo-sync", **kwargs) -> Future:
    """``fn(*args, **kwargs)`` on a daemon thread, as a Future: a call may outlive its session (a worker blocked
    until its timeout), and unlike a ThreadPoolExecutor's, these threads never hold up the interpreter's exit."""
    future: Future = Future()

    def run() -> None:
        if future.set_running_or_notify_cancel():
            try:
                future.set_result(fn(*args, **kwargs))
            except BaseException as err:  # noqa: BLE001  (handed to whoever waits on the future)
                future.set_exception(err)
    threading.Thread(target=run, name=name, daemon=True).start()
    return future


class BroadcastSession:
    """One weight-update session from the trainer into ``servers`` (each: a client and its worker count).

    ``sent``: rank 0's copy of the servers' weights (delta syncs; None: full syncs)."""

    def __init__(self, servers: Sequence[tuple[ServerCalls, int]], sync_host: str, timeout_s: float = 300.0,
                 backend: str | None = None, join_timeout_s: float = 30.0, sent: SentWeights | None = None,
                 delta: bool = False) -> None:
        if not servers:
            raise ValueError("a weight-update session needs at least one server")
        self.servers = list(servers)
        self.sync_host = sync_host
        self.backend = backend or default_backend()  # nccl: the servers' workers receive on their GPUs
        self.device = torch.device("cuda", torch.cuda.current_device()) if self.backend == "nccl" else torch.device("cpu")
        self.timeout_s = timeout_s
        self.join_timeout_s = min(join_timeout_s, timeout_s)
        self.nonce = new_nonce()
        self.reached: list[ServerCalls] = []  # servers asked to join (abort goes to them)
        self.sent, self.delta = sent, delta and sent is not None
        self.stats = TransferStats()
        self.mismatched: dict[str, str] = {}  # server address -> the first bucket whose checksum differed
        self._group = self._store = None

    def open(self) -> None:
        """Form this session's group (rank 0 here) with every server and check every member's proof.

        The group forms only when every worker checked in on the store within ``join_timeout_s``: a server lost while
        joining must never leave the others waiting in the formation, a collective no abort can reach."""
        listening = listening_store(self.sync_host, self.timeout_s)
        self._store = namespaced(listening, self.nonce)
        world = 1 + sum(workers for _, workers in self.servers)
        offsets, offset = [], 1
        for _, workers in self.servers:
            offsets.append(offset)
            offset += workers
        specs = [GroupSpec(self.sync_host, listening.port, world, rank_offset=o, backend=self.backend,
                           timeout_s=self.timeout_s, nonce=self.nonce, join_timeout_s=self.join_timeout_s)
                 for o in offsets]
        self.reached = [client for client, _ in self.servers]
        joins = self._on_every_server("stapo_join_weight_group", [s.to_json() for s in specs])
        missing = self._await_check_ins(specs, joins)
        if missing:
            call_off(self._store, self.nonce)
            raise SyncFailed(f"server(s) {', '.join(missing)} did not join the weight sync within "
                             f"{self.join_timeout_s:g} s; {self._failed_calls(joins)}", missing)
        let_form(self._store, self.nonce)
        self._group, strangers = self._await_formation(
            _in_daemon_thread(self._form, specs[0], self._store, name="stapo-sync-form"), joins)
        if strangers:
            named = [c.address for (c, workers), o in zip(self.servers, offsets) if any(o <= r < o + workers
                                                                                     for r in strangers)]
            raise SyncFailed(f"rank(s) {strangers} of the weight group did not prove they hold the session's nonce "
                             "(not the servers asked to join; no weight was sent)", named)
        self._wait(joins, "join")

    def _form(self, spec: GroupSpec, store) -> tuple:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # a new thread starts on device 0
        return spec.form(0, store, self.device, self.sync_host)

    def _await_formation(self, forming: Future, joins: list[Future]) -> tuple:
        """``(group, strangers)`` once formed. A server whose join fails meanwhile (killed after it checked in)
        ends the wait at once, naming it: rank 0 would otherwise wait out ``timeout_s`` for a peer that never
        comes. The formation thread is left to its bound, ``join_timeout_s`` (a daemon; the store is this
        session's only)."""
        while True:
            try:
                return forming.result(timeout=0.05)
            except FutureTimeout:
                if failed := self._failures(joins):
                    raise SyncFailed(f"server(s) {', '.join(failed)} failed while the weight group formed; "
                                     f"{self._failed_calls(joins)}", list(failed)) from None
            except RuntimeError as err:
                raise SyncFailed(f"the weight group did not form ({err}); {self._failed_calls(joins)}",
                                 list(self._failures(joins))) from None

    def _await_check_ins(self, specs: list[GroupSpec], joins: list[Future]) -> list[str]:
        """The servers that did not check in within ``join_timeout_s``, in order; a failed join ends no other
        server's wait (a slower one is not named, and marked down, with it)."""
        deadline = time.monotonic() + self.join_timeout_s
        while True:
            failed = set(self._failures(joins))
            waiting = {c.address for (c, workers), spec in zip(self.servers, specs)
                       if not checked_in(self._store, self.nonce, spec.rank_offset, workers)}
            if waiting <= failed or time.monotonic() >= deadline:
                return [c.address for c, _ in self.servers if c.address in failed | waiting]
            time.sleep(0.02)

    def send(self, bucket: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Broadcast one bucket (or its changes) to every server (each stages it)."""
        layout, flat = pack_bucket_tensor(list(bucket))
        encoded = (EncodedBucket({"checksum": checksum(flat)}, flat, flat.numel(), None) if self.sent is None
                   else self.sent.encode(layout, flat, self.delta))
        header, payload = encoded.header, encoded.payload
        self.stats.add(encoded)
        message = json.dumps({**layout, **header, "nonce": self.nonce})
        receives = self._on_every_server("stapo_receive_bucket", [message] * len(self.servers))
        try:
            if payload.numel():  # an unchanged bucket of a delta sync sends nothing
                self._group.broadcast(payload.to(self.device), 0).wait()
        except RuntimeError as err:
            raise SyncFailed(f"the broadcast of a bucket failed ({err})") from None
        self._check(self._wait(receives, "bucket"), len(layout["names"]), header["checksum"], layout["names"][0])

    def _check(self, replies: list, expected: int, ours: str, first: str) -> None:
        """Every server staged the bucket's ``expected`` tensors, with rank 0's checksum ``ours``."""
        for (client, _), results in zip(self.servers, replies):
            answers = [json.loads(r) if isinstance(r, str) else r for r in results]
            if any(not isinstance(a, dict) or a.get("tensors") != expected for a in answers):
                raise SyncFailed(f"rollout server {client.address} staged {results} of a {expected}-tensor bucket",
                                 [client.address])
            theirs = {a.get("checksum") for a in answers}
            if theirs != {ours} and client.address not in self.mismatched:
                self.mismatched[client.address] = f"bucket {first}...: checksum {sorted(theirs)} != rank 0's {ours}"
                log.warning("weight sync: rollout server %s holds other bytes than the trainer sent (%s); it keeps "
                            "its weights this time and gets a full sync next", client.address,
                            self.mismatched[client.address])

    def close(self, version: int | None) -> list[tuple[ServerCalls, str]]:
        """Commit ``version`` on every server and drop their prefix caches (a server whose checksum differed is
        aborted instead); returns the servers that failed or were aborted, with why."""
        commit = json.dumps({"nonce": self.nonce, "version": version})
        committing = [(c, w) for c, w in self.servers if c.address not in self.mismatched]
        futures = [_in_daemon_thread(c.rpc, "stapo_commit_weight_update", commit, timeout_s=self.timeout_s)
                   for c, _ in committing]
        failed = []
        for (client, _), future in zip(committing, futures):
            try:
                future.result(timeout=self.timeout_s + 5)
                client.post("/reset_prefix_cache", {}, self.timeout_s)
            except (CallFailed, FutureTimeout) as err:
                failed.append((client, f"weight commit or prefix-cache reset failed: {err}"))
        for client, _ in self.servers:
            if client.address in self.mismatched:
                self._abort_one(client)
                failed.append((client, f"not committed, checksum mismatch: {self.mismatched[client.address]}"))
        self._release()
        return failed

    def abort(self) -> list[str]:
        """Drop the group (releasing a worker blocked in a broadcast) and abort the session on every server it
        reached; returns the addresses that did not answer."""
        self._release()
        silent = [client.address for client in self.reached if not self._abort_one(client)]
        self.reached = []
        return silent

    def _abort_one(self, client: ServerCalls) -> bool:
        """A server still forming the group takes the abort once its formation ends, within ``join_timeout_s``
        of the go (`GroupSpec.form`; vLLM runs one worker call at a time): hence twice that."""
        try:
            client.rpc("stapo_abort_weight_update", self.nonce, timeout_s=2 * self.join_timeout_s)
            return True
        except CallFailed as err:
            log.warning("weight sync: rollout server %s did not take the abort (%s)", client.address, err)
            return False

    def _release(self) -> None:
        self._group = self._store = None  # closes the group's connections and the store's socket

    def _on_every_server(self, method: str, args: list[str]) -> list:
        return [_in_daemon_thread(client.rpc, method, arg, timeout_s=self.timeout_s)
                for (client, _), arg in zip(self.servers, args)]

    def _wait(self, futures: list, step: str) -> list:
        """Every server's results of one step; SyncFailed naming the servers whose call failed."""
        results, failed = [], []
        for (client, _), future in zip(self.servers, futures):
            try:
                results.append(future.result(timeout=self.timeout_s + 5))
            except (CallFailed, FutureTimeout) as err:
                failed.append((client.address, str(err) or "no answer"))
        if failed:
            raise SyncFailed(f"weight sync {step}: " + "; ".join(why for _, why in failed), [a for a, _ in failed])
        return results

    def _failures(self, futures: list) -> dict[str, BaseException]:
        """The servers whose call has failed so far, with the error."""
        return {c.address: f.exception() for (c, _), f in zip(self.servers, futures)
                if f.done() and f.exception() is not None}

    def _failed_calls(self, futures: list) -> str:
        return "; ".join(f"{a}: {e}" for a, e in self._failures(futures).items()) or "no server reported an error"
