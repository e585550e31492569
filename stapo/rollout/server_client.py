"""A small JSON-over-HTTP client for one vLLM server (``rollout.mode: server``; docs/rollout.md).

Standard library only (``urllib``): the trainer talks to vLLM's OpenAI-compatible server
(``/v1/completions`` with token-id prompts), its health route, and — the server started by
``stapo serve`` with ``VLLM_SERVER_DEV_MODE=1`` — its ``/collective_rpc`` and ``/reset_prefix_cache``
routes, which reach stapo's worker extension (`stapo.rollout.vllm_worker`).
"""

from __future__ import annotations

import http.client
import json
import urllib.error
import urllib.request
from dataclasses import dataclass

__all__ = ["ServerClient", "ServerError", "parse_address"]


class ServerError(RuntimeError):
    """A rollout server did not answer, timed out, or answered with an HTTP error.

    ``down`` is True when nothing listens at the address (connection refused or reset): the server is
    gone, retrying it is pointless until it is restarted."""

    def __init__(self, address: str, message: str, *, down: bool = False, status: int | None = None) -> None:
        super().__init__(f"rollout server {address}: {message}")
        self.address, self.down, self.status = address, down, status


def parse_address(address: str) -> str:
    """``host:port`` (a leading ``http://`` and a trailing ``/`` are dropped); ValueError otherwise."""
    text = str(address).strip().removeprefix("http://").rstrip("/")
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"rollout server address {address!r} is not host:port (e.g. 127.0.0.1:8000)")
    return f"{host}:{int(port)}"


@dataclass(frozen=True)
class ServerClient:
    """One server at ``address`` (``host:port``); every call has a timeout in seconds."""

    address: str
    timeout_s: float = 3600.0

    @property
    def host(self) -> str:
        return self.address.rpartition(":")[0]

    def get(self, path: str, timeout_s: float | None = None) -> dict:
        return self._call(urllib.request.Request(self._url(path)), timeout_s)

    def post(self, path: str, body: dict, timeout_s: float | None = None) -> dict:
        data = json.dumps(body).encode()
        request = urllib.request.Request(self._url(path), data=data, headers={"Content-Type": "application/json"})
        return self._call(request, timeout_s)

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
        return list(reply.get("results", []))

    def _url(self, path: str) -> str:
        return f"http://{self.address}{path}"

    def _call(self, request: urllib.request.Request, timeout_s: float | None) -> dict:
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s if timeout_s is None else timeout_s) as reply:
                body = reply.read()
        except urllib.error.HTTPError as err:
            detail = err.read().decode(errors="replace")[-500:]
            raise ServerError(self.address, f"HTTP {err.code} on {request.full_url}: {detail}",
                              status=err.code) from None
        except (ConnectionError, urllib.error.URLError, TimeoutError, OSError, http.client.HTTPException) as err:
            reason = getattr(err, "reason", err)
            down = isinstance(reason, (ConnectionRefusedError, ConnectionResetError, BrokenPipeError))
            raise ServerError(self.address, f"no answer on {request.full_url} ({reason})", down=down) from None
        return json.loads(body) if body else {}
