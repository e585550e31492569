"""The rollout servers, their state, and the ONE request policy of server mode (docs/rollout.md, "Faults").

Whole requests and streamed segments alike: a fault that may pass (5xx, malformed, timeout) is retried on the same
server with backoff, then the server is declared down and the request goes to another; a 4xx fails alone.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from stapo.servers.client import ConnectionTracker, ServerClient, ServerError

__all__ = ["NoRolloutServers", "ServerPool"]

log = logging.getLogger("stapo.rollout")
T = TypeVar("T")


class NoRolloutServers(RuntimeError):
    """No rollout server is left to generate or take the weights: the trainer checkpoints and stops."""


class ServerPool:
    """The servers and their state (thread-safe); see the module docstring. ``retries``: of a server fault on
    the same server before it is declared down (``rollout.server.request_retries``)."""

    def __init__(self, clients: Sequence[ServerClient], *, down_after_s: float = 60.0, probe_interval_s: float = 5.0,
                 probe_timeout_s: float = 5.0, retries: int = 2) -> None:
        self.clients = list(clients)
        self.retries = retries
        self.down_after_s, self.probe_interval_s, self.probe_timeout_s = down_after_s, probe_interval_s, probe_timeout_s
        self._in_flight = {c.address: 0 for c in self.clients}
        self._trackers = {c.address: ConnectionTracker() for c in self.clients}
        self._answered = {c.address: time.monotonic() for c in self.clients}  # last /health answer (or idle)
        self._down: dict[str, str] = {}  # address -> why
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._watcher: threading.Thread | None = None

    @property
    def live(self) -> list[ServerClient]:
        with self._lock:
            return [c for c in self.clients if c.address not in self._down]

    @property
    def down(self) -> list[ServerClient]:
        with self._lock:
            return [c for c in self.clients if c.address in self._down]

    def why_down(self) -> dict[str, str]:
        with self._lock:
            return dict(self._down)

    def tracker(self, client: ServerClient) -> ConnectionTracker:
        return self._trackers[client.address]

    def acquire(self) -> ServerClient:
        """The live server with the fewest requests in flight (the first listed on a tie)."""
        with self._lock:
            live = [c for c in self.clients if c.address not in self._down]
            if not live:
                raise NoRolloutServers("no rollout server is left: " + "; ".join(
                    f"{a}: {why}" for a, why in self._down.items()))
            client = min(live, key=lambda c: self._in_flight[c.address])
            if self._in_flight[client.address] == 0:
                self._answered[client.address] = time.monotonic()  # the watch starts with its first request
            self._in_flight[client.address] += 1
        self._ensure_watcher()
        return client

    def run(self, attempt: Callable[[ServerClient], T], stopped: Callable[[], bool] = lambda: False) -> T | None:
        """``attempt(server)`` under the pool's policy (module docstring); a refused request raises its
        `ServerError` (``request_error``). Once ``stopped()`` (an interrupt): no new attempt starts, no server is
        blamed for the one it cut, and None comes back."""
        while not stopped():
            client = self.acquire()
            try:
                return self._attempts(client, attempt, stopped)
            except ServerError as err:
                if err.request_error:  # the request, not the server
                    raise
                if not stopped():
                    self.mark_down(client, str(err).removeprefix(f"rollout server {client.address}: "))
            finally:
                self.release(client)
        return None

    def _attempts(self, client: ServerClient, attempt: Callable[[ServerClient], T], stopped) -> T:
        for number in range(self.retries + 1):
            try:
                return attempt(client)
            except ServerError as err:
                if err.down or err.request_error or number == self.retries or stopped():
                    raise
                log.warning("rollout server %s: attempt %d of %d failed (%s); retrying", client.address, number + 1,
                            self.retries + 1, err)
                time.sleep(min(2.0 ** number, 10.0))
                if stopped():  # interrupted during the backoff: the retry would start after the cut
                    raise
        raise AssertionError("unreachable")

    def release(self, client: ServerClient) -> None:
        with self._lock:
            self._in_flight[client.address] -= 1

    def mark_down(self, client: ServerClient, why: str) -> bool:
        """Take ``client`` out of service (its open requests are cut); False if it was down already."""
        with self._lock:
            if client.address in self._down:
                return False
            self._down[client.address] = why
            left = len(self.clients) - len(self._down)
        cut = self._trackers[client.address].cut()
        log.warning("rollout server %s is down (%s); %s%d server(s) left", client.address, why,
                    f"{cut} request(s) in flight go elsewhere; " if cut else "", left)
        return True

    def mark_live(self, client: ServerClient) -> None:
        with self._lock:
            was_down = self._down.pop(client.address, None) is not None
        if was_down:
            log.warning("rollout server %s is back and serves again", client.address)

    def close(self) -> None:
        self._stop.set()
        if self._watcher is not None:
            self._watcher.join(timeout=self.probe_timeout_s + 1.0)

    # ---- the health watch ---------------------------------------------------------------------
    def _ensure_watcher(self) -> None:
        with self._lock:
            if self._watcher is None or not self._watcher.is_alive():
                self._watcher = threading.Thread(target=self._watch, name="stapo-health", daemon=True)
                self._watcher.start()

    def _watch(self) -> None:
        with ThreadPoolExecutor(max_workers=max(len(self.clients), 1), thread_name_prefix="stapo-probe") as probes:
            while not self._stop.wait(self.probe_interval_s):
                with self._lock:
                    busy = [c for c in self.clients if self._in_flight[c.address] > 0 and c.address not in self._down]
                answers = list(probes.map(lambda c: c.healthy(self.probe_timeout_s), busy))
                now = time.monotonic()
                for client, answered in zip(busy, answers):
                    with self._lock:
                        if answered:
                            self._answered[client.address] = now
                        silent = now - self._answered[client.address]
                    if not answered and silent >= self.down_after_s:
                        self.mark_down(client, f"no answer on /health for {silent:.0f} s "
                                               f"(rollout.server.down_after_s={self.down_after_s:g})")
