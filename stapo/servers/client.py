"""A small JSON-over-HTTP client for one vLLM server, standard library only (``http.client``).

Every failure is a `ServerError` of a kind: a request error (4xx) fails that request only, the others are a
fault of the server, whose requests then go elsewhere (docs/rollout.md, "Faults").
"""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

from stapo.sync.broadcast import CallFailed

__all__ = ["ABORTED", "DOWN", "HTTP", "MALFORMED", "TIMEOUT", "ConnectionTracker", "ServerClient", "ServerError",
           "parse_address"]

DOWN, TIMEOUT, HTTP, MALFORMED, ABORTED = "down", "timeout", "http", "malformed", "aborted"


class ServerError(CallFailed):
    """A rollout server did not answer, timed out, answered with an HTTP error or with a reply that is not
    what it should be. ``kind``: `DOWN` (nothing listens, connection reset), `TIMEOUT`, `HTTP` (``status``),
    `MALFORMED`, `ABORTED` (the engine cut the request: the server stopped answering its health route)."""

    def __init__(self, address: str, message: str, *, kind: str = HTTP, status: int | None = None) -> None:
        super().__init__(f"rollout server {address}: {message}")
        self.address, self.kind, self.status = address, kind, status

    @property
    def down(self) -> bool:
        """Gone (refused, reset, cut): retrying it now is pointless until it comes back."""
        return self.kind in (DOWN, ABORTED)

    @property
    def request_error(self) -> bool:
        """The request itself was refused (4xx other than 408/429): a fault of the request, not the server."""
        return self.kind == HTTP and self.status is not None and 400 <= self.status < 500 \
            and self.status not in (408, 429)


def parse_address(address: str) -> str:
    """``host:port`` (a leading ``http://`` and a trailing ``/`` are dropped); ValueError otherwise."""
    text = str(address).strip().removeprefix("http://").rstrip("/")
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"rollout server address {address!r} is not host:port (e.g. 127.0.0.1:8000)")
    return f"{host}:{int(port)}"


class ConnectionTracker:
    """The connections of the requests in flight to one server, so that another thread can cut them all (`cut`):
    each blocked read then fails at once. It holds each connection's socket (http.client lets go of it once a
    response that closes the connection has begun, a stream's among them)."""

    def __init__(self) -> None:
        self._open: dict[int, socket.socket] = {}
        self._cut: set[int] = set()
        self._lock = threading.Lock()

    def add(self, conn: http.client.HTTPConnection) -> None:
        """Track ``conn`` (connected: its socket is what `cut` shuts down)."""
        with self._lock:
            self._open[id(conn)] = conn.sock

    def discard(self, conn: http.client.HTTPConnection) -> None:
        with self._lock:
            self._open.pop(id(conn), None)
            self._cut.discard(id(conn))

    def cut(self) -> int:
        """Shut down every open connection; returns how many."""
        with self._lock:
            socks = list(self._open.values())
            self._cut.update(self._open)
        for sock in socks:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        return len(socks)

    def was_cut(self, conn: http.client.HTTPConnection) -> bool:
        with self._lock:
            return id(conn) in self._cut


@dataclass(frozen=True)
class ServerClient:
    """One server at ``address`` (``host:port``); every call has a timeout in seconds. ``token``: the shared
    secret (never shown in a repr or a message)."""

    address: str
    timeout_s: float = 600.0
    token: str | None = field(default=None, repr=False)

    @property
    def host(self) -> str:
        return self.address.rpartition(":")[0].strip("[]")

    @property
    def port(self) -> int:
        return int(self.address.rpartition(":")[2])

    def get(self, path: str, timeout_s: float | None = None, tracker: ConnectionTracker | None = None) -> dict:
        return self._call("GET", path, None, timeout_s, tracker)

    def post(self, path: str, body: dict, timeout_s: float | None = None,
             tracker: ConnectionTracker | None = None) -> dict:
        return self._call("POST", path, body, timeout_s, tracker)

    def healthy(self, timeout_s: float = 5.0) -> bool:
        try:
            self.get("/health", timeout_s)
            return True
        except ServerError:
            return False

    def rpc(self, method: str, *args: str, timeout_s: float | None = None) -> list:
        """Call ``method`` of stapo's worker extension on every worker of the server (vLLM's
        ``/collective_rpc``: string arguments only); one result per worker."""
        reply = self.post("/collective_rpc", {"method": method, "args": [str(a) for a in args]}, timeout_s)
        results = reply.get("results") if isinstance(reply, dict) else None
        if not isinstance(results, list) or not results:
            raise ServerError(self.address, f"{method}: the reply has no per-worker results ({str(reply)[:200]})",
                              kind=MALFORMED)
        return results

    def rpc_json(self, method: str, *args: str, timeout_s: float | None = None) -> list[dict]:
        """`rpc` whose per-worker results are JSON objects (stapo's worker methods that return JSON)."""
        out = []
        for result in self.rpc(method, *args, timeout_s=timeout_s):
            try:
                value = json.loads(result) if isinstance(result, str) else result
            except ValueError:
                value = None
            if not isinstance(value, dict):
                raise ServerError(self.address, f"{method}: a worker answered {str(result)[:200]!r}, not a JSON "
                                                "object (is it stapo serve?)", kind=MALFORMED)
            out.append(value)
        return out

    def stream(self, path: str, body: dict, timeout_s: float | None = None,
               tracker: ConnectionTracker | None = None) -> Iterator[dict]:
        """POST ``body`` with ``"stream": true`` and yield each server-sent event's JSON until ``[DONE]``
        (vLLM's streaming completions: one event per chunk of new tokens). ``timeout_s`` bounds the wait for
        each chunk, not the whole stream."""
        with self._exchange("POST", path, {**body, "stream": True}, timeout_s, tracker) as reply:
            for raw in reply:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    return
                yield self._event(path, data)
            raise ServerError(self.address, f"the stream of POST {path} ended without [DONE]", kind=MALFORMED)

    def _event(self, path: str, data: bytes) -> dict:
        try:
            event = json.loads(data)
        except ValueError:
            raise ServerError(self.address, f"POST {path} streamed a chunk that is not JSON: {data[:200]!r}",
                              kind=MALFORMED) from None
        if not isinstance(event, dict):
            raise ServerError(self.address, f"POST {path} streamed {str(event)[:300]}", kind=MALFORMED)
        if "error" in event:  # vLLM streams a failure that happens mid-response as an event with its HTTP code
            code = event["error"].get("code") if isinstance(event["error"], dict) else None
            status = code if isinstance(code, int) and 400 <= code < 600 else None
            raise ServerError(self.address, f"POST {path} streamed an error: {str(event)[:300]}",
                              kind=HTTP if status else MALFORMED, status=status)
        return event

    def _headers(self, has_body: bool) -> dict[str, str]:
        headers = {"Content-Type": "application/json"} if has_body else {}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        return headers

    def _call(self, method: str, path: str, body: dict | None, timeout_s: float | None,
              tracker: ConnectionTracker | None) -> dict:
        with self._exchange(method, path, body, timeout_s, tracker) as reply:
            payload = reply.read()
        if not payload:
            return {}
        try:
            return json.loads(payload)
        except ValueError:
            raise ServerError(self.address, f"{method} {path} answered HTTP {reply.status} with a body that is not "
                                            f"JSON: {payload[:200]!r}", kind=MALFORMED) from None

    @contextlib.contextmanager
    def _exchange(self, method: str, path: str, body: dict | None, timeout_s: float | None,
                  tracker: ConnectionTracker | None) -> Iterator[http.client.HTTPResponse]:
        """The one connection path of calls and streams: connect (tracked, so `ConnectionTracker.cut` reaches it),
        send, and hand over the reply once its status is < 400. Every failure, in here or while the caller reads,
        becomes a `ServerError` of its kind; a cut one is `ABORTED` (a read of a cut socket may also look like a
        short or malformed reply, so the cut decides first)."""
        timeout = self.timeout_s if timeout_s is None else timeout_s
        data = None if body is None else json.dumps(body).encode()
        conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout)
        cut = (lambda: tracker.was_cut(conn)) if tracker is not None else (lambda: False)
        try:
            conn.connect()
            if tracker is not None:
                tracker.add(conn)
            conn.request(method, path, body=data, headers=self._headers(data is not None))
            reply = conn.getresponse()
            if reply.status >= 400:
                detail = reply.read().decode(errors="replace")[-500:]
                hint = " (the server needs the shared secret: STAPO_SERVER_TOKEN or rollout.server.token_file)" \
                    if reply.status == 401 else ""
                raise ServerError(self.address, f"HTTP {reply.status} on {method} {path}: {detail}{hint}",
                                  status=reply.status)
            yield reply
            if cut():
                raise OSError("cut")
        except (TimeoutError, socket.timeout):
            raise ServerError(self.address, f"no answer on {method} {path} within {timeout:.0f} s",
                              kind=TIMEOUT) from None
        except (OSError, http.client.HTTPException, ServerError) as err:
            if cut():
                raise ServerError(self.address, f"{method} {path} cut (a weight sync, or the server stopped "
                                                "answering its health route)", kind=ABORTED) from None
            if isinstance(err, ServerError):
                raise
            raise ServerError(self.address, f"no answer on {method} {path} ({type(err).__name__}: {err})",
                              kind=DOWN) from None
        finally:
            if tracker is not None:
                tracker.discard(conn)
            conn.close()
