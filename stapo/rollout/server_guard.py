"""The closed control plane of ``stapo serve``: an ASGI middleware in front of vLLM's server.

vLLM's OpenAI-compatible server serves, in its development mode (which stapo needs for
``/collective_rpc`` and ``/reset_prefix_cache``), routes that change what it serves: any worker method
by name with any string arguments, sleep / wake, weight-transfer engines, LoRA loading. Its own
``--api-key`` guards only ``/v1`` paths. `stapo serve` therefore installs `ServerGuard`
(``--middleware``, read in vLLM's ``build_app``: a class is added with ``app.add_middleware``), which

* answers ``/health`` to anyone (liveness carries no information worth a secret);
* with ``STAPO_SERVER_TOKEN`` set in the server's environment, answers every other route only to a
  request carrying ``Authorization: Bearer <secret>`` (401 otherwise; compared in constant time);
* serves the inference routes (``/v1/...``, ``/tokenize``, ``/detokenize``, ``/version``, ``/load``,
  ``/metrics``, ``/ping``), ``/reset_prefix_cache`` and ``/collective_rpc`` — the latter only for
  stapo's own worker methods (`SERVER_RPC_METHODS`) with string arguments and nothing else — and
  refuses every other route with 403, whatever the credentials (LoRA loading, sleep / wake, pause,
  vLLM's weight-transfer routes, ``/server_info``, profiling).

The policy is pure (`route_decision`, `rpc_refusal`) and tested without vLLM. What it does not do:
encrypt (anyone who can read the traffic sees the secret and the weights; keep servers inside the
cluster), or limit what an authenticated caller may generate. Docs: docs/rollout.md, "Security".
"""

from __future__ import annotations

import hmac
import json
import os

from stapo.rollout.server_worker import SERVER_RPC_METHODS

__all__ = ["GUARD_MIDDLEWARE", "ServerGuard", "TOKEN_ENV", "authorized", "route_decision", "rpc_refusal"]

TOKEN_ENV = "STAPO_SERVER_TOKEN"
GUARD_MIDDLEWARE = "stapo.rollout.server_guard.ServerGuard"
OPEN, AUTHENTICATED, FORBIDDEN = "open", "authenticated", "forbidden"
_SERVED = frozenset({"/tokenize", "/detokenize", "/version", "/load", "/metrics", "/ping", "/reset_prefix_cache",
                     "/collective_rpc"})
_FORBIDDEN_V1 = frozenset({"/v1/load_lora_adapter", "/v1/unload_lora_adapter"})
MAX_RPC_BODY = 1 << 20  # a bucket's JSON layout is a few KiB; anything this large is not stapo's


def route_decision(path: str) -> str:
    """``open`` (no secret needed), ``authenticated`` (served with the secret) or ``forbidden``."""
    path = "/" + path.strip("/") if path not in ("", "/") else "/"
    if path == "/health":
        return OPEN
    if path in _SERVED or path.startswith("/metrics/"):
        return AUTHENTICATED
    if path.startswith("/v1/") and path not in _FORBIDDEN_V1:
        return AUTHENTICATED
    return FORBIDDEN


def rpc_refusal(body: bytes) -> str | None:
    """Why a ``/collective_rpc`` body is refused, or None: only `SERVER_RPC_METHODS`, string args, no kwargs."""
    try:
        request = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return "the body is not JSON"
    if not isinstance(request, dict):
        return "the body is not a JSON object"
    method = request.get("method")
    if method not in SERVER_RPC_METHODS:
        return f"method {str(method)[:80]!r} is not one of stapo's worker methods"
    args = request.get("args", [])
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
        return "args must be a list of strings"
    if request.get("kwargs"):
        return "keyword arguments are not accepted"
    return None


def authorized(headers: list[tuple[bytes, bytes]], token: str | None) -> bool:
    """True without a token; else the request must carry ``Authorization: Bearer <token>``."""
    if not token:
        return True
    given = next((v for k, v in headers if k.lower() == b"authorization"), b"")
    return hmac.compare_digest(given, b"Bearer " + token.encode())


class ServerGuard:
    """Pure ASGI middleware applying `route_decision`, `authorized` and `rpc_refusal` (module docstring)."""

    def __init__(self, app, token: str | None = None) -> None:
        self.app = app
        self.token = token if token is not None else (os.environ.get(TOKEN_ENV) or None)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        decision = route_decision(scope.get("path", ""))
        if decision == OPEN:
            return await self.app(scope, receive, send)
        if not authorized(scope.get("headers", []), self.token):
            return await _refuse(scope, send, 401, f"this server needs the shared secret: send "
                                                   f"'Authorization: Bearer <{TOKEN_ENV}>'")
        if decision == FORBIDDEN:
            return await _refuse(scope, send, 403, f"{scope.get('path')} is not served by stapo serve")
        if scope["type"] == "http" and scope.get("path", "").rstrip("/") == "/collective_rpc":
            body, complete = await _read_body(receive)
            why = "the body is too large" if not complete else rpc_refusal(body)
            if why is not None:
                return await _refuse(scope, send, 403, f"collective_rpc refused: {why}")
            return await self.app(scope, _replay(body, receive), send)
        return await self.app(scope, receive, send)


async def _read_body(receive) -> tuple[bytes, bool]:
    """The request body, and False once it passes `MAX_RPC_BODY` (the rest is not read)."""
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return b"".join(chunks), False
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > MAX_RPC_BODY:
            return b"", False
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks), True


def _replay(body: bytes, receive):
    sent = False

    async def replayed():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()
    return replayed


async def _refuse(scope, send, status: int, detail: str) -> None:
    if scope["type"] == "websocket":
        await send({"type": "websocket.close", "code": 1008})
        return
    payload = json.dumps({"error": detail}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})
